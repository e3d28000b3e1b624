"""Sequential-recommendation data: parsers, SASRec preprocessing, leave-one-out splits.

DPFormer (a Transformer for next-item prediction) is trained with *user-level* DP: one
user's whole sequence is one sample. This module turns rating files into per-user item
sequences the way SASRec (Kang & McAuley, 2018) does, and pads them into tensors.

Pipeline::

    rows = read_grouplens_ratings("ratings.dat")     # [(user, item, timestamp), ...]
    ds = sasrec_preprocess(rows, min_count=5)        # SequenceDataset
    x, y = ds.to_padded(200, part="train")           # (U, 200) inputs / targets
    ds = load_dataset("ml-1m")                       # the released SASRec ml-1m.txt

Conventions: users and items are renumbered 1..N; item id 0 is the padding id.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import socket
import tempfile
import urllib.parse
import urllib.request
import zipfile
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import torch

from dpzoo.errors import DPZooError

__all__ = [
    "DataFormatError",
    "SequenceDataset",
    "read_grouplens_ratings",
    "read_ml100k",
    "read_amazon_csv",
    "sniff_amazon_columns",
    "AMAZON_2014",
    "AMAZON_2018",
    "read_sasrec_text",
    "sniff_format",
    "sasrec_preprocess",
    "load_dataset",
    "download",
    "DATASETS",
]


class DataFormatError(DPZooError, ValueError):
    """A data file with a line that is not in the expected format."""


# ----------------------------------------------------------------------------- parsers


def _open_text(path) -> io.TextIOBase:
    path = Path(path)
    if not path.is_file():
        raise DPZooError(f"Data file {str(path)!r} does not exist.")
    with open(path, "rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    raw = gzip.open(path, "rb") if gz else open(path, "rb")
    # latin-1 never fails to decode; the formats here are ASCII anyway.
    return io.TextIOWrapper(raw, encoding="latin-1", newline=None)


def _read_rows(path, parse: Callable[[str], tuple], expected: str,
               header: str | None = None) -> list[tuple]:
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
                raise DataFormatError(
                    f"{path}: line {lineno}: expected {expected}, got {shown!r}"
                ) from None
    return rows


def _strip_bom(text: str) -> str:
    # files are read as latin-1, where a UTF-8 byte-order mark shows as these three characters
    for bom in ("\xef\xbb\xbf", "\ufeff"):
        if text.startswith(bom):
            return text[len(bom):]
    return text


def _fields(line: str, sep: str | None, n: int) -> list[str]:
    parts = line.split(sep) if sep is not None else line.split()
    if len(parts) != n:
        raise ValueError(f"{len(parts)} fields")
    return [p.strip() for p in parts]


def _int(s: str) -> int:
    if not s or not s.lstrip("-").isdigit():
        raise ValueError(s)
    return int(s)


def _parse_grouplens(line: str) -> tuple[int, int, int]:
    u, i, r, t = _fields(line, "::", 4)
    float(r)
    return _int(u), _int(i), _int(t)


def _parse_ml100k(line: str) -> tuple[int, int, int]:
    u, i, r, t = _fields(line, "\t", 4)
    float(r)
    return _int(u), _int(i), _int(t)


def _parse_amazon(line: str, item_first: bool = False) -> tuple[str, str, int]:
    a, b, r, t = _fields(line, ",", 4)
    if not a or not b:
        raise ValueError("empty id")
    float(r)
    return (b, a, _int(t)) if item_first else (a, b, _int(t))


def read_grouplens_ratings(path) -> list[tuple[int, int, int]]:
    """MovieLens-1M/10M ``ratings.dat`` (``UserID::MovieID::Rating::Timestamp``), plain or .gz.

    Returns ``[(user, item, timestamp), ...]`` as ints, in file order (ratings ignored).
    """
    return _read_rows(path, _parse_grouplens,
                      "'UserID::MovieID::Rating::Timestamp' (4 fields separated by '::', "
                      "integer ids and timestamp)")


def read_ml100k(path) -> list[tuple[int, int, int]]:
    """MovieLens-100K ``u.data`` (tab-separated ``user item rating timestamp``), plain or .gz."""
    return _read_rows(path, _parse_ml100k,
                      "'user<TAB>item<TAB>rating<TAB>timestamp' (4 tab-separated fields, "
                      "integer ids and timestamp)")


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
        raise DPZooError(f"columns={columns!r}: expected {AMAZON_2014!r} (2014 release) "
                         f"or {AMAZON_2018!r} (2018 release)")
    item_first = columns == AMAZON_2018
    return _read_rows(path, lambda line: _parse_amazon(line, item_first),
                      f"'{columns}' (4 comma-separated fields, numeric rating, integer unix "
                      "timestamp)", header=columns)


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
                raise DataFormatError(f"{path}: line {lineno}: expected 'user,item,rating,timestamp' or "
                                      f"'item,user,rating,timestamp' (4 comma-separated fields), got {text[:80]!r}")
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
        "explicitly (load_dataset(path, amazon_columns=...) or `dpzoo train --amazon-columns ...`).")


def read_sasrec_text(path) -> list[tuple[int, int, int]]:
    """SASRec text (``user item`` per line, each user's lines already in time order).

    There are no timestamps: the third element of each row is the 1-based line number,
    which is a valid time-order key (so the rows can go through :func:`sasrec_preprocess`).
    """
    counter = iter(range(1, 1 << 62))

    def parse(line):
        u, i = _fields(line, None, 2)
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
        "'user,item,rating,timestamp' (or 'item,user,...') or 'user item'.")


_READERS = {"grouplens": read_grouplens_ratings, "ml100k": read_ml100k,
            "amazon": read_amazon_csv, "sasrec": read_sasrec_text}


# ----------------------------------------------------------------------------- dataset


class SequenceDataset:
    """Per-user item sequences (1-based item ids, 0 = padding) with a leave-one-out split.

    ``sequences[u - 1]`` is user ``u``'s time-ordered item sequence. For each user with
    at least 3 items the last item is the test target, the second-to-last the validation
    target and the rest the training part (as in SASRec). Users with fewer than 3 items
    are all training and have no validation/test target (SASRec does the same).

    ``item_counts`` (LongTensor of length ``num_items + 1``, index 0 = 0) counts each
    item over the *training* parts only, so no held-out item leaks into token frequencies.
    """

    def __init__(self, sequences: Sequence[Sequence[int]], num_items: int | None = None,
                 user_ids: Sequence | None = None, item_ids: Sequence | None = None,
                 name: str | None = None):
        self.sequences = [list(map(int, s)) for s in sequences]
        top = max((max(s) for s in self.sequences if s), default=0)
        low = min((min(s) for s in self.sequences if s), default=1)
        if low < 1:
            raise DPZooError("Item ids must be >= 1 (0 is the padding id).")
        self.num_items = int(num_items) if num_items is not None else top
        if top > self.num_items:
            raise DPZooError(f"Item id {top} exceeds num_items={self.num_items}.")
        self.num_users = len(self.sequences)
        self.user_ids = list(user_ids) if user_ids is not None else None  # original ids
        self.item_ids = list(item_ids) if item_ids is not None else None  # item_ids[k-1]
        self.name = name
        counts = torch.zeros(self.num_items + 1, dtype=torch.long)
        for s in self.train_sequences():
            if s:
                counts += torch.bincount(torch.tensor(s), minlength=self.num_items + 1)
        self.item_counts = counts

    def __len__(self) -> int:
        return self.num_users

    def __repr__(self) -> str:
        s = self.summary()
        label = f"{self.name!r}, " if self.name else ""
        return (f"SequenceDataset({label}users={s['users']}, items={s['items']}, "
                f"interactions={s['interactions']}, avg_len={s['avg_len']:.1f})")

    # -- split
    def train_sequences(self) -> list[list[int]]:
        """Training part of every user (all users, in user order; may be short)."""
        return [s[:-2] if len(s) >= 3 else list(s) for s in self.sequences]

    def validation_targets(self) -> dict[int, int]:
        """{user (1-based): validation item} for users with >= 3 items."""
        return {u: s[-2] for u, s in enumerate(self.sequences, 1) if len(s) >= 3}

    def test_targets(self) -> dict[int, int]:
        """{user (1-based): test item} for users with >= 3 items."""
        return {u: s[-1] for u, s in enumerate(self.sequences, 1) if len(s) >= 3}

    def summary(self) -> dict:
        n = sum(len(s) for s in self.sequences)
        return {"users": self.num_users, "items": self.num_items, "interactions": n,
                "avg_len": n / self.num_users if self.num_users else 0.0}

    # -- tensors
    def padded_users(self, part: str = "train") -> torch.Tensor:
        """User ids (1-based) of the rows :meth:`to_padded` returns for `part`."""
        return torch.tensor([u for u, _, _ in self._examples(part)], dtype=torch.long)

    def _examples(self, part: str) -> Iterator[tuple[int, list[int], list[int] | int]]:
        if part == "train":
            for u, s in enumerate(self.train_sequences(), 1):
                if len(s) >= 2:  # at least one (input, next item) pair
                    yield u, s[:-1], s[1:]
        elif part in ("valid", "test"):
            for u, s in enumerate(self.sequences, 1):
                if len(s) >= 3:
                    yield (u, s[:-2], s[-2]) if part == "valid" else (u, s[:-1], s[-1])
        else:
            raise DPZooError(f"part must be 'train', 'valid' or 'test', not {part!r}.")

    def to_padded(self, max_len: int, part: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) LongTensors for next-item prediction, left-padded with 0.

        * ``part="train"``: one row per user whose training part has >= 2 items;
          ``inputs = train[:-1]`` and ``targets = train[1:]`` (the next item at every
          position), both cut to their last `max_len` items and left-padded: shape
          ``(n, max_len)`` each; a target of 0 marks padding (ignore it in the loss).
        * ``part="valid"`` / ``"test"``: one row per user with >= 3 items; ``inputs`` is
          the history before the held-out item (training part for valid, training part +
          validation item for test), last `max_len`, shape ``(n, max_len)``; ``targets``
          is the held-out item, shape ``(n,)``.

        Rows are in user order; :meth:`padded_users` gives their user ids.
        """
        if int(max_len) < 1:
            raise DPZooError(f"max_len must be >= 1, not {max_len!r}.")
        max_len = int(max_len)
        ex = list(self._examples(part))
        inputs = torch.zeros(len(ex), max_len, dtype=torch.long)
        if part == "train":
            targets = torch.zeros(len(ex), max_len, dtype=torch.long)
        else:
            targets = torch.zeros(len(ex), dtype=torch.long)
        for r, (_, hist, tgt) in enumerate(ex):
            hist = hist[-max_len:]
            if hist:
                inputs[r, max_len - len(hist):] = torch.tensor(hist)
            if part == "train":
                tgt = tgt[-max_len:]
                targets[r, max_len - len(tgt):] = torch.tensor(tgt)
            else:
                targets[r] = tgt
        return inputs, targets


# ----------------------------------------------------------------------------- preprocessing


def sasrec_preprocess(interactions: Iterable[Sequence], min_count: int = 5,
                      name: str | None = None) -> SequenceDataset:
    """SASRec preprocessing of ``(user, item, timestamp)`` rows into a SequenceDataset.

    1. Filtering, **once** (not iterated to a fixed point), as SASRec's reference
       ``DataProcessing.py`` does: count each user's and each item's actions over *all*
       rows, then drop every row whose user or item has fewer than `min_count` actions.
       A kept user or item can therefore end up with fewer than `min_count` kept actions.
       ``min_count <= 1`` keeps everything.
    2. Each user's actions are sorted by timestamp; the sort is stable, so ties keep the
       order of the input rows (file order).
    3. Renumbering: users 1..U in order of first appearance among the kept rows; items
       1..I in order of first appearance when walking users in that order, each through
       their *time-ordered* sequence. (SASRec's Amazon script numbers items in file order
       instead; the released ml-1m.txt, e.g. user 1 = items 1..53, follows time order,
       which is what this function reproduces.) Id 0 is reserved for padding.

    The original ids are kept in ``ds.user_ids`` / ``ds.item_ids`` (index k-1 for id k).
    """
    rows = [(r[0], r[1], r[2]) for r in interactions]
    if min_count > 1:
        cu = Counter(u for u, _, _ in rows)
        ci = Counter(i for _, i, _ in rows)
        rows = [r for r in rows if cu[r[0]] >= min_count and ci[r[1]] >= min_count]
    by_user: dict = {}
    for u, i, t in rows:
        by_user.setdefault(u, []).append((t, i))
    item_map: dict = {}
    sequences = []
    for acts in by_user.values():
        acts.sort(key=lambda a: a[0])  # stable: ties keep input order
        seq = []
        for _, i in acts:
            k = item_map.get(i)
            if k is None:
                k = item_map[i] = len(item_map) + 1
            seq.append(k)
        sequences.append(seq)
    return SequenceDataset(sequences, num_items=len(item_map), user_ids=list(by_user),
                           item_ids=list(item_map), name=name)


# ----------------------------------------------------------------------------- loading

# Checksums of the official files. The machine this was written on cannot download them, so
# they are the values the publishers (GroupLens' .md5 files) and other public loaders verify
# against; None = none known, the download is not verified.
DATASETS = {
    "ml-1m": {
        "local": ["ml-1m/ml-1m.txt", "ml-1m/ratings.dat", "ml-1m/ratings.dat.gz"],
        "url": "https://files.grouplens.org/datasets/movielens/ml-1m.zip",
        "sha256": "a6898adb50b9ca05aa231689da44c217cb524e7ebd39d264c56e2832f2c54e20",
        "md5": "c4d9eecfca2ab87c1945afe126590906",
        "member": "ml-1m/ratings.dat",
        "file": "ml-1m/ratings.dat",
    },
    "ml-100k": {
        "local": ["ml-100k/u.data", "ml-100k/u.data.gz"],
        "url": "https://files.grouplens.org/datasets/movielens/ml-100k.zip",
        "sha256": None,  # unknown
        "md5": "0e33842e24a9c977be4e0107933c0723",
        "member": "ml-100k/u.data",
        "file": "ml-100k/u.data",
    },
    # The 'Games' category of McAuley et al. 2015, the release DPFormer (App. E.1, ref. [28])
    # and SASRec use: user,item,rating,timestamp.
    "amazon-games": {
        "local": ["amazon-games/ratings_Video_Games.csv", "amazon-games/ratings_Video_Games.csv.gz"],
        "url": "https://snap.stanford.edu/data/amazon/productGraph/categoryFiles/ratings_Video_Games.csv",
        "sha256": None,  # unknown
        "member": None,  # a plain CSV, not an archive
        "file": "amazon-games/ratings_Video_Games.csv",
        "columns": AMAZON_2014,
    },
    # The 2018 release (Ni et al.): item,user,rating,timestamp.
    "amazon-games-2018": {
        "local": ["amazon-games-2018/Video_Games.csv", "amazon-games-2018/Video_Games.csv.gz"],
        "url": "https://mcauleylab.ucsd.edu/public_datasets/data/amazon_v2/categoryFilesSmall/Video_Games.csv",
        "sha256": "c3fec1cce4ee67f0d51f8b53a7e294d8bbe6f75ca1d8732256e900b3c46606d8",
        "member": None,
        "file": "amazon-games-2018/Video_Games.csv",
        "columns": AMAZON_2018,
    },
}

_urlopen = urllib.request.urlopen  # tests monkeypatch this; never the network in tests


def default_cache_dir() -> Path:
    env = os.environ.get("DPZOO_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dpzoo"
    return base / "datasets"


def _search_roots(cache_dir) -> list[Path]:
    roots = []
    if os.environ.get("DPZOO_DATA"):
        roots.append(Path(os.environ["DPZOO_DATA"]))
    repo = Path(__file__).resolve().parents[2]
    roots += [repo.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    roots.append(Path(cache_dir) if cache_dir is not None else default_cache_dir())
    out = []
    for r in roots:
        if r not in out:
            out.append(r)
    return out


def network_reachable(url: str, timeout: float = 3.0) -> bool:
    """Whether a TCP connection to `url`'s host can be opened (file:// is always local)."""
    p = urllib.parse.urlparse(url)
    if p.scheme == "file":
        return True
    try:
        with socket.create_connection((p.hostname, p.port or (443 if p.scheme == "https" else 80)),
                                      timeout=timeout):
            return True
    except OSError:
        return False


def download(url: str, dest, sha256: str | None = None, chunk: int = 1 << 20, md5: str | None = None) -> Path:
    """Download `url` to `dest` via a temp file in the same folder, renamed atomically.

    If `sha256` and/or `md5` (what GroupLens publishes beside its zips) are given, the file is
    verified before the rename (a mismatch raises DPZooError and leaves nothing at `dest`).
    """
    dest = Path(dest)
    made = [d for d in (dest.parent, *dest.parent.parents) if not d.exists()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    h, h5 = hashlib.sha256(), hashlib.md5()
    fd, tmp = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as out, _urlopen(url) as resp:
            while True:
                block = resp.read(chunk)
                if not block:
                    break
                h.update(block)
                h5.update(block)
                out.write(block)
        for kind, got, want in (("sha256", h.hexdigest(), sha256), ("md5", h5.hexdigest(), md5)):
            if want is not None and got != want.lower():
                raise DPZooError(f"Download of {url} has {kind} {got}, expected {want}; the file is "
                                 "corrupt or has changed. Nothing was saved.")
        os.replace(tmp, dest)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        for d in made:  # folders made for this file go too, innermost first, if still empty
            try:
                d.rmdir()
            except OSError:
                break
        raise
    return dest


def _fetch(name: str, cache_dir: Path) -> Path:
    spec = DATASETS[name]
    target = cache_dir / spec["file"]
    if spec["member"] is None:
        return download(spec["url"], target, spec["sha256"], md5=spec.get("md5"))
    archive = download(spec["url"], cache_dir / Path(urllib.parse.urlparse(spec["url"]).path).name,
                       spec["sha256"], md5=spec.get("md5"))
    with zipfile.ZipFile(archive) as z:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".part", dir=target.parent)
        with os.fdopen(fd, "wb") as out, z.open(spec["member"]) as src:
            shutil.copyfileobj(src, out)
        os.replace(tmp, target)
    return target


def _load_file(path: Path, min_count: int, name: str | None,
               amazon_columns: str | None = None) -> SequenceDataset:
    fmt = sniff_format(path)
    if fmt == "amazon":
        rows = read_amazon_csv(path, amazon_columns or sniff_amazon_columns(path))
    else:
        rows = _READERS[fmt](path)
    if fmt == "sasrec":
        # Already preprocessed (filtered, time-ordered, renumbered): keep the ids as they are.
        by_user: dict = {}
        for u, i, _ in rows:
            by_user.setdefault(u, []).append(i)
        users = sorted(by_user)
        return SequenceDataset([by_user[u] for u in users], user_ids=users, name=name)
    return sasrec_preprocess(rows, min_count=min_count, name=name)


def load_dataset(name_or_path, cache_dir=None, min_count: int = 5,
                 allow_download: bool = True, amazon_columns: str | None = None) -> SequenceDataset:
    """A SequenceDataset by name ('ml-1m', 'ml-100k', 'amazon-games', 'amazon-games-2018') or from a file.

    Names are looked up, in order, under ``$DPZOO_DATA``, ``../shared/data`` relative to
    the repository and to the current directory, then `cache_dir` (default
    ``$DPZOO_CACHE`` or ``~/.cache/dpzoo/datasets``). For 'ml-1m' the released SASRec
    ``ml-1m/ml-1m.txt`` is preferred (loaded as is); a raw ``ratings.dat`` goes through
    :func:`sasrec_preprocess`. If nothing is found and the network is reachable, the
    official file is downloaded into `cache_dir`; otherwise a DPZooError says which file
    to put where. A path is read in the format sniffed from its first line; an Amazon CSV's
    column order is `amazon_columns` if given, else sniffed (:func:`sniff_amazon_columns`).
    The named Amazon datasets know their release's order.
    """
    if amazon_columns is not None and amazon_columns not in AMAZON_COLUMNS:
        raise DPZooError(f"amazon_columns={amazon_columns!r}: expected one of {AMAZON_COLUMNS}")
    if str(name_or_path) not in DATASETS:
        path = Path(name_or_path)
        if not path.is_file():
            raise DPZooError(f"{str(name_or_path)!r} is neither a dataset name "
                             f"({', '.join(DATASETS)}) nor an existing file.")
        return _load_file(path, min_count, path.name, amazon_columns)
    name = str(name_or_path)
    spec = DATASETS[name]
    if amazon_columns is not None and amazon_columns != spec.get("columns"):
        raise DPZooError(f"amazon_columns={amazon_columns!r} does not apply to {name!r}"
                         + (f", whose files are {spec['columns']!r}" if spec.get("columns") else "")
                         + "; give it only with a file path.")
    amazon_columns = spec.get("columns")
    roots = _search_roots(cache_dir)
    for root in roots:
        for rel in spec["local"]:
            if (root / rel).is_file():
                return _load_file(root / rel, min_count, name, amazon_columns)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if allow_download and network_reachable(spec["url"]):
        return _load_file(_fetch(name, cache), min_count, name, amazon_columns)
    raise DPZooError(
        f"Dataset {name!r} not found and cannot be downloaded (no network). Download "
        f"{spec['url']}" + (f", unzip it and put {spec['member']}" if spec["member"] else "")
        + f" at {cache / spec['file']} (or put {spec['local'][0]} under $DPZOO_DATA). "
        f"Looked in: {', '.join(str(r) for r in roots)}.")
