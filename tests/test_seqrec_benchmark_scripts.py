"""The MovieLens reproduction scripts: the runner trains every run it promises and its summary is
computed from those runs; the summariser's means, stds and same-seed differences come from the
files it reads, including runs that survive only as printed evaluation lines."""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _script(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # spawned workers (jobs > 1) would need it importable; jobs = 1 here
    spec.loader.exec_module(mod)
    return mod


def _run_json(path, model, eps, seed, curve, lr=0.01, bs=64, epochs=2):
    hist = [
        {"epoch": e, "test_ndcg@10": n / 100, "test_hit@10": 2 * n / 100, "valid_ndcg@10": n / 100} for e, n in curve
    ]
    path.write_text(
        json.dumps(
            {
                "model": model,
                "epsilon_target": eps,
                "lr": lr,
                "batch_size": bs,
                "epochs": epochs,
                "seed": seed,
                "noise_multiplier": 1.0,
                "history": hist,
            }
        )
    )


def test_summariser_reads_json_and_log_runs_and_pairs_same_seeds(tmp_path):
    summ = _script("summarize_seqrec_runs")
    (tmp_path / "runs").mkdir()
    _run_json(tmp_path / "runs" / "a.json", "dpformer", 5.0, 0, [(1, 1.0), (2, 3.0)])
    _run_json(tmp_path / "runs" / "b.json", "transformer-seqrec", 5.0, 0, [(1, 3.5), (2, 2.0)])
    (tmp_path / "x.log").write_text(
        "[dpformer s1] dpformer on ml-1m: header line\n"
        "[dpformer s1] epoch 1: test NDCG@10 0.50%  HIT@10 1.00%  ε = 3.00  (4s)\n"
        "[dpformer s1] epoch 2: test NDCG@10 5.00%  HIT@10 9.00%  ε = 5.00  (8s)\n"
    )
    summ.main([str(tmp_path), "--log-settings", "5", "0.01", "64", "--log-epochs", "2"])
    out = json.loads((tmp_path / "summary.json").read_text())
    dp = next(g for g in out["groups"] if g["model"] == "dpformer")
    assert dp["seeds"] == [0, 1] and dp["ndcg@10"] == pytest.approx([3.0, 5.0])
    assert dp["ndcg@10_mean"] == pytest.approx(4.0) and dp["ndcg@10_std"] == pytest.approx(statistics.stdev([3.0, 5.0]))
    assert dp["hit@10"] == pytest.approx([6.0, 9.0])
    (pair,) = out["dpformer_minus_transformer"]  # seed 1 has no transformer partner
    assert pair["seed"] == 0 and pair["ndcg@10_diff"] == pytest.approx(1.0)
    assert pair["max_abs_curve_diff"] == pytest.approx(2.5)  # at epoch 1, not the final gap
    assert "4.00 ± 1.41" in (tmp_path / "summary.md").read_text()


def test_summariser_compares_curves_at_common_epochs_and_handles_non_private(tmp_path):
    summ = _script("summarize_seqrec_runs")
    (tmp_path / "nonprivate").mkdir()
    _run_json(tmp_path / "nonprivate" / "a.json", "dpformer", None, 0, [(10, 1.0), (20, 2.0), (30, 4.0)])
    _run_json(tmp_path / "nonprivate" / "b.json", "transformer-seqrec", None, 0, [(20, 2.5), (40, 3.0)])
    summ.main([str(tmp_path)])
    (pair,) = json.loads((tmp_path / "summary.json").read_text())["dpformer_minus_transformer"]
    assert pair["compared_epochs"] == [20] and pair["max_abs_curve_diff"] == pytest.approx(0.5)
    assert "| seed 0 | non-private |" in (tmp_path / "summary.md").read_text()


def test_summariser_refuses_cut_off_unlabelled_and_duplicate_runs(tmp_path):
    summ = _script("summarize_seqrec_runs")
    (tmp_path / "x.log").write_text("[dpformer s1] epoch 1: test NDCG@10 0.50%  HIT@10 1.00%  ε = 3.00  (4s)\n")
    with pytest.raises(SystemExit, match="stops at epoch 1, not 2"):
        summ.main([str(tmp_path), "--log-settings", "5", "0.01", "64", "--log-epochs", "2"])
    with pytest.raises(SystemExit, match="--log-settings"):
        summ.main([str(tmp_path)])
    (tmp_path / "runs").mkdir()
    _run_json(tmp_path / "runs" / "a.json", "dpformer", 5.0, 1, [(1, 0.5)], lr=0.01, bs=64, epochs=1)
    with pytest.raises(SystemExit, match="the same run twice"):
        summ.main([str(tmp_path), "--log-settings", "5", "0.01", "64"])


def test_reproduction_runner_trains_every_promised_run_with_one_grid_point(tmp_path, capsys):
    rep = _script("reproduce_dpformer_ml1m")
    rep.main(
        [
            "--data",
            "synthetic",
            "--models",
            "gru-seqrec",
            "--epochs",
            "1",
            "--lrs",
            "1e-2",
            "--batch-sizes",
            "128",
            "--seeds",
            "2",
            "--epsilons",
            "8",
            "50",
            "--verbose",
            "--out",
            str(tmp_path),
        ]
    )
    names = sorted(p.name for p in (tmp_path / "runs").glob("*.json"))
    assert names == [
        "gru-seqrec_eps50_lr0.01_bs128_seed0.json",
        "gru-seqrec_eps8_lr0.01_bs128_seed0.json",
        "gru-seqrec_eps8_lr0.01_bs128_seed1.json",
    ]
    printed = capsys.readouterr().out
    assert "[gru-seqrec_eps8_lr0.01_bs128_seed1] epoch 1:" in printed  # --verbose
    # what --verbose printed is enough for the summariser (the runs' files lost: partial results)
    (tmp_path / "lost").mkdir()
    (tmp_path / "lost" / "verbose.log").write_text(printed)
    logged = {
        (r["epsilon"], r["seed"]): r
        for r in _script("summarize_seqrec_runs").from_log(tmp_path / "lost" / "verbose.log", None, 1)
    }
    assert set(logged) == {(8.0, 0), (8.0, 1), (50.0, 0)}
    for (eps, seed), r in logged.items():
        saved = json.loads((tmp_path / "runs" / f"gru-seqrec_eps{eps:g}_lr0.01_bs128_seed{seed}.json").read_text())
        assert r["lr"] == 0.01 and r["batch_size"] == 128
        assert r["ndcg"] == pytest.approx(100 * saved["history"][-1]["test_ndcg@10"], abs=0.005)
    runs = {n: json.loads((tmp_path / "runs" / n).read_text()) for n in names}
    summary = json.loads((tmp_path / "summary.json").read_text())
    row = next(r for r in summary["results"] if r["epsilon"] == 8)
    nd = [100 * runs[f"gru-seqrec_eps8_lr0.01_bs128_seed{s}.json"]["history"][-1]["test_ndcg@10"] for s in (0, 1)]
    assert row["seeds"] == 2 and row["ndcg@10_mean"] == pytest.approx(statistics.mean(nd))
    assert (
        runs["gru-seqrec_eps50_lr0.01_bs128_seed0.json"]["noise_multiplier"]
        < runs["gru-seqrec_eps8_lr0.01_bs128_seed0.json"]["noise_multiplier"]
    )


def test_summary_only_lists_models_never_trained(tmp_path, capsys):
    rep = _script("reproduce_dpformer_ml1m")
    rep.main(["--summary-only", "--models", "dpformer", "gru-seqrec", "--epsilons", "5", "8", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["results"] == [] and len(summary["missing"]) == 4
    assert "missing (not trained, --summary-only)" in capsys.readouterr().out
