"""The README's first-hour figures, measured the way a new user meets them: the install (a fresh
virtual environment, the README's command, no pip cache), the main job's command line (wall time,
start-up and saving included), the quick start example, a small ResNet-18 trained the same way,
and the README's test command. Each part writes ``PART.json`` to ``--out``; run the parts on a
machine with nothing else running (timings are wall-clock).

    python benchmarks/first_hour.py install cli quickstart resnet --out benchmarks/results/first_hour
    python benchmarks/first_hour.py tests --out benchmarks/results/first_hour      # the whole suite, ~12 min
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv this script runs in


def _run(cmd: list[str], cwd: Path = ROOT, env: dict | None = None) -> tuple[float, str]:
    t = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return seconds, done.stdout + done.stderr


def _size_gb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 1e9


def install() -> dict:
    """A fresh venv and the README's install command, without pip's cache (what a new machine does)."""
    with tempfile.TemporaryDirectory() as tmp:
        venv = Path(tmp) / "venv"
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        _run([str(venv / "bin/pip"), "install", "-q", "--no-cache-dir", "-e", ".[test]", "-c", "constraints.txt"])
        seconds = time.perf_counter() - t
        return {"command": 'pip install -e ".[test]" -c constraints.txt', "seconds": seconds, "venv_gb": _size_gb(venv)}


def cli() -> dict:
    """`dpzoo train cnn-tanh-gn` as a user types it: Python start-up, training, saving."""
    with tempfile.TemporaryDirectory() as tmp:
        seconds, out = _run([str(BIN / "dpzoo"), "train", "cnn-tanh-gn", "--out", f"{tmp}/run", "--quiet"])
        metrics = json.loads(Path(f"{tmp}/run/metrics.json").read_text())
    last = metrics["history"][-1] if isinstance(metrics, dict) and "history" in metrics else metrics[-1]
    return {"command": "dpzoo train cnn-tanh-gn --out runs/cnn-digits", "seconds": seconds, "last_epoch": last}


def quickstart() -> dict:
    seconds, out = _run([str(BIN / "python"), "examples/quickstart.py"])
    accuracy = [float(a) for a in re.findall(r"test accuracy ([0-9.]+)", out)]
    return {
        "command": "python examples/quickstart.py",
        "seconds": seconds,
        "test_accuracy": accuracy[-1],
        "output": out,
    }


def resnet(runs: int = 3) -> dict:
    """The README's other example, `dpzoo train resnet18-gn-bias --set width=16`, several times (secret noise)."""
    results = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = ["train", "resnet18-gn-bias", "--set", "width=16", "--out", f"{tmp}/run", "--quiet"]
            seconds, _ = _run([str(BIN / "dpzoo"), *cmd])
            history = json.loads(Path(f"{tmp}/run/metrics.json").read_text())["history"]
            parameters = _trainable_parameters(f"{tmp}/run")
        results.append(
            {"seconds": seconds, "test_accuracy": history[-1]["test_accuracy"], "epsilon": history[-1]["epsilon"]}
        )
        print(results[-1], flush=True)
    acc = [r["test_accuracy"] for r in results]
    return {
        "command": "dpzoo train resnet18-gn-bias --set width=16",
        "runs": results,
        "parameters": parameters,
        "mean_test_accuracy": statistics.mean(acc),
        "min_test_accuracy": min(acc),
        "max_test_accuracy": max(acc),
    }


def _trainable_parameters(run_dir: str) -> int:
    import dpzoo  # here, so that the parts without a model do not import torch

    return sum(p.numel() for p in dpzoo.load(run_dir).parameters() if p.requires_grad)


def tests() -> dict:
    """The README's test command, whole; its summary line."""
    done = subprocess.run([str(BIN / "python"), "-m", "pytest", "-q"], cwd=ROOT, capture_output=True, text=True)
    summary = done.stdout.strip().splitlines()[-1]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|xfailed|errors?)", summary)}
    seconds = float(re.search(r"in ([0-9.]+)s", summary).group(1))
    failed = [line.split(" ")[1] for line in done.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return {
        "command": "python -m pytest -q",
        "summary": summary,
        "counts": counts,
        "seconds": seconds,
        "failed": failed,
        "returncode": done.returncode,
    }


PARTS = {"install": install, "cli": cli, "quickstart": quickstart, "resnet": resnet, "tests": tests}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="+", choices=sorted(PARTS))
    ap.add_argument("--out", default="benchmarks/results/first_hour")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for part in args.parts:
        data = PARTS[part]()
        data.update(date=time.strftime("%Y-%m-%d"), machine=f"{os.cpu_count()} CPU cores, {platform.machine()}")
        tmp = out / f".{part}.json.tmp"
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        shutil.move(tmp, out / f"{part}.json")
        print(part, json.dumps({k: v for k, v in data.items() if k not in ("output", "runs")}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
