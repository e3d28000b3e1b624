"""Every table of README.md and docs/ (RESULTS, BENCHMARKS, GUIDE) recomputes from its committed result files
(benchmarks/doc_tables), every figure in the prose of the same documents is supported by
the files its marker names (doc_tables.prose), and the check catches a changed figure, an unmarked
table or figure and a missing command."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import doc_tables  # noqa: E402


def test_every_table_matches_its_files_and_shows_its_command():
    assert doc_tables.problems() == []


def test_every_document_table_is_marked():
    seen = 0
    for doc in doc_tables.DOCUMENTS:
        tables = doc_tables.marked_tables(doc, (ROOT / doc).read_text())
        assert all(t.name in doc_tables.renderers() for t in tables), doc
        seen += len(tables)
    assert seen >= len(doc_tables.renderers())  # every renderer's table is in some document


@pytest.fixture
def copy_of_the_documents(tmp_path):
    """The documents with the result files they read, in a scratch root."""
    for doc in doc_tables.DOCUMENTS:
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / doc, tmp_path / doc)
    sources = list(doc_tables.renderers().values()) + list(doc_tables.FIGURE_SOURCES.values())
    for r in sources:
        for f in r.files:
            (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / f, tmp_path / f)
    return tmp_path


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def first_table_row(path: Path) -> str:
    lines = path.read_text().splitlines()
    return next(line for i, line in enumerate(lines) if line.startswith("|") and lines[i - 1].startswith("| -"))


def test_a_figure_typed_by_hand_is_caught(copy_of_the_documents):
    results = copy_of_the_documents / "docs/RESULTS.md"
    row = first_table_row(results)
    cells = row.split("|")
    cells[-2] = cells[-2].replace("×", "0×", 1) if "×" in cells[-2] else cells[-2] + "1"
    edit(results, row, "|".join(cells))
    found = doc_tables.problems(copy_of_the_documents)
    assert len(found) == 1 and "differs from its files" in found[0]
    assert doc_tables.write(copy_of_the_documents) == ["docs/RESULTS.md: gpu-h200-1128"]
    assert doc_tables.problems(copy_of_the_documents) == []


def test_an_unmarked_table_and_a_missing_command_are_caught(copy_of_the_documents):
    benchmarks = copy_of_the_documents / "docs/BENCHMARKS.md"
    edit(benchmarks, "<!-- table: cpu-step-memory -->\n", "")
    edit(benchmarks, "benchmarks/table.py benchmarks/results/training_step.json", "benchmarks/table.py")
    found = doc_tables.problems(copy_of_the_documents)
    assert any("without a '<!-- table: NAME -->' marker" in p for p in found)
    assert any("does not show the command" in p and "cpu-step-time" in p for p in found)


def test_a_missing_result_file_is_caught(copy_of_the_documents):
    (copy_of_the_documents / doc_tables.renderers()["audit-sweep"].files[0]).unlink()
    assert any("reads missing files" in p for p in doc_tables.problems(copy_of_the_documents))


def test_a_prose_figure_typed_by_hand_is_caught(copy_of_the_documents):
    readme = copy_of_the_documents / "README.md"
    mean = doc_tables.prose.fixed(
        [doc_tables.prose.load(ROOT, "benchmarks/results/main_job/main_job.json")["mean_test_accuracy"]], 1, scale=100
    ).pop()
    edit(readme, f"**{mean}% test accuracy", f"**{float(mean) + 0.3:.1f}% test accuracy")
    found = doc_tables.problems(copy_of_the_documents)
    assert len(found) == 1 and "is not supported by main-job's files" in found[0], found


def test_a_figure_under_no_marker_and_a_missing_command_are_caught(copy_of_the_documents):
    results = copy_of_the_documents / "docs/RESULTS.md"
    results.write_text(results.read_text() + "\n## A new section\n\nIt reached 12.5% in 3 s.\n")
    edit(copy_of_the_documents / "README.md", "(`python benchmarks/main_job.py`,", "(")
    found = doc_tables.problems(copy_of_the_documents)
    assert sum("under no '<!-- figures: NAME -->' marker" in p for p in found) == 2  # 12.5 and 3
    assert any("figures 'main-job': the section does not show" in p for p in found)


@pytest.mark.parametrize(
    "line, figures",
    [
        ("a mean of **94.6% test accuracy (94.4–94.7%)**", ["94.6", "94.4", "94.7"]),
        ("about 2.3 minutes and 6.5 GB; 1.50–1.65× on GPT-2, 13 s of training", ["2.3", "6.5", "1.50", "1.65", "13"]),
        ("93–95% of 1,438 runs, 327k parameters, 139 GiB, +1.4 points", ["93", "95", "327", "139", "+1.4"]),
        ("ε = 8, δ = 1e-5, 30 epochs, 3 seeds, 2,500 canaries, a 2R clip at 1.5R", []),  # settings and counts
        ("picks 31–34 of the 53 partitions, seeds 1 and 2", ["31", "34"]),  # a range is a figure
        ("torch 2.14.1, transformers 5.24, Python 3.11, Claims 5.3–5.4, Table 1, 2026-11-26", []),
        ("the code `lr=1e-2, 0.5` and <!-- 0.7 --> and [a link](x/1.5.md)", []),
    ],
)
def test_what_counts_as_a_figure(line, figures):
    assert doc_tables.prose.figure_tokens(line) == figures
