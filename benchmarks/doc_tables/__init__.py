"""The tables of README.md and docs/ (RESULTS, BENCHMARKS, GUIDE), rendered from committed result
files, and the figures in the prose of the same documents, checked against them
(:mod:`doc_tables.prose`).

Every table in those documents is preceded by a marker line ``<!-- table: NAME -->``. NAME is a
renderer registered here with :func:`table`: it reads its result files (paths relative to the
repository root, committed under ``benchmarks/results/``) and returns the table's markdown lines.
Each renderer also names the command that produced its files; the document must show that command
in the table's section. Figures quoted from a paper are constants in the renderer, cited there.

    python benchmarks/render_tables.py                  # check README.md and docs/*.md; exit 1 on a difference
    python benchmarks/render_tables.py --write          # rewrite the marked tables from their files
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from doc_tables import prose

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ("README.md", "docs/RESULTS.md", "docs/BENCHMARKS.md", "docs/GUIDE.md")
MARKER = re.compile(r"^<!-- table: (\S+) -->$")
# the renderer families, imported on first use
MODULES = ("gpu", "minilm", "audit", "seqrec", "seqrec_figures", "first_hour", "benchmarks_figures", "summary",
           "user_level", "gpu_half", "gpu_model", "floor", "gpu_h200_timed", "gpu_h200_1128", "gpu_stacks",
           "gpu_h200_stacks")  # fmt: skip


@dataclass(frozen=True)
class Renderer:
    name: str
    render: Callable[[Path], str]
    files: tuple[str, ...]  # the result files it reads
    command: str  # the command (or its distinctive part) that wrote them, as the document shows it


REGISTRY: dict[str, Renderer] = {}


def table(name: str, *, files: tuple[str, ...] | list[str], command: str):
    """Register ``fn(root) -> markdown`` as the renderer of the tables marked ``NAME``."""

    def register(fn):
        if name in REGISTRY:
            raise ValueError(f"two renderers for table {name!r}")
        REGISTRY[name] = Renderer(name, fn, tuple(files), command)
        return fn

    return register


@dataclass(frozen=True)
class FigureSource:
    name: str
    supports: Callable[[Path], object]  # root -> the figures its files support, as printed
    files: tuple[str, ...]
    command: str


FIGURE_SOURCES: dict[str, FigureSource] = {}


def figures(name: str, *, files: tuple[str, ...] | list[str], command: str):
    """Register ``fn(root) -> iterable of str`` as what the prose under ``<!-- figures: NAME -->`` may
    state (see :mod:`doc_tables.prose`)."""

    def register(fn):
        if name in FIGURE_SOURCES:
            raise ValueError(f"two figure sources named {name!r}")
        FIGURE_SOURCES[name] = FigureSource(name, fn, tuple(files), command)
        return fn

    return register


def renderers() -> dict[str, Renderer]:
    for module in MODULES:
        importlib.import_module(f"{__name__}.{module}")
    return REGISTRY


@dataclass
class MarkedTable:
    document: str
    name: str
    start: int  # index of the table's first line
    stop: int  # index after its last line
    lines: list[str]
    section: str  # the text from the section's heading to the marker


def marked_tables(document: str, text: str) -> list[MarkedTable]:
    """The marked tables of a document, and its tables without a marker (name ``None``)."""
    lines = text.splitlines()
    found, heading, i = [], 0, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = i
        m = MARKER.match(line)
        if m or (line.startswith("|") and not (i and lines[i - 1].startswith("|"))):
            name = m.group(1) if m else None
            start = i + 1 if m else i
            stop = start
            while stop < len(lines) and lines[stop].startswith("|"):
                stop += 1
            section = "\n".join(lines[heading:i])
            found.append(MarkedTable(document, name, start, stop, lines[start:stop], section))
            i = max(stop, i + 1)
            continue
        i += 1
    return found


def problems(root: Path = ROOT, documents=DOCUMENTS) -> list[str]:
    """One line per table that has no marker, no renderer, no file, no command nearby or that
    differs from its rendering."""
    regs, out = renderers(), []
    for doc in documents:
        for t in marked_tables(doc, (root / doc).read_text()):
            where = f"{doc}:{t.start + 1}"
            if t.name is None:
                out.append(f"{where}: a table without a '<!-- table: NAME -->' marker")
                continue
            r = regs.get(t.name)
            if r is None:
                out.append(f"{where}: no renderer registered for table {t.name!r}")
                continue
            found = prose.evidence_problems(where, f"table {t.name!r}", r, root, t.section)
            out += found
            if any("missing files" in p for p in found):
                continue
            expected = r.render(root).splitlines()
            if expected != t.lines:
                diff = next((a, b) for a, b in zip(t.lines + [""] * 99, expected + [""] * 99) if a != b)
                out.append(f"{where}: table {t.name!r} differs from its files: document {diff[0]!r}, files {diff[1]!r}")
    return out + prose.problems(root, FIGURE_SOURCES, [d for d in documents if d in prose.FIGURE_DOCUMENTS])


def write(root: Path = ROOT, documents=DOCUMENTS) -> list[str]:
    """Rewrite every marked table from its files; the names of the tables changed."""
    regs, changed = renderers(), []
    for doc in documents:
        path = root / doc
        lines = path.read_text().splitlines()
        for t in reversed(marked_tables(doc, path.read_text())):
            if t.name in regs:
                new = regs[t.name].render(root).splitlines()
                if new != t.lines:
                    lines[t.start : t.stop] = new
                    changed.append(f"{doc}: {t.name}")
        if any(c.startswith(f"{doc}:") for c in changed):
            path.write_text("\n".join(lines) + "\n")
    return changed
