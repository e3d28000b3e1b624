"""scikit-learn's bundled handwritten digits (1,797 8×8 images, 10 classes), upscaled to RGB.

A small real image dataset that needs no download (it ships inside scikit-learn), for
examples and tests of private training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from ..errors import MissingDependencyError


def _digits(test_fraction: float, seed: int):
    """(scikit-learn's digits bunch, train indices, test indices): the split every digits view shares."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise MissingDependencyError(
            "The digits dataset ships with scikit-learn, which is not installed: pip install scikit-learn."
        ) from None
    data = load_digits()
    perm = torch.randperm(len(data.target), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(data.target) * test_fraction)
    return data, perm[n_test:], perm[:n_test]


def digits_dataset(size: int = 32, test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) TensorDatasets of (3×size×size float images, label), normalised."""
    data, train, test = _digits(test_fraction, seed)
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    x = (x - 0.5) / 0.5
    y = torch.tensor(data.target, dtype=torch.long)
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def digits_features(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) of the same digits as 64 features in [0, 1] (the 8×8 pixels / 16, row by row),
    the same split as :func:`digits_dataset`: the built-in table of tabular classifiers."""
    data, train, test = _digits(test_fraction, seed)
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])
