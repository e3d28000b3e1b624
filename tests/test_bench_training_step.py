"""The training-step benchmark: modes interleaved in rotating rounds, every mode in every round,
each ratio taken against the baseline of the same round (median of per-round ratios, min–max
interval), the DP modes really stepping their accountants, refusals reported rather than
crashing, and the JSON that ``benchmarks/table.py`` turns into the README's table."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import their helper module by its bare name

import bench_modes  # noqa: E402
import bench_training_step as bench  # noqa: E402
import table  # noqa: E402


def test_round_order_rotates_so_each_mode_leads_once():
    modes = ["a", "b", "c"]
    orders = [bench.round_order(modes, r) for r in range(6)]
    assert orders[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert orders[3:] == orders[:3]
    assert [o[0] for o in orders[:3]] == modes


class FakeRunner:
    """Records each step in a shared log; its step time is a fixed factor times the round's noise."""

    def __init__(self, name, log, factor, noise):
        self.name, self.log, self.factor, self.noise = name, log, factor, noise

    def step(self):
        self.log.append(self.name)
        return self.factor * self.noise[0]


def test_interleave_runs_every_mode_in_every_round_in_rotated_order():
    log, noise = [], [1.0]
    runners = {m: FakeRunner(m, log, f, noise) for m, f in (("base", 1.0), ("x", 2.0), ("y", 3.0))}
    orders, times = bench.interleave(runners, rounds=5, steps_per_round=2, warmup=1)
    assert log[:3] == ["base", "x", "y"]  # warm-up: one step each
    rounds = [log[3 + 6 * r : 3 + 6 * (r + 1)] for r in range(5)]
    assert len(log) == 3 + 5 * 6
    for r, (order, ran) in enumerate(zip(orders, rounds)):
        assert order == bench.round_order(["base", "x", "y"], r)
        assert ran == order + order  # the modes take turns step by step, in the round's order
    assert [o[0] for o in orders] == ["base", "x", "y", "base", "x"]
    assert all(len(t) == 5 and all(len(s) == 2 for s in t) for t in times.values())


def test_ratios_are_taken_within_each_round():
    # noise common to a round (×1 … ×10) cancels: a mode exactly 2× the baseline is 2.0 in every round
    noise = [1.0, 10.0, 0.5, 3.0, 7.0]
    base = [[n, n * 1.1, n * 0.9] for n in noise]
    mode = [[2 * t for t in r] for r in base]
    q = bench.ratio_summary(mode, base)
    assert q == {"median": 2.0, "low": 2.0, "high": 2.0, "per_round": [2.0] * 5}
    # the same times paired with the wrong rounds give something else
    assert bench.ratio_summary(mode, base[::-1])["per_round"] != [2.0] * 5
    # one disturbed round moves the interval, not the median
    mode[3] = [100 * t for t in base[3]]
    q = bench.ratio_summary(mode, base)
    assert (q["median"], q["low"], q["high"]) == (2.0, 2.0, 100.0)
    # a round's time is the median of its steps: one slow step inside a round does not count
    mode[3] = [2 * base[3][0], 2 * base[3][2], 1000.0]  # median 2 × 3.0, the baseline round's median
    assert bench.ratio_summary(mode, base)["per_round"][3] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        bench.ratio_summary(mode[:4], base)


def test_fewer_than_five_rounds_is_refused():
    with pytest.raises(SystemExit):
        bench.parse_args(["--rounds", "4"])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["--configs", "gpt2-tiny-tied", "--rounds", "5", "--steps-per-round", "1", "--warmup", "1"]
    argv += ["--modes", "dpzoo-bk-mixopt", "dpzoo-bitfit", "opacus-hooks", "opacus-ghost"]
    argv += ["--no-memory", "--device", "cpu", "--threads", "1", "--out", str(out)]
    assert bench.main(argv) == 0
    return out, json.loads((out / "training_step.json").read_text())


