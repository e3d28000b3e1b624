"""User-level DP on real MovieLens users: which of a person's films they liked, trained so that the
guarantee covers all of a user's ratings at once, by both of dpzoo's schemes at the same user-level ε.

Data: the GroupLens MovieLens-1M ratings (``ratings.dat``, ``UserID::MovieID::Rating::Timestamp``;
the shared sample holds users 1-2999, 487,650 ratings). Task: liked (rating ≥ 4) or not, for a
(user, film) pair; each user's last ``--test-fraction`` of ratings by time is the test set. Model: a
user and a film embedding (d = 16) and a linear layer on [u, m, u ⊙ m] (a factorisation model).

Methods, every private one at the same **user-level** (ε, δ):

- ``uls``: ``privacy_unit="user"``, user-level sampling: Poisson over users, at most k of a sampled
  user's ratings per step, each user's summed gradient clipped (``--k-uls``);
- ``els``: ``user_sampling="examples"``: k ratings per user kept for the whole run, ratings sampled
  and clipped one by one, ε of the mixture of Gaussians (``accountant="pld"``; ``--k-els``);
- ``example``: example-level DP at the same ε *per rating* (the default ``privacy_unit``), for
  reference: its guarantee for a user with n ratings is only group privacy's n·ε;
- ``non-private``: the same model and epochs without DP.

    DPZOO_DATA=../shared/data python examples/user_level_movielens.py --out benchmarks/results/user_level_movielens
        [--epsilon 2 8] [--epochs 20] [--k-uls 32] [--k-els 4 16] [--quick]

Writes ``results.json`` (one row per method and ε: test accuracy and log-loss, σ, steps, seconds) and
``results.png``. Noise and sampling are secret (OS entropy): a rerun differs from the last one.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo


def read_ratings(path: Path) -> list[tuple[int, int, int, int]]:
    """(user, film, rating, timestamp) rows of a GroupLens ratings.dat (plain or .gz)."""
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="latin-1") as f:
        for line in f:
            u, m, r, t = line.strip().split("::")
            rows.append((int(u), int(m), int(r), int(t)))
    return rows


def split(rows, test_fraction: float):
    """Train and test (users, films, liked) tensors: each user's last ratings by time are the test set."""
    by_user: dict[int, list] = {}
    for u, m, r, t in rows:
        by_user.setdefault(u, []).append((t, m, r))
    users = {u: i for i, u in enumerate(sorted(by_user))}
    films = {m: i for i, m in enumerate(sorted({m for _, m, _, _ in rows}))}
    train, test = [], []
    for u, items in by_user.items():
        items.sort()
        cut = len(items) - max(1, round(test_fraction * len(items)))
        for j, (_, m, r) in enumerate(items):
            (train if j < cut else test).append((users[u], films[m], float(r >= 4)))
    as_tensors = lambda part: (  # noqa: E731
        torch.tensor([[a, b] for a, b, _ in part]),
        torch.tensor([c for _, _, c in part]),
    )
    return as_tensors(train), as_tensors(test), len(users), len(films)


class Factorisation(nn.Module):
    """logit(liked) = w · [u, m, u ⊙ m] + b for the user's and the film's embeddings."""

    def __init__(self, users: int, films: int, dim: int = 16):
        super().__init__()
        self.user, self.film = nn.Embedding(users, dim), nn.Embedding(films, dim)
        nn.init.normal_(self.user.weight, std=0.1)
        nn.init.normal_(self.film.weight, std=0.1)
        self.head = nn.Linear(3 * dim, 1)

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        u, m = self.user(pairs[:, 0]), self.film(pairs[:, 1])
        return self.head(torch.cat([u, m, u * m], -1)).squeeze(-1)


@torch.no_grad()
def evaluate(model, x, y) -> dict:
    model.eval()
    logits = torch.cat([model(x[i : i + 65536]) for i in range(0, len(x), 65536)])
    model.train()
    return {
        "accuracy": float(((logits > 0).float() == y).float().mean()),
        "log_loss": float(F.binary_cross_entropy_with_logits(logits, y)),
    }


