"""benchmarks/profile_step.py: the profile names the phases and dpzoo's own source lines."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import their helper module by its bare name

import profile_step  # noqa: E402


def test_profile_attributes_dp_time_to_dpzoo_lines(tmp_path):
    argv = ["--configs", "gpt2-tiny-tied", "--modes", "nonprivate-full", "dpzoo-bk-mixopt", "opacus-ghost"]
    assert profile_step.main(argv + ["--steps", "1", "--warmup", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "profile_gpt2-tiny-tied_fp32.json").read_text())
    modes = {m["mode"]: m for m in data["modes"]}
    assert modes["opacus-ghost"]["status"] != "ok"  # Opacus' ghost clipping refuses a tied embedding
    for name in ("nonprivate-full", "dpzoo-bk-mixopt"):
        m = modes[name]
        assert m["status"] == "ok"
        assert set(m["phases_ms"]) == set(profile_step.PHASES)
        assert all(v > 0 for v in m["phases_ms"].values())
        assert m["top_ops"] and all(o["self_ms_per_step"] > 0 for o in m["top_ops"])
    dp_lines = [d["line"] for d in modes["dpzoo-bk-mixopt"]["dpzoo_lines"]]
    assert any(line.startswith("dpzoo/grad_norms/") for line in dp_lines), dp_lines
    # non-private training runs no per-sample code: nothing of grad_norms may show up there
    assert not any("grad_norms" in d["line"] for d in modes["nonprivate-full"]["dpzoo_lines"])
    text = (tmp_path / "profile_gpt2-tiny-tied_fp32.txt").read_text()
    assert "## dpzoo-bk-mixopt" in text and "by dpzoo source line" in text


def test_frames_outside_dpzoo_are_not_attributed():
    assert profile_step.dpzoo_frame(["torch/nn/modules/linear.py(125): forward"]) is None
    stack = ["<built-in method mm>", "/site-packages/dpzoo/grad_norms/reps.py(190): _gram", "dpzoo/x.py(1): f"]
    assert profile_step.dpzoo_frame(stack) == "dpzoo/grad_norms/reps.py(190): _gram"


def test_unknown_mode_is_refused(capsys):
    import pytest

    with pytest.raises(SystemExit):
        profile_step.main(["--modes", "dpzoo-nope"])
    assert "unknown mode(s) dpzoo-nope" in capsys.readouterr().err


def test_host_profile_names_dpzoo_functions_in_a_dp_step_and_none_in_a_non_private_one(tmp_path):
    """benchmarks/host_profile.py: the host's side of a step, by function."""
    import host_profile

    for mode in ("nonprivate-bias", "dpzoo-bitfit"):
        assert host_profile.main(["gpt2-tiny-tied", mode, "--steps", "1", "--out", str(tmp_path)]) == 0
    dp = json.loads((tmp_path / "host_gpt2-tiny-tied_dpzoo-bitfit_fp32.json").read_text())
    plain = json.loads((tmp_path / "host_gpt2-tiny-tied_nonprivate-bias_fp32.json").read_text())
    assert dp["step_ms"] > 0 and dp["profiled_step_ms"] > 0
    files = [row["file"] for row in dp["by_cumulative_time"]]
    assert any("dpzoo/grad_norms" in f or "dpzoo/privacy" in f for f in files), files
    assert not any("dpzoo/grad_norms" in row["file"] for row in plain["by_cumulative_time"])
    top = dp["by_cumulative_time"]
    assert top == sorted(top, key=lambda r: -r["cumulative_ms_per_step"])


def test_sum_guard_share_counts_the_samples_sent_to_float64(tmp_path, monkeypatch):
    """benchmarks/sum_guard_share.py: none on a tiny model's ordinary step (every ratio above 1);
    every sample of every factored parameter once kappa is made huge; the guard unwrapped after."""
    import sum_guard_share

    from dpzoo.grad_norms import sum_guard

    inner = sum_guard.risky_samples
    out = tmp_path / "share.json"
    assert sum_guard_share.main(["gpt2-tiny-untied", "--mode", "dpzoo-bk", "--steps", "2", "--out", str(out)]) == 0
    plain = json.loads(out.read_text())
    assert plain["calls"] >= 2 and set(plain["samples_to_float64"]) == {0} and plain["min_ratio"] > 1
    assert sum_guard.risky_samples is inner
    real = sum_guard.kappa
    monkeypatch.setattr(sum_guard, "kappa", lambda rep: 1e5 * (real(rep) > 0))  # every sample below kappa U
    result = sum_guard_share.share("gpt2-tiny-untied", "dpzoo-bk", "cpu", "fp32", 1)
    n = result["params_with_factored_uses"]
    assert n == plain["params_with_factored_uses"] > 0
    assert result["samples_to_float64"][-1] == n * result["batch"] and result["min_ratio"] < 1


