"""The README's main job, run several times: the noise is secret, so runs differ; the README
quotes the mean and the range over these runs. Also non-private training of the same model with
the same recipe, for reference. Writes ``main_job.json`` to ``--out``.

    python benchmarks/main_job.py --runs 5 --out benchmarks/results/main_job
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import dpzoo
from dpzoo.datasets import digits_dataset
from dpzoo.runs.classifier import evaluate_accuracy, train_image_classifier

MODEL = "cnn-tanh-gn"


def non_private(epochs: int, batch_size: int, lr: float, seed: int) -> float:
    """The same model and recipe (Adam, the card's epochs, batch and lr) without clipping or noise."""
    torch.manual_seed(seed)
    train, test = digits_dataset(size=16)
    model = dpzoo.load(MODEL, num_classes=10)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(epochs):
        for x, y in DataLoader(train, batch_size=batch_size, shuffle=True):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return evaluate_accuracy(model, test, torch.device("cpu"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/main_job")
    args = ap.parse_args(argv)
    recipe = dpzoo.model_card(MODEL).train_defaults
    runs = []
    for _ in range(args.runs):
        t = time.perf_counter()
        r = train_image_classifier(MODEL, **recipe, small=True, log=lambda m: None, progress=False)
        runs.append(
            {
                "test_accuracy": r["history"][-1]["test_accuracy"],
                "epsilon": r["epsilon"],
                "seconds": time.perf_counter() - t,
            }
        )
        print(runs[-1], flush=True)
    acc = [r["test_accuracy"] for r in runs]
    data = {
        "command": f"dpzoo train {MODEL}",
        "recipe": recipe,
        "epsilon_target": 8.0,
        "delta": 1e-5,
        "runs": runs,
        "mean_test_accuracy": statistics.mean(acc),
        "min_test_accuracy": min(acc),
        "max_test_accuracy": max(acc),
        "non_private_test_accuracy": non_private(recipe["epochs"], recipe["batch_size"], recipe["lr"], seed=0),
        "machine": f"{torch.get_num_threads()} CPU threads",
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "main_job.json").write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps({k: v for k, v in data.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
