"""Your own table as a private training set: a CSV or Parquet file of numeric features (or of a
text column) and a label.

One row per example; the column ``label_column`` (default ``"label"``) is the class, every other
column (or the ``feature_columns`` named) a numeric feature; or, for text classifiers
(:func:`read_text_table`), ``text_column`` holds each example's text. The classes are the label values
sorted (numerically when they are all integers). The file is split into train and test by a fixed
seed. Features are used as they are: no statistic of the data (a mean, a standard deviation, a
range) is computed from it, since one would be released outside the DP mechanism; scale them
beforehand with bounds you know without looking at the private rows.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Sequence

import torch
from torch.utils.data import TensorDataset

from ..errors import InvalidArgumentError, MissingDependencyError

__all__ = [
    "TABLE_SUFFIXES",
    "is_table",
    "read_table",
    "read_text_table",
    "table_splits",
    "table_eval_set",
    "split_rows",
]

TABLE_SUFFIXES = (".csv", ".parquet", ".pq")


def is_table(path: str | Path) -> bool:
    """A path whose suffix names a table format (the file is checked when it is read)."""
    return Path(path).suffix.lower() in TABLE_SUFFIXES


def _columns(path: Path) -> dict[str, list]:
    """The file's columns by name, in file order (blank lines skipped; a byte-order mark dropped)."""
    if path.suffix.lower() == ".csv":
        try:
            with path.open(newline="", encoding="utf-8-sig") as f:
                rows = [r for r in csv.reader(f) if r]
        except UnicodeDecodeError as e:
            raise InvalidArgumentError(
                f"--data {path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8."
            ) from None
        except csv.Error as e:
            raise InvalidArgumentError(f"--data {path}: not a readable CSV ({e}).") from None
        if len(rows) < 2:
            raise InvalidArgumentError(f"--data {path}: a CSV needs a header row and at least one row of data.")
        header, body = rows[0], rows[1:]
        short = next((i for i, r in enumerate(body) if len(r) != len(header)), None)
        if short is not None:
            raise InvalidArgumentError(
                f"--data {path}: data row {short + 1} has {len(body[short])} fields, the header {len(header)}."
            )
        _refuse_duplicates(path, header)
        return {name: [r[i] for r in body] for i, name in enumerate(header)}
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise MissingDependencyError("Parquet files are read with pyarrow: pip install 'dpzoo[tables]'.") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow's errors are many; one line says which file
        raise InvalidArgumentError(f"--data {path}: not a readable Parquet file ({str(e).splitlines()[0]}).") from None
    _refuse_duplicates(path, table.column_names)
    return table.to_pydict()


def _refuse_duplicates(path: Path, names: Sequence[str]) -> None:
    seen: set[str] = set()
    twice = next((n for n in names if n in seen or seen.add(n)), None)  # type: ignore[func-returns-value]
    if twice is not None:
        raise InvalidArgumentError(
            f"--data {path}: the column name {twice!r} appears twice; give each column its own name."
        )


def _number(value, column: str, row: int, path: Path) -> float:
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = math.nan
    if not math.isfinite(x):
        raise InvalidArgumentError(
            f"--data {path}: column {column!r}, row {row + 1}: {value!r} is not a finite number (features must be "
            "numeric; name the label with --label-column, or drop the column)."
        )
    return x


def _canonical_labels(labels: list[str]) -> list[str]:
    """Labels that are all whole numbers written as numbers ("1", "1.0", " 2") as "1", "1", "2":
    one class per value, not per spelling."""
    try:
        values = [float(v) for v in labels]
    except ValueError:
        return labels
    if all(math.isfinite(v) and v == int(v) for v in values):
        return [str(int(v)) for v in values]
    return labels


def _sorted_labels(values: Sequence) -> list[str]:
    names = sorted({str(v) for v in values})
    try:
        return sorted(names, key=int)
    except ValueError:
        return names