def train(method: str, data, test, sizes, args, epsilon: float | None, k: int | None) -> dict:
    """Train one method from the same initialisation; its test metrics and, if private, its record."""
    (x, y), (tx, ty), (users, films) = data, test, sizes
    torch.manual_seed(args.seed)
    model = Factorisation(users, films)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    start = time.perf_counter()
    row = {"method": method, "epsilon": epsilon, "k": k}
    if method == "non-private":
        loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_examples, shuffle=True)
        for _ in range(args.epochs):
            for bx, by in loader:
                F.binary_cross_entropy_with_logits(model(bx), by).backward()
                opt.step()
                opt.zero_grad()
        return {**row, **evaluate(model, tx, ty), "seconds": time.perf_counter() - start}
    unit = {}
    if method == "uls":
        unit = dict(privacy_unit="user", user_ids=x[:, 0].tolist(), max_examples_per_user=k)
        batch = args.batch_users
    elif method == "els":
        unit = dict(privacy_unit="user", user_ids=x[:, 0].tolist(), max_examples_per_user=k, user_sampling="examples")
        kept = int(torch.bincount(x[:, 0]).clamp(max=k).sum())  # at most k ratings per user
        batch = max(1, round(args.batch_users / users * kept))  # the same rate q as user-level sampling
    else:
        batch = args.batch_examples
    engine = dpzoo.PrivacyEngine(accountant=args.accountant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpzoo.errors.WeakPrivacyWarning)
        model, opt, loader = engine.make_private(
            module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y), batch_size=batch),
            target_epsilon=epsilon, target_delta=args.delta, epochs=args.epochs, max_grad_norm=args.clip,
            clipping="automatic", max_physical_batch_size=args.physical, **unit,
        )  # fmt: skip
    for _ in range(args.epochs):
        for bx, by in loader:
            F.binary_cross_entropy_with_logits(model(bx), by).backward()
            opt.step()
            opt.zero_grad()
    record = engine.privacy_metadata(args.delta)
    return {
        **row, **evaluate(model, tx, ty), "seconds": time.perf_counter() - start, "epsilon_spent": record["epsilon"],
        "noise_multiplier": record["noise_multiplier"], "sample_rate": record["sample_rate"], "steps": record["steps"],
        "privacy_unit": record["privacy_unit"], "expected_batch": engine.expected_batch_size,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    root = os.environ.get("DPZOO_DATA")
    default = Path(root) / "ml-1m-raw-sample" / "ratings.dat.gz" if root else None
    parser.add_argument(
        "--data", type=Path, default=default, help="ratings.dat(.gz) (default: $DPZOO_DATA/ml-1m-raw-sample)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("runs/user_level_movielens"), help="output folder (default: %(default)s)"
    )
    parser.add_argument(
        "--epsilon", type=float, nargs="+", default=[2.0, 8.0], help="user-level ε (default: %(default)s)"
    )
    parser.add_argument("--delta", type=float, default=1e-6, help="δ, below 1/ratings too (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=20, help="epochs (default: %(default)s)")
    parser.add_argument(
        "--k-uls", type=int, nargs="+", default=[32], help="k of user-level sampling (default: %(default)s)"
    )
    parser.add_argument(
        "--k-els", type=int, nargs="+", default=[4, 16], help="k of example-level sampling (default: %(default)s)"
    )
    parser.add_argument("--batch-users", type=int, default=1024, help="expected users per step (default: %(default)s)")
    parser.add_argument(
        "--batch-examples", type=int, default=4096, help="examples per step, example-level (default: %(default)s)"
    )
    parser.add_argument("--physical", type=int, default=8192, help="max_physical_batch_size (default: %(default)s)")
    parser.add_argument("--clip", type=float, default=1.0, help="R (default: %(default)s)")
    parser.add_argument(
        "--accountant", default="pld", help="pld (example-level sampling needs it) | rdp (default: %(default)s)"
    )
    parser.add_argument("--lr", type=float, default=2e-2, help="Adam learning rate (default: %(default)s)")
    parser.add_argument(
        "--test-fraction", type=float, default=0.2, help="each user's last ratings held out (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="the first 300 users, 2 epochs, one ε (default: off)")
    args = parser.parse_args()
    if args.data is None or not args.data.exists():
        sys.exit(
            f"ratings not found ({args.data}): pass --data PATH or set DPZOO_DATA to the folder holding ml-1m-raw-sample"
        )
    rows = read_ratings(args.data)
    if args.quick:
        rows = [r for r in rows if r[0] <= 300]
        args.epochs, args.epsilon, args.k_els = 2, args.epsilon[:1], args.k_els[:1]
    train_set, test_set, users, films = split(rows, args.test_fraction)
    counts = torch.bincount(train_set[0][:, 0])
    results = [train("non-private", train_set, test_set, (users, films), args, None, None)]
    for eps in args.epsilon:
        for k in args.k_uls:
            results.append(train("uls", train_set, test_set, (users, films), args, eps, k))
        for k in args.k_els:
            results.append(train("els", train_set, test_set, (users, films), args, eps, k))
        results.append(train("example", train_set, test_set, (users, films), args, eps, None))
        print(json.dumps(results[-1]), flush=True)
    out = {
        "data": {"ratings": len(rows), "users": users, "films": films, "train": len(train_set[1]),
                 "test": len(test_set[1]), "liked_rate_test": float(test_set[1].mean()),
                 "ratings_per_user": {"median": float(counts.median()), "max": int(counts.max())}},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": results,
        "machine": f"{torch.get_num_threads()} threads, {platform.machine()}",
        "torch": torch.__version__,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps([{k: r.get(k) for k in ("method", "epsilon", "k", "accuracy")} for r in results], indent=1))
    if math.isfinite(out["data"]["liked_rate_test"]):
        plot(out, args.out / "results.png")


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    base = next(r["accuracy"] for r in out["results"] if r["method"] == "non-private")
    ax.axhline(base, color="grey", ls="--", label="non-private")
    ax.axhline(max(out["data"]["liked_rate_test"], 1 - out["data"]["liked_rate_test"]), color="grey", ls=":",
               label="majority class")  # fmt: skip
    for label in sorted({(r["method"], r["k"]) for r in out["results"] if r["method"] != "non-private"}, key=str):
        rs = [r for r in out["results"] if (r["method"], r["k"]) == label]
        name = label[0] + (f", k = {label[1]}" if label[1] else " (per rating, not per user)")
        ax.plot([r["epsilon"] for r in rs], [r["accuracy"] for r in rs], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("ε (per user; per rating for 'example')")
    ax.set_ylabel("test accuracy (liked)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
