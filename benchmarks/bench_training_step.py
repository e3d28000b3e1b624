"""Time and memory of one training step: non-private vs dpzoo vs Opacus, as ratios that survive a noisy machine.

Time, per config, in ONE process: every mode's model and optimizer (and dpzoo engine / Opacus
wrapper) is built once from the same seed (``bench_modes.py``), warmed up, then run in
``--rounds`` rounds (≥ 5); in each round every mode runs ``--steps-per-round`` steps, the modes in an
order rotated by one each round (A B C, then B C A, then C A B, …) so no mode always follows a pause.
Within a round the modes take turns step by step (A B C A B C …), so each mode's steps
span the same stretch of time as the baseline's. A mode's round time is the median of its steps
in that round; its per-round ratio is that time
over non-private full training's time in the same round, so noise common to a round cancels. The
reported ratio is the median of the per-round ratios; the interval is their min–max over the
rounds, which, read as a distribution-free confidence interval for that median, covers it with
probability 1 − 2^(1 − rounds) (93.8% for 5 rounds, 98.4% for 7). DP-BiTFiT is also reported
against non-private bias-only training, round by round in the same way. On a CPU (``--floor``)
the physical floor of full DP training is timed among the modes: the non-private step plus a
Gaussian draw added to every trainable coordinate's gradient, the part of a DP step no method
avoids (on 2 CPU cores the noise alone is a large part of a small model's step); a DP mode's ratio
reads against the floor's, ``floor`` in the JSON.

Memory, per mode, in a separate process each (``--no-memory`` skips it), as a ratio to
non-private full: on CPU the peak RSS during the training steps minus the RSS before them (the
libraries, model and engine; their imports peak far above any step, which made every whole-process
ratio 1.00; the high-water mark is reset via /proc/self/clear_refs), on a GPU
``torch.cuda.max_memory_allocated``.

Writes ``training_step.json`` and ``training_step.png`` to ``--out``; ``benchmarks/table.py``
prints docs/BENCHMARKS.md's markdown tables from the JSON. Not a test: timings depend on the machine.

    python benchmarks/bench_training_step.py --configs gpt2-4x256-v1024-tied --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_modes import (
    ALL_CONFIGS,
    BASELINE,
    CONFIGS,
    FLOOR,
    MODES,
    PRECISIONS,
    SECOND_BASELINE,
    Unsupported,
    config_modes,
    cuda_peak_memory,
    failure,
    free_cuda,
    largest_batch,
    make_runner,
    peak_memory,
)

MIN_ROUNDS = 5
INTERVAL = "min-max of the per-round ratios; as a distribution-free CI for their median, coverage 1 - 2^(1 - rounds)"


def round_order(modes: list[str], r: int) -> list[str]:
    """The order of round ``r``: ``modes`` rotated left by ``r``."""
    k = r % len(modes)
    return modes[k:] + modes[:k]


def warm_up(runners: dict, warmup: int) -> dict:
    """Warm every runner up; one that fails is removed from ``runners``: {mode: its failure}."""
    failed = {}
    for m in list(runners):
        try:
            for _ in range(warmup):
                runners[m].step()
        except Exception as e:  # out of memory, or a library refusing at the first step
            failed[m] = failure(e)
            del runners[m]
    return failed


def interleave(runners: dict, rounds: int, steps_per_round: int, warmup: int) -> tuple[list[list[str]], dict]:
    """Warm every runner up, then run the rounds: (the order of each round, per mode a list per
    round of its step times in seconds)."""
    for run in runners.values():
        for _ in range(warmup):
            run.step()
    return rounds_of(runners, rounds, steps_per_round)


def rounds_of(runners: dict, rounds: int, steps_per_round: int) -> tuple[list[list[str]], dict]:
    """The interleaved rounds of warmed-up runners."""
    orders, times = [], {m: [] for m in runners}
    for r in range(rounds):
        orders.append(round_order(list(runners), r))
        for m in runners:
            times[m].append([])
        for _ in range(steps_per_round):  # A B C A B C …: each mode's steps spread over the round
            for m in orders[-1]:
                times[m][-1].append(runners[m].step())
    return orders, times


def ratio_summary(mode_rounds: list[list[float]], base_rounds: list[list[float]]) -> dict:
    """Per-round ratios (median of the mode's steps in round i over the baseline's in round i),
    their median and min–max interval."""
    if len(mode_rounds) != len(base_rounds):
        raise ValueError("mode and baseline must have the same rounds")
    per_round = [statistics.median(m) / statistics.median(b) for m, b in zip(mode_rounds, base_rounds)]
    return {
        "median": statistics.median(per_round),
        "low": min(per_round),
        "high": max(per_round),
        "per_round": per_round,
    }


def time_config(
    config: str, modes: list[str], device: str, rounds: int, steps_per_round: int, warmup: int, precision: str = "fp32"
) -> dict:
    """Build every mode of ``config`` in this process and time them interleaved."""
    runners, result = {}, {}
    for m in modes:
        try:
            runners[m] = make_runner(config, m, device, precision)
        except Unsupported as e:
            result[m] = {"status": "unsupported", "reason": str(e)}
        except Exception as e:  # e.g. out of CUDA memory while building
            result[m] = failure(e)
    result.update(warm_up(runners, warmup))
    if BASELINE not in runners:
        raise SystemExit(f"{config}: the baseline {BASELINE} must be among the modes and run: {result.get(BASELINE)}")
    orders, times = rounds_of(runners, rounds, steps_per_round)
    for m, run in runners.items():
        res = {
            "status": "ok",
            "median_ms": 1e3 * statistics.median(statistics.median(t) for t in times[m]),
            "round_ms": [[1e3 * s for s in t] for t in times[m]],
            "time_ratio": ratio_summary(times[m], times[BASELINE]),
        }
        second = SECOND_BASELINE.get(m)
        if second in runners:
            res["second_baseline"] = second
            res["time_ratio_second"] = ratio_summary(times[m], times[second])
        if run.dp_steps() is not None:
            res["dp_steps"] = run.dp_steps()
        result[m] = res
    return {"modes": {m: result[m] for m in modes}, "orders": orders}


def time_config_pairwise(
    config: str, modes: list[str], device: str, rounds: int, steps_per_round: int, warmup: int, precision: str = "fp32"
) -> dict:
    """:func:`time_config` one mode at a time: each mode interleaved with the baseline (and its second
    baseline) in a pass of its own, then freed, for models too large to hold every mode at once.
    Ratios are still per round against the baseline's steps of the same pass."""
    result, orders = {}, {}
    for m in [x for x in modes if x != BASELINE] or [BASELINE]:
        group = [x for x in modes if x in (BASELINE, m, SECOND_BASELINE.get(m))]
        part = time_config(config, group, device, rounds, steps_per_round, warmup, precision)
        orders[m] = part["orders"]
        result[m] = part["modes"][m]
        for x in group:  # the baseline as timed in the first pass
            result.setdefault(x, part["modes"][x])
        if device.startswith("cuda"):
            free_cuda()
    return {"modes": {m: result[m] for m in modes}, "orders": orders, "pairwise": True}