def _label_indices(
    path: Path, columns: dict, label_column: str, classes: Sequence[str] | None
) -> tuple[torch.Tensor, list[str]]:
    """(label index per row, class names) of ``label_column``."""
    if label_column not in columns:
        raise InvalidArgumentError(
            f"--data {path}: no column {label_column!r} (columns: {', '.join(list(columns)[:8])}); name the class "
            "column with --label-column."
        )
    labels = _canonical_labels([str(v) for v in columns[label_column]])
    classes = list(classes) if classes is not None else _sorted_labels(labels)
    index = {c: i for i, c in enumerate(classes)}
    unknown = next((v for v in labels if v not in index), None)
    if unknown is not None:
        raise InvalidArgumentError(f"--data {path}: label {unknown!r} is not one of the run's classes {classes[:8]}.")
    return torch.tensor([index[v] for v in labels]), classes


def _read(path: str | Path) -> tuple[Path, dict[str, list]]:
    path = Path(path)
    if not path.is_file():
        raise InvalidArgumentError(f"--data {path}: no such file (a table is a .csv or .parquet file).")
    return path, _columns(path)


def read_text_table(
    path: str | Path, text_column: str = "text", label_column: str = "label", classes: Sequence[str] | None = None
) -> tuple[list[str], torch.Tensor, list[str]]:
    """(texts, labels (N,), class names) of a CSV or Parquet file with a text column."""
    path, columns = _read(path)
    if text_column not in columns:
        raise InvalidArgumentError(
            f"--data {path}: no column {text_column!r} (columns: {', '.join(list(columns)[:8])}); name the text "
            "column with --text-column."
        )
    texts = columns[text_column]
    empty = next((i for i, t in enumerate(texts) if not isinstance(t, str) or not t.strip()), None)
    if empty is not None:
        raise InvalidArgumentError(f"--data {path}: column {text_column!r}, row {empty + 1} has no text.")
    y, classes = _label_indices(path, columns, label_column, classes)
    return list(texts), y, classes


def read_table(
    path: str | Path,
    label_column: str = "label",
    feature_columns: Sequence[str] | None = None,
    classes: Sequence[str] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[str], list[str]]:
    """(features float32 (N, F), labels (N,), class names, feature names) of a CSV or Parquet file.
    ``classes``: the label values to number (a trained run's), else the file's own, sorted."""
    path, columns = _read(path)
    y, classes = _label_indices(path, columns, label_column, classes)
    names = list(feature_columns) if feature_columns is not None else [c for c in columns if c != label_column]
    missing = [c for c in names if c not in columns]
    if missing or not names:
        raise InvalidArgumentError(f"--data {path}: no feature column{f' {missing[0]!r}' if missing else 's'}.")
    x = torch.tensor([[_number(columns[c][r], c, r, path) for c in names] for r in range(len(y))])
    return x.float(), y, classes, names


def table_splits(
    path: str | Path, label_column: str = "label", test_fraction: float = 0.2, seed: int = 0
) -> tuple[TensorDataset, TensorDataset, list[str], list[str]]:
    """(train, test, class names, feature names): the file's rows split at random (``seed``)."""
    x, y, classes, features = read_table(path, label_column)
    train, test = split_rows(path, len(y), classes, label_column, test_fraction, seed)
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test]), classes, features


def split_rows(
    path, rows: int, classes: Sequence[str], label_column: str, test_fraction: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, test) row indices of a table, at random (``seed``), after refusing a table that has
    one class or too few rows to split."""
    if len(classes) < 2:
        raise InvalidArgumentError(f"--data {path}: {len(classes)} class in {label_column!r}; a classifier needs 2.")
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    n_test = int(rows * test_fraction)
    if n_test < 1 or rows - n_test < 2:
        raise InvalidArgumentError(f"--data {path}: {rows} rows are too few to split into train and test.")
    return perm[n_test:], perm[:n_test]


def table_eval_set(
    path: str | Path, label_column: str, classes: Sequence[str], features: Sequence[str]
) -> TensorDataset:
    """Every row of ``path`` with a trained run's classes and feature columns (what ``dpzoo eval`` scores)."""
    x, y, _, _ = read_table(path, label_column, features, classes)
    return TensorDataset(x, y)
