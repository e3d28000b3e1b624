"""Named datasets: where their files are found or downloaded from, and :func:`load_dataset`.

Each name is a :class:`DatasetSpec` in the registry ``DATASETS`` (its local file names, official
URL, recorded checksums, parser, description); a new dataset is one :func:`register_dataset`,
and the built-ins are registered the same way. A name is looked up under ``$DPZOO_DATA``
and the cache; when absent and the network is reachable, the official file is
downloaded (:func:`download`: verified, atomic) into the cache. :func:`load_dataset` turns a
name or a path into a :class:`~dpzoo.seqrec.dataset.SequenceDataset`::

    ds = load_dataset("ml-1m")                       # the released SASRec ml-1m.txt
    register_dataset(DatasetSpec("my-data", files=("my-data/ratings.csv",), description="mine"))
    ds = load_dataset("my-data")                     # $DPZOO_DATA/my-data/ratings.csv
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import tempfile
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dpzoo.errors import DPZooError

from .dataset import SequenceDataset, dataset_from_file
from .formats import AMAZON_2014, AMAZON_2018, AMAZON_COLUMNS

__all__ = [
    "DATASETS",
    "DatasetSpec",
    "register_dataset",
    "load_dataset",
    "download",
    "default_cache_dir",
    "network_reachable",
    "search_roots",
]


@dataclass(frozen=True)
class DatasetSpec:
    """A named sequence-recommendation dataset (see :func:`register_dataset`).

    * ``files``: where a local copy may be, relative to each data root (``$DPZOO_DATA``, the
      cache) or absolute, preferred first;
    * ``url``: the official download (``None``: local files only); ``member``: the file inside
      the zip archive at ``url`` (``None``: ``url`` is the file itself); ``download_as``: where
      the downloaded file goes, relative to the cache (default ``files[0]``);
    * ``sha256`` / ``md5``: checksums of what ``url`` serves (``None``: not verified);
    * ``columns``: the column order of an Amazon CSV (``formats.AMAZON_2014`` / ``AMAZON_2018``);
    * ``parser``: ``parser(path, min_count, name) -> SequenceDataset``; ``None``: the format
      is sniffed (:func:`~dpzoo.seqrec.dataset.dataset_from_file`);
    * ``max_len``: ``dpzoo train``'s default input length on this dataset;
    * ``description``: one line, shown by ``dpzoo train --help``.
    """

    name: str
    files: tuple[str, ...] = ()
    url: str | None = None
    member: str | None = None
    download_as: str | None = None
    sha256: str | None = None
    md5: str | None = None
    columns: str | None = None
    parser: Callable[[Path, int, str], SequenceDataset] | None = None
    max_len: int = 50
    description: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or self.name != self.name.strip():
            raise DPZooError(
                f"a dataset name must be a non-empty string without surrounding blanks, got {self.name!r}."
            )
        files = (self.files,) if isinstance(self.files, (str, Path)) else self.files
        object.__setattr__(self, "files", tuple(str(f) for f in files))  # a path or a list is taken too
        if not self.files and self.url is None:
            raise DPZooError(f"dataset {self.name!r} needs local files, a url or both.")
        if self.columns is not None and self.columns not in AMAZON_COLUMNS:
            raise DPZooError(f"dataset {self.name!r}: columns={self.columns!r}, expected one of {AMAZON_COLUMNS}.")
        if self.parser is not None and not callable(self.parser):
            raise DPZooError(
                f"dataset {self.name!r}: parser must be callable (path, min_count, name), got {self.parser!r}."
            )

    @property
    def target(self) -> str:
        """Where a download goes, relative to the cache."""
        if self.download_as is not None:
            return self.download_as
        if self.files:
            return self.files[0]
        return f"{self.name}/{Path(urllib.parse.urlparse(self.url).path).name}"

    def load(self, path, min_count: int = 5) -> SequenceDataset:
        """The dataset read from ``path`` (one of its files)."""
        if self.parser is not None:
            return self.parser(Path(path), min_count, self.name)
        return dataset_from_file(path, min_count, self.name, self.columns)


# name -> DatasetSpec, in registration order (register_dataset adds to it)
DATASETS: dict[str, DatasetSpec] = {}


def register_dataset(spec: DatasetSpec, *, replace: bool = False) -> DatasetSpec:
    """Register a named dataset: afterwards ``load_dataset(spec.name)`` and ``dpzoo train --data
    spec.name`` find it. A name already registered is refused unless ``replace=True``."""
    if not isinstance(spec, DatasetSpec):
        raise DPZooError(f"register_dataset expects a DatasetSpec, got {type(spec).__name__}.")
    if spec.name in DATASETS and not replace:
        raise DPZooError(f"a dataset named {spec.name!r} is already registered (pass replace=True to replace it).")
    DATASETS[spec.name] = spec
    return spec


# Checksums of the official files. The machine this was written on cannot download them, so
# they are the values the publishers (GroupLens' .md5 files) and other public loaders verify
# against; None = none known, the download is not verified.
register_dataset(
    DatasetSpec(
        "ml-1m",
        files=("ml-1m/ml-1m.txt", "ml-1m/ratings.dat", "ml-1m/ratings.dat.gz"),
        url="https://files.grouplens.org/datasets/movielens/ml-1m.zip",
        member="ml-1m/ratings.dat",
        download_as="ml-1m/ratings.dat",
        sha256="a6898adb50b9ca05aa231689da44c217cb524e7ebd39d264c56e2832f2c54e20",
        md5="c4d9eecfca2ab87c1945afe126590906",
        max_len=200,
        description="MovieLens 1M; SASRec's ml-1m.txt preferred",
    )
)
register_dataset(
    DatasetSpec(
        "ml-100k",
        files=("ml-100k/u.data", "ml-100k/u.data.gz"),
        url="https://files.grouplens.org/datasets/movielens/ml-100k.zip",
        member="ml-100k/u.data",
        download_as="ml-100k/u.data",
        sha256=None,  # unknown
        md5="0e33842e24a9c977be4e0107933c0723",
        description="MovieLens 100K",
    )
)
# The 'Games' category of McAuley et al. 2015, the release DPFormer (App. E.1, ref. [28])
# and SASRec use: user,item,rating,timestamp.
register_dataset(
    DatasetSpec(
        "amazon-games",
        files=("amazon-games/ratings_Video_Games.csv", "amazon-games/ratings_Video_Games.csv.gz"),
        url="https://snap.stanford.edu/data/amazon/productGraph/categoryFiles/ratings_Video_Games.csv",
        member=None,  # a plain CSV, not an archive
        download_as="amazon-games/ratings_Video_Games.csv",
        sha256=None,  # unknown
        columns=AMAZON_2014,
        description="Amazon Video Games, 2014 release",
    )
)
# The 2018 release (Ni et al.): item,user,rating,timestamp.
register_dataset(
    DatasetSpec(
        "amazon-games-2018",
        files=("amazon-games-2018/Video_Games.csv", "amazon-games-2018/Video_Games.csv.gz"),
        url="https://mcauleylab.ucsd.edu/public_datasets/data/amazon_v2/categoryFilesSmall/Video_Games.csv",
        download_as="amazon-games-2018/Video_Games.csv",
        sha256="c3fec1cce4ee67f0d51f8b53a7e294d8bbe6f75ca1d8732256e900b3c46606d8",
        columns=AMAZON_2018,
        description="Amazon Video Games, 2018 release",
    )
)

# What download() opens URLs with: replace it to go through a mirror or a proxy (tests replace it
# so that they never touch the network).
urlopen = urllib.request.urlopen


def default_cache_dir() -> Path:
    env = os.environ.get("DPZOO_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dpzoo"
    return base / "datasets"


def search_roots(cache_dir=None) -> list[Path]:
    """Where :func:`load_dataset` looks for a dataset's files, in order: ``$DPZOO_DATA`` (if set),
    then ``cache_dir`` (default :func:`default_cache_dir`), where downloads go."""
    roots = []
    if os.environ.get("DPZOO_DATA"):
        roots.append(Path(os.environ["DPZOO_DATA"]))
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
        with socket.create_connection((p.hostname, p.port or (443 if p.scheme == "https" else 80)), timeout=timeout):
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
        with os.fdopen(fd, "wb") as out, urlopen(url) as resp:
            while True:
                block = resp.read(chunk)
                if not block:
                    break
                h.update(block)
                h5.update(block)
                out.write(block)
        for kind, got, want in (("sha256", h.hexdigest(), sha256), ("md5", h5.hexdigest(), md5)):
            if want is not None and got != want.lower():
                raise DPZooError(
                    f"Download of {url} has {kind} {got}, expected {want}; the file is "
                    "corrupt or has changed. Nothing was saved."
                )
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


def _fetch(spec: DatasetSpec, cache_dir: Path) -> Path:
    target = cache_dir / spec.target
    if spec.member is None:
        return download(spec.url, target, spec.sha256, md5=spec.md5)
    archive = download(spec.url, cache_dir / Path(urllib.parse.urlparse(spec.url).path).name, spec.sha256, md5=spec.md5)
    with zipfile.ZipFile(archive) as z:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".part", dir=target.parent)
        with os.fdopen(fd, "wb") as out, z.open(spec.member) as src:
            shutil.copyfileobj(src, out)
        os.replace(tmp, target)
    return target


def load_dataset(
    name_or_path, cache_dir=None, min_count: int = 5, allow_download: bool = True, amazon_columns: str | None = None
) -> SequenceDataset:
    """A SequenceDataset by name (a registered :class:`DatasetSpec`: 'ml-1m', 'ml-100k',
    'amazon-games', 'amazon-games-2018', or one of :func:`register_dataset`) or from a file.

    Names are looked up, in order, under ``$DPZOO_DATA``, then `cache_dir` (default
    ``$DPZOO_CACHE/datasets``, else ``${XDG_CACHE_HOME:-~/.cache}/dpzoo/datasets``). For 'ml-1m' the released SASRec
    ``ml-1m/ml-1m.txt`` is preferred (loaded as is); a raw ``ratings.dat`` goes through
    :func:`~dpzoo.seqrec.dataset.sasrec_preprocess`. If nothing is found and the network is reachable, the
    official file is downloaded into `cache_dir`; otherwise a DPZooError says which file
    to put where. A path is read in the format sniffed from its first line; an Amazon CSV's
    column order is `amazon_columns` if given, else sniffed (:func:`~dpzoo.seqrec.formats.sniff_amazon_columns`).
    The named Amazon datasets know their release's order.
    """
    if amazon_columns is not None and amazon_columns not in AMAZON_COLUMNS:
        raise DPZooError(f"amazon_columns={amazon_columns!r}: expected one of {AMAZON_COLUMNS}")
    if str(name_or_path) not in DATASETS:
        path = Path(name_or_path)
        if not path.is_file():
            raise DPZooError(
                f"{str(name_or_path)!r} is neither a dataset name ({', '.join(DATASETS)}) nor an existing file."
            )
        return dataset_from_file(path, min_count, path.name, amazon_columns)
    name = str(name_or_path)
    spec = DATASETS[name]
    if amazon_columns is not None and amazon_columns != spec.columns:
        raise DPZooError(
            f"amazon_columns={amazon_columns!r} does not apply to {name!r}"
            + (f", whose files are {spec.columns!r}" if spec.columns else "")
            + "; give it only with a file path."
        )
    roots = search_roots(cache_dir)
    for root in roots:
        for rel in spec.files:
            if (root / rel).is_file():
                return spec.load(root / rel, min_count)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if allow_download and spec.url is not None and network_reachable(spec.url):
        return spec.load(_fetch(spec, cache), min_count)
    looked = f"Looked in: {', '.join(str(r) for r in roots)}."
    if spec.url is None:
        raise DPZooError(
            f"Dataset {name!r} not found: it has no download, put {' or '.join(spec.files)} under $DPZOO_DATA. {looked}"
        )
    raise DPZooError(
        f"Dataset {name!r} not found and cannot be downloaded (no network). Download "
        f"{spec.url}"
        + (f", unzip it and put {spec.member}" if spec.member else "")
        + f" at {cache / spec.target}"
        + (f" (or put {spec.files[0]} under $DPZOO_DATA)" if spec.files else "")
        + f". {looked}"
    )
