"""Your own images as a private training set: torchvision's ``ImageFolder`` layout, resized.

``ROOT/<class>/<image>`` (one subfolder per class), split into train and test by a fixed seed,
or ``ROOT/train/<class>/…`` with ``ROOT/val/`` (or ``ROOT/test/``) as the test split. Every image
is resized to ``size × size`` RGB and scaled to [-1, 1] with fixed constants, as the built-in
digits are: no statistic of the data (a mean, a standard deviation) is computed from it, since one
would be released outside the DP mechanism.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset, Subset

from ..errors import InvalidArgumentError, MissingDependencyError

__all__ = ["image_folder_splits", "image_folder_eval_set", "is_image_folder"]

TEST_SPLITS = ("val", "test")


def _folder(root: Path, size: int):
    try:
        from torchvision import datasets, transforms
    except ImportError:
        raise MissingDependencyError("Image folders are read with torchvision: pip install torchvision.") from None
    tf = transforms.Compose(
        [
            transforms.Resize((size, size)),
            transforms.ToTensor(),
            transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
        ]
    )
    try:
        data = datasets.ImageFolder(str(root), transform=tf)
    except (FileNotFoundError, RuntimeError) as e:  # no class folder, or no image in them
        raise InvalidArgumentError(
            f"--data {root}: not an image folder ({str(e).splitlines()[0]}); use one subfolder per class, "
            "e.g. ROOT/cat/1.png, ROOT/dog/2.jpg."
        ) from None
    if len(data.classes) < 2:
        raise InvalidArgumentError(f"--data {root}: {len(data.classes)} class folder; a classifier needs at least 2.")
    return data


def is_image_folder(path: str | Path) -> bool:
    """A directory (the layout is checked when it is read)."""
    return Path(path).is_dir()


def image_folder_splits(
    root: str | Path, size: int, test_fraction: float = 0.2, seed: int = 0
) -> tuple[Dataset, Dataset, list[str]]:
    """(train, test, class names) of the image folder ``root``: its ``train/`` and ``val/`` (or
    ``test/``) subfolders when it has them, else one folder split at random (``seed``)."""
    root = Path(root)
    if not root.is_dir():
        raise InvalidArgumentError(f"--data {root}: no such directory (an image folder has one subfolder per class).")
    if (root / "train").is_dir():
        split = next((root / s for s in TEST_SPLITS if (root / s).is_dir()), None)
        if split is None:
            raise InvalidArgumentError(
                f"--data {root}: it has train/ but no val/ or test/ beside it for the test split."
            )
        train, test = _folder(root / "train", size), _folder(split, size)
        if train.classes != test.classes:
            raise InvalidArgumentError(
                f"--data {root}: train/ and {split.name}/ have different class folders "
                f"({len(train.classes)} and {len(test.classes)}); give them the same classes."
            )
        return train, test, list(train.classes)
    data = _folder(root, size)
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed)).tolist()
    n_test = int(len(data) * test_fraction)
    if n_test < 1 or len(data) - n_test < 2:
        raise InvalidArgumentError(f"--data {root}: {len(data)} images are too few to split into train and test.")
    return Subset(data, perm[n_test:]), Subset(data, perm[:n_test]), list(data.classes)


def image_folder_eval_set(root: str | Path, size: int) -> tuple[Dataset, list[str]]:
    """What ``dpzoo eval --data ROOT`` scores: ROOT's ``val/`` (or ``test/``) when it has one, else
    every image under ROOT."""
    root = Path(root)
    if not root.is_dir():
        raise InvalidArgumentError(f"--data {root}: no such directory (an image folder has one subfolder per class).")
    split = next((root / s for s in TEST_SPLITS if (root / s).is_dir()), root)
    data = _folder(split, size)
    return data, list(data.classes)