def memory_config(
    config: str, modes: list[str], device: str, threads: int, precision: str = "fp32", steps: int = 2
) -> dict:
    """Each mode's peak memory: on CPU from its own process; on a GPU one mode after another in this
    process, counted from the memory allocated before each is built (:func:`cuda_peak_memory`)."""
    out = {}
    for m in modes:
        if device.startswith("cuda"):
            out[m] = cuda_peak_memory(config, m, device, steps, precision)
            continue
        cmd = [sys.executable, __file__, "--worker", config, m, "--device", device, "--threads", str(threads)]
        cmd += ["--precision", precision, "--memory-steps", str(steps)]
        if "--reuse-freed-memory" in sys.argv:
            cmd.append("--reuse-freed-memory")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
            out[m] = {"status": "error", "reason": tail}
        else:
            out[m] = json.loads(proc.stdout.strip().splitlines()[-1])
    base = out.get(BASELINE, {})
    for r in out.values():
        if base.get("training_mb") and "training_mb" in r:
            r["ratio"] = r["training_mb"] / base["training_mb"]
            r["ratio_whole_process"] = r["peak_mb"] / base["peak_mb"]
        if base.get("first_step_mb") and "first_step_mb" in r:
            r["ratio_first_step"] = r["first_step_mb"] / base["first_step_mb"]
    return out


