"""examples/user_level_movielens.py on a synthetic GroupLens ratings file (the real one is in
$DPZOO_DATA): it parses ratings.dat, holds out each user's last ratings, and trains the user-level
schemes to their user-level ε."""

from __future__ import annotations

import argparse
import gzip
import importlib.util
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).parents[1] / "examples" / "user_level_movielens.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("user_level_movielens", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ratings(path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    lines = []
    for u in range(1, 41):
        for j in range(int(torch.randint(5, 25, (1,), generator=g))):
            film, rating = int(torch.randint(1, 60, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
            lines.append(f"{u}::{film}::{rating}::{1000 + j}")
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")


def test_the_example_splits_by_time_and_trains_each_scheme_to_its_user_level_epsilon(example, tmp_path):
    path = tmp_path / "ratings.dat.gz"
    _ratings(path)
    rows = example.read_ratings(path)
    (x, y), (tx, ty), users, films = example.split(rows, 0.2)
    assert users == 40 and len(x) + len(tx) == len(rows) and set(tx[:, 0].tolist()) == set(range(40))
    args = argparse.Namespace(seed=0, lr=1e-2, batch_examples=64, batch_users=10, epochs=1, delta=1e-4, clip=1.0,
                              physical=256, accountant="rdp")  # fmt: skip
    for method, k in (("uls", 8), ("els", 1)):  # ELS with k > 1 is accounted in test_user_level.py (slower)
        row = example.train(method, (x, y), (tx, ty), (users, films), args, 4.0, k)
        assert row["privacy_unit"] == "user" and row["epsilon_spent"] <= 4.0 + 1e-6
        assert 0.0 <= row["accuracy"] <= 1.0
