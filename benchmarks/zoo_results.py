"""The zoo cards' "DP results": every image entry trained by ``dpzoo train`` on the bundled digits
(its small configuration, the CLI's recipe, ε = 8 at δ = 1e-5), several runs (the noise is
secret, so runs differ), beside the same configuration trained without DP (clipping and noise off, everything else the
same: the ceiling of that configuration on this data). Each entry's figures go to ``--out/ENTRY.json``; ``--write`` also
collects every entry's file there into ``dpzoo/models/dp_results.json``, which the cards render,
and rewrites the cards under ``models/``.

    python benchmarks/zoo_results.py --out benchmarks/results/zoo --write          # every image entry
    python benchmarks/zoo_results.py resnet18-gn-bias wrn16-4-gn --runs 3 --write   # some of them

Measured on the machine that runs it (CPU here: the small configurations only). An entry that
fails is reported and left out; the others are written.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "dpzoo" / "models" / "dp_results.json"


def image_entries() -> list[str]:
    from dpzoo.cli.kinds import model_kind
    from dpzoo.models import list_models

    out = []
    for name in list_models():
        try:
            if model_kind(name) == "image":
                out.append(name)
        except Exception:  # noqa: BLE001 - not trainable from the CLI
            continue
    return out


def _train(name: str, args: list[str]) -> tuple[dict, float]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "dpzoo", "train", name, *args, "--out", f"{tmp}/run", "--quiet"]
        t = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - t
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[2:])} failed: {(done.stderr or done.stdout)[-600:]}")
        return json.loads(Path(tmp, "run", "metrics.json").read_text()), seconds


def non_private(name: str, metrics: dict, seed: int = 0) -> tuple[float, float]:
    """(test accuracy, seconds) of the run's model and recipe without clipping or noise: the same
    small configuration, split, optimizer, epochs, expected batch and learning rate, shuffled batches."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    import dpzoo
    from dpzoo.runs.classifier import evaluate_accuracy, image_splits

    t = time.perf_counter()
    torch.manual_seed(seed)
    train, test, classes = image_splits(metrics["data"], metrics["image_size"], seed)
    card = dpzoo.model_card(name)
    kwargs = {**card.test_overrides, **({"img_size": metrics["image_size"]} if "img_size" in card.overrides else {})}
    model = dpzoo.load(name, **{**kwargs, "num_classes": len(classes)}).train()
    optimizers = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    opt = optimizers[metrics["optimizer"]](model.parameters(), lr=metrics["lr"], weight_decay=metrics["weight_decay"])
    for _ in range(metrics["epochs"]):
        for x, y in DataLoader(train, batch_size=metrics["batch_size"], shuffle=True):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return evaluate_accuracy(model, test, torch.device("cpu")), time.perf_counter() - t


def entry_result(name: str, runs: int, epsilon: float) -> dict:
    """``runs`` DP runs of ``name`` (seeds 0.. for the split and initialisation) and one without DP."""
    dp = [_train(name, ["--epsilon", str(epsilon), "--seed", str(seed)]) for seed in range(runs)]
    ceiling, ceiling_seconds = non_private(name, dp[0][0])
    accuracy = [m["history"][-1]["test_accuracy"] for m, _ in dp]
    first = dp[0][0]
    return {
        "model": name,
        "data": first["data"],
        "configuration": "small (the CLI's default; --full-size for the entry's full size)",
        "epsilon": round(max(m["epsilon"] for m, _ in dp), 3),
        "delta": first["delta"],
        "accountant": first["accountant"],
        "epochs": first["epochs"],
        "batch_size": first["batch_size"],
        "steps": first["steps"],
        "runs": runs,
        "test_accuracy_mean": round(statistics.mean(accuracy), 4),
        "test_accuracy_min": round(min(accuracy), 4),
        "test_accuracy_max": round(max(accuracy), 4),
        "non_private_test_accuracy": round(ceiling, 4),
        "command": f"dpzoo train {name} --epsilon {epsilon:g}",
        "seconds_per_run": round(statistics.mean(s for _, s in dp), 1),
        "non_private_seconds": round(ceiling_seconds, 1),
        "measured": {
            "date": date.today().isoformat(),
            "machine": platform.platform(),
            "python": platform.python_version(),
        },
    }


def write_cards(out: Path) -> None:
    """Collect every entry's figures in ``out`` into the package's results file, then re-render every card."""
    collected = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}
    RESULTS.write_text(json.dumps(collected, indent=2, sort_keys=True) + "\n")
    subprocess.run([sys.executable, "-m", "dpzoo", "cards", "--write", str(ROOT / "models")], cwd=ROOT, check=True)


def results_parser(description: str, default_entries: str) -> argparse.ArgumentParser:
    """The options of both zoo-results benchmarks (this one and ``zoo_text_results.py``)."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("entries", nargs="*", help=f"zoo entries (default: {default_entries})")
    p.add_argument("--runs", type=int, default=3, help="DP runs per entry, secret noise (default: 3)")
    p.add_argument("--epsilon", type=float, default=8.0, help="target ε (default: 8)")
    p.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "results" / "zoo",
        help="per-entry JSON (default: %(default)s)",
    )
    p.add_argument(
        "--write", action="store_true", help="also update dpzoo/models/dp_results.json and the cards (default: off)"
    )
    return p


def measure_entries(names, measure, describe, out: Path, write: bool, errors=(RuntimeError,)) -> int:
    """``measure(name)`` of each entry into ``out/ENTRY.json`` with a ``describe(result)`` line; an
    entry that fails (``errors``) is reported and left out; ``write``: then the results file and the
    cards. Returns the exit status (1 if any failed)."""
    out.mkdir(parents=True, exist_ok=True)
    results, failed = {}, []
    for name in names:
        try:
            results[name] = measure(name)
        except errors as e:
            failed.append(name)
            print(f"{name}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        (out / f"{name}.json").write_text(json.dumps(results[name], indent=2) + "\n")
        print(f"{name}: {describe(results[name])}", flush=True)
    if write and results:
        write_cards(out)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = results_parser(__doc__.split("\n\n")[0], "every image entry `dpzoo train` takes").parse_args(argv)
    return measure_entries(
        args.entries or image_entries(),
        lambda name: entry_result(name, args.runs, args.epsilon),
        lambda r: (
            f"{r['test_accuracy_mean']:.3f} at ε = {r['epsilon']} (non-private {r['non_private_test_accuracy']:.3f}), "
            f"{r['seconds_per_run']} s per run"
        ),
        args.out,
        args.write,
    )


if __name__ == "__main__":
    raise SystemExit(main())
