"""Rating-file formats: parse each format into ``(user, item, timestamp)`` rows and tell the
formats apart (GroupLens ``ratings.dat``, MovieLens-100K ``u.data``, Amazon ratings CSVs of
the 2014 and 2018 releases, SASRec text). Plain or gzip-compressed; a line that does not
parse is a :class:`DataFormatError` naming the file and line.
"""

from __future__ import annotations

import gzip
import io
from pathlib import Path
from typing import Callable

from dpzoo.errors import DPZooError

__all__ = [
    "DataFormatError",
    "read_grouplens_ratings",
    "read_ml100k",
    "read_amazon_csv",
    "sniff_amazon_columns",
    "AMAZON_2014",
    "AMAZON_2018",
    "AMAZON_COLUMNS",
    "read_sasrec_text",
    "sniff_format",
    "read_interactions",
]


class DataFormatError(DPZooError, ValueError):
    """A data file with a line that is not in the expected format."""


def _open_text(path) -> io.TextIOBase:
    path = Path(path)
    if not path.is_file():
        raise DPZooError(f"Data file {str(path)!r} does not exist.")
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    raw = gzip.open(path, "rb") if gz else open(path, "rb")
    # latin-1 never fails to decode; the formats here are ASCII anyway.
    return io.TextIOWrapper(raw, encoding="latin-1", newline=None)


def _read_rows(path, parse: Callable[[str], tuple], expected: str, header: str | None = None) -> list[tuple]:
    """Parse every non-blank line of `path` with `parse`; wrap failures in DataFormatError."""
    rows = []
    first = True
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            if first:
                first = False
                line = _strip_bom(line)
                if header is not None and line.strip() == header:
                    continue
            try:
                rows.append(parse(line))
            except (ValueError, IndexError):
                shown = line if len(line) <= 80 else line[:77] + "..."
                raise DataFormatError(f"{path}: line {lineno}: expected {expected}, got {shown!r}") from None
    return rows


def _strip_bom(text: str) -> str:
    # files are read as latin-1, where a UTF-8 byte-order mark shows as these three characters
    for bom in ("\xef\xbb\xbf", "\ufeff"):
        if text.startswith(bom):
            return text[len(bom) :]
    return text


def _split_fields(line: str, sep: str | None, n: int) -> list[str]:
    parts = line.split(sep) if sep is not None else line.split()
    if len(parts) != n:
        raise ValueError(f"{len(parts)} fields")
    return [p.strip() for p in parts]


def _int(s: str) -> int:
    if not s or not s.lstrip("-").isdigit():
        raise ValueError(s)
    return int(s)


def _parse_grouplens(line: str) -> tuple[int, int, int]:
    u, i, r, t = _split_fields(line, "::", 4)
    float(r)
    return _int(u), _int(i), _int(t)


def _parse_ml100k(line: str) -> tuple[int, int, int]:
    u, i, r, t = _split_fields(line, "\t", 4)
    float(r)
    return _int(u), _int(i), _int(t)


def _parse_amazon(line: str, item_first: bool = False) -> tuple[str, str, int]:
    a, b, r, t = _split_fields(line, ",", 4)
    if not a or not b:
        raise ValueError("empty id")
    float(r)
    return (b, a, _int(t)) if item_first else (a, b, _int(t))


def read_grouplens_ratings(path) -> list[tuple[int, int, int]]:
    """MovieLens-1M/10M ``ratings.dat`` (``UserID::MovieID::Rating::Timestamp``), plain or .gz.

    Returns ``[(user, item, timestamp), ...]`` as ints, in file order (ratings ignored).
    """
    return _read_rows(
        path,
        _parse_grouplens,
        "'UserID::MovieID::Rating::Timestamp' (4 fields separated by '::', integer ids and timestamp)",
    )


def read_ml100k(path) -> list[tuple[int, int, int]]:
    """MovieLens-100K ``u.data`` (tab-separated ``user item rating timestamp``), plain or .gz."""
    return _read_rows(
        path,
        _parse_ml100k,
        "'user<TAB>item<TAB>rating<TAB>timestamp' (4 tab-separated fields, integer ids and timestamp)",
    )


AMAZON_2014 = "user,item,rating,timestamp"  # the 2014 release's ratings_*.csv (DPFormer's [28])
AMAZON_2018 = "item,user,rating,timestamp"  # the 2018 release's categoryFilesSmall/*.csv
AMAZON_COLUMNS = (AMAZON_2014, AMAZON_2018)