def test_tiny_run_json(tiny_run):
    out, data = tiny_run
    meta = data["meta"]
    # the baseline and bitfit's second baseline are added when not asked for
    assert meta["modes"] == ["nonprivate-full", "nonprivate-bias", "dpzoo-bk-mixopt", "dpzoo-bitfit"] + [
        "opacus-hooks",
        "opacus-ghost",
    ]
    assert meta["rounds"] == 5 and meta["interval_coverage"] == pytest.approx(1 - 2**-4)
    assert meta["machine"]["device"] == "cpu" and meta["machine"]["torch"] and meta["machine"]["threads"] == 1
    assert (out / "training_step.png").stat().st_size > 0
    run = data["configs"]["gpt2-tiny-tied"]["time"]
    # on a CPU the physical floor is timed among the modes (not a mode of meta's list)
    timed = [m for m in meta["modes"] if m != "opacus-ghost"] + [bench_modes.FLOOR]
    assert run["orders"] == [bench.round_order(timed, r) for r in range(5)]
    modes = run["modes"]
    base = modes["nonprivate-full"]
    assert base["time_ratio"]["per_round"] == [1.0] * 5
    for m in timed:
        r = modes[m]
        assert r["status"] == "ok" and len(r["round_ms"]) == 5 and all(len(x) == 1 for x in r["round_ms"])
        want = [statistics.median(a) / statistics.median(b) for a, b in zip(r["round_ms"], base["round_ms"])]
        assert r["time_ratio"]["per_round"] == pytest.approx(want)
        q = r["time_ratio"]
        assert q["low"] <= q["median"] <= q["high"] and q["median"] == pytest.approx(statistics.median(want))
    bias = modes["dpzoo-bitfit"]
    assert bias["second_baseline"] == "nonprivate-bias"
    want = [a[0] / b[0] for a, b in zip(bias["round_ms"], modes["nonprivate-bias"]["round_ms"])]
    assert bias["time_ratio_second"]["per_round"] == pytest.approx(want)
    # the DP modes took the real DP step: their accountants saw every step (1 warm-up + 5 rounds)
    assert [modes[m]["dp_steps"] for m in ("dpzoo-bk-mixopt", "dpzoo-bitfit", "opacus-hooks")] == [6, 6, 6]
    assert "dp_steps" not in base
    # Opacus' ghost clipping refuses tied weights: reported with the reason, not a crash
    ghost = modes["opacus-ghost"]
    assert ghost["status"] == "unsupported" and "tied" in ghost["reason"]


