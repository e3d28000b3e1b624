"""The figures in the prose of README.md and docs/ (RESULTS, BENCHMARKS, GUIDE), checked against
their result files.

A *figure* is a number in running text (not in code, a table, a heading or an HTML comment) that
has a decimal point or a unit after it (with its sign when it has one: ``+1.4 points``) (``%``, ``×``, ``s``, ``ms``, ``min``, ``minutes``,
``hours``, ``GB``, ``GiB``, ``MB``, ``points``, ``k``, ``M``, ``B``), and any range (``94.4–94.7%``,
``31–34``: both ends). Single plain integers (counts, sizes of a dataset, settings such as ``ε = 8``)
are not figures.

Every paragraph with a figure lies under a marker line ``<!-- figures: NAME [NAME ...] -->``: the
nearest one above it, up to the next heading. Each NAME is registered with
:func:`doc_tables.figures`; its function reads result files and returns what they support, as
strings printed the way the document prints them (``"94.6"``). A figure in the prose must be one
of them. A renderer may also name settings (inputs shown in the command beside it) and figures
quoted from a paper, each cited where it is declared. The section (heading to heading) must show
each renderer's command, as for tables.

What this cannot catch: a figure mistyped into another figure the same files support.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

FIGURE_DOCUMENTS = ("README.md", "docs/RESULTS.md", "docs/BENCHMARKS.md", "docs/GUIDE.md")
MARKER = re.compile(r"^<!-- figures: ([^>]+?) -->$")
_NUM = r"\d+(?:,\d{3})*(?:\.\d+)?"
_UNIT = r"(?:%|×|\s?(?:s|ms|min|minutes|hours|GB|GiB|MB|MiB|points)\b|[kMB]\b)"
FIGURE = re.compile(rf"(?<![\w.\-/^_+−])([+−]?{_NUM})(?:\s?[–-]\s?({_NUM}))?({_UNIT})?(?![\w.\-]?\d)(?![\w])")
# A number after one of these words names a place or a version, not a measurement.
NOT_A_FIGURE = re.compile(
    r"(?:Table|Tables|Claim|Claims|Lemma|Cor\.|Corollary|Remark|Theorem|Figure|Eq\.|App\.|Appendix|section|Section|§|"
    r"arXiv|Python|torch|transformers|Opacus|peft|PEFT|version|CUDA|cu)\s*$"
)


def figure_tokens(line: str) -> list[str]:
    """The figures of one line of prose, as printed (thousands separators dropped)."""
    text = re.sub(r"`[^`]*`|<!--.*?-->|\]\([^)]*\)", " ", line)
    found = []
    for m in FIGURE.finditer(text):
        first, second, unit = m.groups()
        if NOT_A_FIGURE.search(text[: m.start()]) or not (unit or second or "." in first):
            continue
        found += [n.replace(",", "") for n in (first, second) if n]
    return found


def prose_lines(text: str):
    """(index, line, in_prose) for every line: code blocks, tables, headings and comments are not prose."""
    fenced = False
    for i, line in enumerate(text.splitlines()):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            yield i, line, False
            continue
        yield i, line, not (fenced or line.startswith(("|", "#", "<!--")))


def problems(root: Path, sources: dict, documents=FIGURE_DOCUMENTS) -> list[str]:
    """One line per figure that no marker covers, whose renderer is unknown or whose files do not
    support it, and per marker whose section does not show its renderer's command."""
    out: list[str] = []
    for doc in documents:
        text = (root / doc).read_text()
        lines = text.splitlines()
        names: list[str] = []
        supported: set[str] = set()
        section_start = 0
        for i, line, in_prose in prose_lines(text):
            if line.startswith("#"):
                names, supported, section_start = [], set(), i
                continue
            m = MARKER.match(line)
            if m:
                names = m.group(1).split()
                supported = set()
                section = "\n".join(lines[section_start : _next_heading(lines, i)])
                for name in names:
                    source = sources.get(name)
                    if source is None:
                        out.append(f"{doc}:{i + 1}: no figures renderer registered as {name!r}")
                        continue
                    found = evidence_problems(f"{doc}:{i + 1}", f"figures {name!r}", source, root, section)
                    out += found
                    if not any("missing files" in p for p in found):
                        supported |= {str(s) for s in source.supports(root)}
                continue
            if not in_prose:
                continue
            for token in figure_tokens(line):
                if not names:
                    out.append(f"{doc}:{i + 1}: figure {token} is under no '<!-- figures: NAME -->' marker")
                elif token not in supported:
                    out.append(f"{doc}:{i + 1}: figure {token} is not supported by {' '.join(names)}'s files")
    return out


def evidence_problems(where: str, label: str, source, root: Path, section: str) -> list[str]:
    """A renderer's files that are missing, or its command that its section does not show."""
    missing = [f for f in source.files if not (root / f).exists()]
    if missing:
        return [f"{where}: {label} reads missing files {missing}"]
    if source.command not in section:
        return [f"{where}: {label}: the section does not show the command {source.command!r}"]
    return []


def _next_heading(lines: list[str], i: int) -> int:
    return next((j for j in range(i + 1, len(lines)) if lines[j].startswith("#")), len(lines))


# Helpers for renderers: the strings a value prints as.


def fixed(values: Iterable[float], *decimals: int, scale: float = 1.0) -> set[str]:
    """Each value times ``scale`` at each number of decimals (``fixed([0.946], 1, scale=100)`` = {'94.6'})."""
    return {f"{v * scale:.{d}f}" for v in values for d in decimals}


def signed(values: Iterable[float], *decimals: int, scale: float = 1.0) -> set[str]:
    """As :func:`fixed`, with the sign printed: ``+0.44``, ``−0.18`` (a typographic minus)."""
    return {f"{v * scale:+.{d}f}".replace("-", "−") for v in values for d in decimals}


def numbers_in(obj) -> list[float]:
    """Every number in a JSON value, depth first."""
    if isinstance(obj, bool):
        return []
    if isinstance(obj, (int, float)):
        return [float(obj)]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in numbers_in(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in numbers_in(v)]
    return []


def load(root: Path, path: str):
    return json.loads((root / path).read_text())