def read_amazon_csv(path, columns: str = AMAZON_2014) -> list[tuple[str, str, int]]:
    """Amazon review "ratings only" CSV, plain or .gz; returns ``[(user, item, timestamp), ...]``.

    The two releases order the columns differently: 2014 ``ratings_Video_Games.csv`` is
    ``user,item,rating,timestamp``, 2018 ``Video_Games.csv`` is ``item,user,rating,timestamp``;
    pass ``columns`` accordingly (:func:`sniff_amazon_columns` tells them apart by the ids'
    shape). No header in the official files; a first non-blank line exactly equal to
    ``columns`` is skipped, any other non-numeric line is an error. Ids stay strings (``A1B2C3``).
    """
    if columns not in AMAZON_COLUMNS:
        raise DPZooError(
            f"columns={columns!r}: expected {AMAZON_2014!r} (2014 release) or {AMAZON_2018!r} (2018 release)"
        )
    item_first = columns == AMAZON_2018
    return _read_rows(
        path,
        lambda line: _parse_amazon(line, item_first),
        f"'{columns}' (4 comma-separated fields, numeric rating, integer unix timestamp)",
        header=columns,
    )


def _is_asin(s: str) -> bool:
    return len(s) == 10 and s.isalnum()


def sniff_amazon_columns(path, lines: int = 2000) -> str:
    """Which Amazon column order `path` has: its header if it has one, else the ids' shape.

    Product ids (ASINs, ISBN-10s) are always 10 letters or digits; reviewer ids are mostly
    longer (``A2HD75EMZR8QLN``). Over the first `lines` rows, the column in which every id is
    ASIN-shaped while the other column's ids are not all ASIN-shaped is the item column. When
    neither column looks like ASINs (a generic CSV, integer ids) the order is user first, the
    2014 release's and the usual one. When both do, a DPZooError asks for the order. A row
    without 4 fields is a DataFormatError naming its line.
    """
    first = second = n = 0
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            text = _strip_bom(line.strip())
            if not text:
                continue
            if n == 0 and text in AMAZON_COLUMNS:
                return text  # a header line says it
            parts = text.split(",")
            if len(parts) != 4:
                raise DataFormatError(
                    f"{path}: line {lineno}: expected 'user,item,rating,timestamp' or "
                    f"'item,user,rating,timestamp' (4 comma-separated fields), got {text[:80]!r}"
                )
            n += 1
            first += _is_asin(parts[0].strip())
            second += _is_asin(parts[1].strip())
            if n >= lines:
                break
    if n == 0:
        raise DataFormatError(f"{path}: no rows; expected an Amazon ratings CSV.")
    if first < n:  # the first column is not all product ids: user first
        return AMAZON_2014
    if second < n:
        return AMAZON_2018
    raise DPZooError(
        f"{path}: cannot tell whether the Amazon CSV is {AMAZON_2014!r} (2014 release) or "
        f"{AMAZON_2018!r} (2018 release): both id columns look like product ids; give the order "
        "explicitly (load_dataset(path, amazon_columns=...) or `dpzoo train --amazon-columns ...`)."
    )


def read_sasrec_text(path) -> list[tuple[int, int, int]]:
    """SASRec text (``user item`` per line, each user's lines already in time order).

    There are no timestamps: the third element of each row is the 1-based line number,
    which is a valid time-order key (so the rows can go through :func:`sasrec_preprocess`).
    """
    counter = iter(range(1, 1 << 62))

    def parse(line):
        u, i = _split_fields(line, None, 2)
        return _int(u), _int(i), next(counter)

    return _read_rows(path, parse, "'user item' (2 whitespace-separated integers)")


def sniff_format(path) -> str:
    """'grouplens' | 'ml100k' | 'amazon' | 'sasrec', from the first non-blank line."""
    with _open_text(path) as f:
        for line in f:
            line = line.strip()
            if line:
                break
        else:
            raise DataFormatError(f"{path}: the file is empty; expected a ratings file.")
    if "::" in line:
        return "grouplens"
    if "\t" in line:
        return "ml100k"
    if "," in line:
        return "amazon"
    if len(line.split()) == 2:
        return "sasrec"
    raise DataFormatError(
        f"{path}: line 1: cannot tell the format from {line[:80]!r}; expected one of "
        "'UserID::MovieID::Rating::Timestamp', tab-separated 'user item rating timestamp', "
        "'user,item,rating,timestamp' (or 'item,user,...') or 'user item'."
    )


_READERS = {
    "grouplens": read_grouplens_ratings,
    "ml100k": read_ml100k,
    "amazon": read_amazon_csv,
    "sasrec": read_sasrec_text,
}


def read_interactions(path, amazon_columns: str | None = None) -> tuple[str, list[tuple]]:
    """``(format, rows)`` of a ratings file in the format sniffed from its first line; an Amazon
    CSV's column order is ``amazon_columns`` if given, else sniffed (:func:`sniff_amazon_columns`)."""
    fmt = sniff_format(path)
    if fmt == "amazon":
        return fmt, read_amazon_csv(path, amazon_columns or sniff_amazon_columns(path))
    return fmt, _READERS[fmt](path)