def test_table_prints_the_json(tiny_run):
    _, data = tiny_run
    text = table.tables(data)
    row = next(ln for ln in text.splitlines() if ln.startswith("| gpt2-tiny-tied"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    header = next(ln for ln in text.splitlines() if ln.startswith("| step time"))
    assert header.rstrip(" |").endswith("opacus-ghost | floor")
    cells = cells[:-1]  # the floor's column
    assert cells[1] == "1.00× [1.00–1.00]" and cells[-1] == "unsupported"
    q = data["configs"]["gpt2-tiny-tied"]["time"]["modes"]["opacus-hooks"]["time_ratio"]
    assert cells[-2] == f"{q['median']:.2f}× [{q['low']:.2f}–{q['high']:.2f}]"
    assert "of nonprivate-bias)" in cells[4]
    assert "peak RSS" not in text  # no memory was measured
    assert data["meta"]["command"] in text


def test_memory_of_one_mode_and_a_refusal():
    ok = bench_modes.peak_memory("gpt2-tiny-untied", "opacus-ghost", "cpu", warmup=0, steps=1)
    assert ok["status"] == "ok" and ok["measure"] == "peak_rss_during_steps"
    assert ok["training_mb"] == pytest.approx(ok["peak_mb"] - ok["built_mb"]) and ok["training_mb"] >= 0
    refused = bench_modes.peak_memory("gpt2-tiny-tied", "opacus-ghost", "cpu", warmup=0, steps=1)
    assert refused["status"] == "unsupported" and "tied" in refused["reason"]
    with pytest.raises(bench_modes.Unsupported, match="no mode"):
        bench_modes.make_runner("gpt2-tiny-tied", "dpzoo-nonsense")


def test_bf16_run_of_a_config_with_its_own_modes(tmp_path):
    """The GPU table's options on CPU: --precision bf16 (autocast) writes training_step_bf16.json, a
    config's ``modes`` key limits what is built (llama: no Opacus), and a mode failing at its first
    step is reported with its reason while the others are timed."""
    argv = ["--configs", "llama-tiny", "--rounds", "5", "--steps-per-round", "1", "--warmup", "1", "--no-memory"]
    argv += ["--modes", "dpzoo-bitfit", "opacus-hooks", "--precision", "bf16", "--device", "cpu", "--threads", "1"]
    assert bench.main(argv + ["--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "training_step_bf16.json").read_text())
    assert data["meta"]["precision"] == "bf16" and (tmp_path / "training_step_bf16.png").stat().st_size > 0
    entry = data["configs"]["llama-tiny"]
    assert entry["modes"] == ["nonprivate-full", "nonprivate-bias", "dpzoo-bitfit"]  # opacus-hooks not offered
    assert entry["time"]["modes"]["dpzoo-bitfit"]["dp_steps"] == 6
    assert "bf16" in table.tables(data)


def test_a_mode_failing_in_its_warm_up_is_reported_and_dropped():
    class Breaks:
        def step(self):
            raise RuntimeError("expected scalar type Float but found BFloat16")

    class Fine:
        def step(self):
            return 0.001

    runners = {"nonprivate-full": Fine(), "opacus-hooks": Breaks()}
    failed = bench.warm_up(runners, 1)
    assert list(runners) == ["nonprivate-full"]
    assert failed["opacus-hooks"]["status"] == "error" and "BFloat16" in failed["opacus-hooks"]["reason"]


def test_max_batch_needs_a_gpu_and_unknown_precision_is_refused():
    with pytest.raises(SystemExit, match="CUDA"):
        bench.main(["--configs", "gpt2-tiny-tied", "--device", "cpu", "--max-batch", "64", "--no-memory"])
    with pytest.raises(ValueError, match="precision"):
        bench_modes.make_runner("gpt2-tiny-tied", "nonprivate-full", precision="fp8")
    assert bench_modes.config_modes("llama-bias-1b-t512", bench_modes.MODES) == bench_modes.LLAMA_MODES


def test_pairwise_timing_gives_every_mode_its_own_pass_against_the_baseline(tmp_path):
    argv = ["--configs", "gpt2-tiny-untied", "--rounds", "5", "--steps-per-round", "1", "--warmup", "1"]
    argv += ["--modes", "dpzoo-bk", "dpzoo-bitfit", "--pairwise", "--no-memory", "--device", "cpu", "--threads", "1"]
    assert bench.main(argv + ["--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "training_step.json").read_text())
    run = data["configs"]["gpt2-tiny-untied"]["time"]
    assert data["meta"]["pairwise"] and run["pairwise"]
    # one pass per mode; bitfit's pass holds its second baseline too
    assert {m: sorted(o[0]) for m, o in run["orders"].items()} == {
        "nonprivate-bias": ["nonprivate-bias", "nonprivate-full"],
        "dpzoo-bk": ["dpzoo-bk", "nonprivate-full"],
        "dpzoo-bitfit": ["dpzoo-bitfit", "nonprivate-bias", "nonprivate-full"],
        "floor": ["floor", "nonprivate-full"],
    }
    modes = run["modes"]
    assert modes["dpzoo-bk"]["dp_steps"] == 6 and "time_ratio_second" in modes["dpzoo-bitfit"]
    assert modes["nonprivate-full"]["time_ratio"]["per_round"] == [1.0] * 5


def test_the_floor_is_the_non_private_step_plus_noise_on_every_trainable_coordinate():
    """Built from the same seed, the floor's step moves the weights as the non-private step does
    plus SGD's step on fresh noise: different weights, by about lr·σ per coordinate."""
    import torch

    runs = {m: bench_modes.make_runner("gpt2-tiny-tied", m) for m in ("nonprivate-full", bench_modes.FLOOR)}
    for a, b in zip(*(r.model.parameters() for r in runs.values())):
        assert torch.equal(a, b)  # the same start
    for run in runs.values():
        run.step()
    plain, floor = ([p.detach() for p in r.model.parameters()] for r in runs.values())
    moved = torch.cat([(f - p).flatten() for f, p in zip(floor, plain)])
    assert moved.numel() == sum(p.numel() for p in plain)
    assert 0.5e-4 < moved.std().item() < 2e-4  # lr 1e-4 times N(0, 1)