def test_host_profile_times_named_functions_on_every_thread_and_restores_them(tmp_path):
    """``--time``: wall-clock timers on a function (and where dpzoo imported it by name) and on a
    method, their calls per step counted once per outermost call; the originals back after."""
    import host_profile

    from dpzoo.grad_norms import audit, ghost
    from dpzoo.privacy.optimizer import DPOptimizer

    before = (audit.count_edges, ghost.count_edges, DPOptimizer.pre_step)
    specs = ["dpzoo.grad_norms.audit:count_edges", "dpzoo.privacy.optimizer:DPOptimizer.pre_step"]
    assert (
        host_profile.main(["gpt2-tiny-tied", "dpzoo-bitfit", "--steps", "2", "--out", str(tmp_path), "--time", *specs])
        == 0
    )
    rows = {
        r["function"]: r
        for r in json.loads((tmp_path / "host_gpt2-tiny-tied_dpzoo-bitfit_fp32.json").read_text())["timed"]
    }
    assert rows["dpzoo.privacy.optimizer:DPOptimizer.pre_step"]["calls_per_step"] == 1
    assert rows["dpzoo.grad_norms.audit:count_edges"]["calls_per_step"] >= 1  # through ghost's imported name
    step = rows["(the step, under these timers)"]["ms_per_step"]
    assert all(0 < rows[spec]["ms_per_step"] < step for spec in specs)
    assert (audit.count_edges, ghost.count_edges, DPOptimizer.pre_step) == before


def test_memory_floor_counts_each_layers_output_gradient_once(tmp_path):
    """benchmarks/memory_floor.py on the 1-layer GPT-2 (width 16, vocab 64, untied, B 4, T 8, float32):
    the output gradients held at assembly, counted by hand per token: the embeddings' sum 16 (wte and
    wpe receive one tensor), ln_1 16, c_attn 48, attn.c_proj 16, ln_2 16, c_fc 64, mlp.c_proj 16, ln_f
    16, lm_head 64: 272 floats, 4 bytes, 32 tokens; their share of the non-private peak."""
    import memory_floor

    from dpzoo.grad_norms import hooks

    inner = hooks.assemble
    out = tmp_path / "floor.json"
    assert memory_floor.main(["--configs", "gpt2-tiny-untied", "--precision", "fp32", "--out", str(out)]) == 0
    assert hooks.assemble is inner
    (row,) = json.loads(out.read_text())["rows"]
    assert row["output_grads_mb"] * 2**20 == 272 * 4 * 32
    assert row["output_grads_share"] == row["output_grads_mb"] / row["nonprivate_peak_mb"]
    assert row["dp_all_ghost_peak_mb"] >= row["nonprivate_peak_mb"] and row["stored_inputs_mb"] > 0


def test_ab_trees_times_two_checkouts_in_alternating_rounds(tmp_path):
    """benchmarks/ab_trees.py: one worker per tree (each imports its own dpzoo), every round timed
    in both, the ratios per round; this checkout against itself on the tiny GPT-2."""
    import ab_trees

    root = str(BENCH.parent)
    out = tmp_path / "ab.json"
    argv = [root, root, "--config", "gpt2-tiny-untied", "--mode", "dpzoo-bitfit", "--rounds", "3", "--steps", "1"]
    assert ab_trees.main([*argv, "--reuse-freed-memory", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["reuse_freed_memory"] is True
    base, new = data["trees"]["base"], data["trees"]["new"]
    assert len(base["seconds_per_step"]) == len(new["seconds_per_step"]) == 3
    assert base["commit"] == new["commit"] and all(t > 0 for t in base["seconds_per_step"] + new["seconds_per_step"])
    r = data["ratio_new_to_base"]
    assert 0 < r["q1"] <= r["median"] <= r["q3"]