def machine_info(device: str, threads: int) -> dict:
    import torch

    cpu = platform.processor()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info = {
        "platform": platform.platform(),
        "cpu_model": cpu,
        "cpus": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
    }
    try:
        import opacus

        info["opacus"] = opacus.__version__
    except ImportError:  # pragma: no cover
        info["opacus"] = None
    try:
        git = ["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"]
        info["git_commit"] = subprocess.run(git, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["git_commit"] = None
    return info


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(data["configs"])
    modes = data["meta"]["modes"]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        xs, med, lo, hi, dots, mem = [], [], [], [], [], []
        for i, c in enumerate(configs):
            t = data["configs"][c]["time"]["modes"].get(mode, {})
            xs.append(i + j * width)
            r = t.get("time_ratio")
            med.append(r["median"] if r else float("nan"))
            lo.append(r["median"] - r["low"] if r else 0.0)
            hi.append(r["high"] - r["median"] if r else 0.0)
            dots.append(r["per_round"] if r else [])
            mem.append(data["configs"][c].get("memory", {}).get(mode, {}).get("ratio", float("nan")))
        bars = axes[0].bar(xs, med, width, yerr=[lo, hi], capsize=2, label=mode)
        for x, d in zip(xs, dots):
            axes[0].plot([x] * len(d), d, ".", ms=2, color="k", alpha=0.5)
        axes[1].bar(xs, mem, width, label=mode, color=bars.patches[0].get_facecolor())
    memory_title = (
        "peak CUDA memory" if data["meta"]["machine"]["device"].startswith("cuda") else "peak RSS added by the steps"
    )
    titles = (
        "step time / non-private full (median of per-round ratios, min–max bars, rounds as dots)",
        f"{memory_title} / non-private full (separate processes)",
    )
    for ax, title in zip(axes, titles):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(configs))])
        ax.set_xticklabels(configs, rotation=10, fontsize=8)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(title, fontsize=9)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(ALL_CONFIGS))
    ap.add_argument("--modes", nargs="*", default=MODES, help=f"any of {', '.join(MODES)} (or dpzoo-<mode>)")
    ap.add_argument("--rounds", type=int, default=7, help=f"interleaved rounds (at least {MIN_ROUNDS})")
    ap.add_argument("--steps-per-round", "--steps", dest="steps_per_round", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="steps per mode before the rounds")
    ap.add_argument("--memory-steps", type=int, default=2, help="steps in each memory process")
    ap.add_argument("--no-memory", action="store_true", help="skip the per-mode memory processes")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument(
        "--precision", default="fp32", choices=PRECISIONS, help="bf16: forward and loss under bfloat16 autocast"
    )
    ap.add_argument(
        "--pairwise",
        action="store_true",
        help="time each mode against the baseline in a pass of its own (models too large to hold all modes at once)",
    )
    ap.add_argument(
        "--max-batch",
        type=int,
        default=0,
        metavar="CAP",
        help="GPU: also find each mode's largest batch (doubling from the config's, up to CAP); 0: skip",
    )
    ap.add_argument(
        "--floor",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time the physical floor (the non-private step plus a noise draw per trainable coordinate); "
        "default: on CPU",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    ap.add_argument(
        "--reuse-freed-memory",
        action="store_true",
        help="CPU: glibc keeps freed memory for reuse (dpzoo.cpu_allocator), for every mode and memory process",
    )
    ap.add_argument("--worker", nargs=2, metavar=("CONFIG", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < MIN_ROUNDS:
        ap.error(f"--rounds must be at least {MIN_ROUNDS}")
    if BASELINE not in args.modes:
        args.modes = [BASELINE] + list(args.modes)
    for m, second in SECOND_BASELINE.items():  # a second baseline is timed whenever its mode is
        if m in args.modes and second not in args.modes:
            args.modes.insert(1, second)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    reused = False
    if args.reuse_freed_memory:
        from dpzoo.cpu_allocator import reuse_freed_memory

        reused = reuse_freed_memory()
    if args.worker:
        print(json.dumps(peak_memory(*args.worker, device, 0, args.memory_steps, args.precision)))
        return 0
    if args.max_batch and not device.startswith("cuda"):
        raise SystemExit(
            "--max-batch searches for the largest batch that fits in CUDA memory: use it with --device cuda"
        )
    data = {
        "meta": {
            "machine": machine_info(device, args.threads),
            "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + (sys.argv[1:] if argv is None else argv)),
            "modes": args.modes,
            "precision": args.precision,
            "reuse_freed_memory": reused,
            "baseline": BASELINE,
            "pairwise": args.pairwise,
            "rounds": args.rounds,
            "steps_per_round": args.steps_per_round,
            "warmup": args.warmup,
            "round_time": "median of the mode's steps in the round",
            "ratio": "median over rounds of (mode round time / baseline round time of the same round)",
            "interval": INTERVAL,
            "interval_coverage": 1 - 2.0 ** (1 - args.rounds),
            "memory": None
            if args.no_memory
            else "CPU: separate process per mode; ratio of peak RSS during the steps minus RSS before them. "
            "GPU: modes one after another in one process before the timing; ratio of torch.cuda.max_memory_allocated "
            "above the memory allocated before the mode was built (weights included), in the steps after the first "
            "(the first step's own peak is kept as first_step_mb)",
        },
        "configs": {},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "training_step" if args.precision == "fp32" else f"training_step_{args.precision}"
    cuda = device.startswith("cuda")
    for config in args.configs:
        t0 = time.time()
        modes = config_modes(config, args.modes)
        timed = modes + [FLOOR] if (args.floor if args.floor is not None else not cuda) else modes
        entry = {"config": ALL_CONFIGS[config], "modes": modes}
        if cuda and not args.no_memory:  # in this process, before the timing's runners take memory
            entry["memory"] = memory_config(config, modes, device, args.threads, args.precision, args.memory_steps)
        timer = time_config_pairwise if args.pairwise else time_config
        try:
            entry["time"] = timer(config, timed, device, args.rounds, args.steps_per_round, args.warmup, args.precision)
        except SystemExit as e:  # the baseline itself failed (e.g. out of memory): the other configs still run
            entry["time"] = {"modes": {}, "error": str(e)}
            print(e, flush=True)
        if not cuda and not args.no_memory:  # a mode refused while timing is not run again
            ok = [m for m, r in entry["time"]["modes"].items() if r["status"] == "ok" and m != FLOOR]
            entry["memory"] = memory_config(config, ok, device, args.threads, args.precision, args.memory_steps)
        if args.max_batch:
            ok = [m for m, r in entry["time"]["modes"].items() if r["status"] == "ok" and m != FLOOR]
            entry["largest_batch"] = {m: largest_batch(config, m, device, args.precision, args.max_batch) for m in ok}
        data["configs"][config] = entry
        print(f"{config}: {time.time() - t0:.0f}s", flush=True)
        for m, r in entry["time"]["modes"].items():
            mem = entry.get("memory", {}).get(m, {}).get("ratio", float("nan"))
            if r["status"] != "ok":
                print(f"  {m:<18} {r['status']}: {r['reason'][:100]}")
                continue
            q = r["time_ratio"]
            big = entry.get("largest_batch", {}).get(m, {}).get("largest_batch", "")
            print(
                f"  {m:<18} {r['median_ms']:8.1f} ms  {q['median']:5.2f}x [{q['low']:.2f}-{q['high']:.2f}]  "
                f"mem {mem:.2f}x  {f'max batch {big}' if big else ''}"
            )
        (out / f"{stem}.json").write_text(json.dumps(data, indent=2) + "\n")  # after each config
    plot(data, out / f"{stem}.png")
    print(f"wrote {out / stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
