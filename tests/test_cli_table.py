"""Your own table from the CLI: `dpzoo train mlp-tanh --data FILE.csv|.parquet`, `dpzoo eval RUN`
on the run's split and on another file, `dpzoo.load(RUN)`, resume, and one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

import dpzoo
from dpzoo.cli import main
from dpzoo.datasets import read_table

TRAIN = ["train", "mlp-tanh", "--epochs", "2", "--batch-size", "16", "--quiet"]


def _rows(n=60, seed=0):
    """Two separable classes ("no" below, "yes" above 0.5 on feature x1), x2 noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g)
    return [(float(a), float(b), "yes" if a > 0.5 else "no") for a, b in x.tolist()]


def _csv(path, rows, header=("x1", "x2", "target")):
    path.write_text(",".join(header) + "\n" + "".join(f"{a},{b},{c}\n" for a, b, c in rows))
    return path


def test_train_eval_and_load_on_a_csv(tmp_path, capsys):
    data, out = _csv(tmp_path / "table.csv", _rows()), tmp_path / "run"
    assert main([*TRAIN, "--data", str(data), "--label-column", "target", "--out", str(out)]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["classes"] == ["no", "yes"] and metrics["features"] == ["x1", "x2"]
    assert metrics["label_column"] == "target" and metrics["data"] == str(data.resolve())
    model = dpzoo.load(out)
    assert model(torch.zeros(1, 2)).shape == (1, 2)
    assert model.dpzoo_privacy["epsilon"] == pytest.approx(metrics["epsilon"])
    capsys.readouterr()
    assert main(["eval", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 12  # the held-out 20% of 60
    reordered = [(b, c, a) for a, b, c in _rows(25, seed=1)]
    other = _csv(tmp_path / "other.csv", reordered, header=("x2", "target", "x1"))  # the columns in another order
    assert main(["eval", str(out), "--data", str(other), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 25


def test_read_table_takes_the_named_columns_in_the_runs_order(tmp_path):
    path = _csv(tmp_path / "t.csv", [(0.25, 0.5, "yes"), (1.0, 2.0, "no")], header=("b", "a", "y"))
    x, y, classes, names = read_table(path, "y", ["a", "b"], ["yes", "no"])
    assert names == ["a", "b"] and classes == ["yes", "no"]
    assert torch.equal(x, torch.tensor([[0.5, 0.25], [2.0, 1.0]])) and y.tolist() == [0, 1]
    numeric = _csv(tmp_path / "n.csv", [(0, 0, 10), (0, 0, 9), (0, 0, 2)])
    assert read_table(numeric, "target")[2] == ["2", "9", "10"]  # integer labels sorted as numbers


def test_parquet_trains_like_the_csv(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = _rows()
    table = pa.table({"x1": [r[0] for r in rows], "x2": [r[1] for r in rows], "label": [r[2] for r in rows]})
    pq.write_table(table, tmp_path / "table.parquet")
    out = tmp_path / "run"
    assert main([*TRAIN, "--data", str(tmp_path / "table.parquet"), "--out", str(out)]) == 0
    assert json.loads((out / "metrics.json").read_text())["features"] == ["x1", "x2"]


def test_resume_continues_on_the_same_table(tmp_path):
    from dpzoo.runs.classifier import train_image_classifier

    data, out = _csv(tmp_path / "table.csv", _rows()), tmp_path / "run"

    def interrupt(step):
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_image_classifier("mlp-tanh", data=str(data), label_column="target", epochs=2, batch_size=16,
                               out=out, checkpoint_every=2, step_callback=interrupt, progress=False,
                               log=lambda s: None)  # fmt: skip
    assert (out / "checkpoint.pt").is_file()
    assert main(["train", "--resume", str(out), "--quiet"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["label_column"] == "target" and metrics["steps"] > 2


@pytest.mark.parametrize(
    "content, extra, message",
    [
        ("x,label\n1,a\nfoo,b\n" + "1,a\n" * 10, [], "'foo' is not a finite number"),
        ("x,label\n1,a\n2\n", [], "data row 2 has 1 fields"),
        ("a,a,label\n" + "1,2,x\n" * 10, [], "'a' appears twice"),
        ("x,y\n1,a\n2,b\n", [], "no column 'label'"),
        ("x,label\n" + "1,a\n" * 10, [], "1 class"),
        ("x,label\n1,a\nnan,b\n" + "1,b\n" * 10, [], "'nan' is not a finite number"),
    ],
)
def test_bad_tables_are_one_line_errors(tmp_path, capsys, content, extra, message):
    path = tmp_path / "bad.csv"
    path.write_text(content)
    _one_line_error(tmp_path, capsys, path, extra, message)


def _one_line_error(tmp_path, capsys, path, extra, message):
    out = tmp_path / "run"
    assert main([*TRAIN, "--data", str(path), "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not out.exists()  # nothing left behind


def test_options_of_other_kinds_are_refused(capsys):
    assert main(["train", "mlp-tanh", "--image-size", "8"]) == 2
    assert "--image-size is for image classifiers; mlp-tanh is a tabular classifier" in capsys.readouterr().err
    assert main(["train", "cnn-tanh-gn", "--label-column", "y"]) == 2
    assert "--label-column is for tabular classifiers" in capsys.readouterr().err
    assert main(["train", "mlp-tanh", "--data", "notes.txt"]) == 2
    assert "a .csv or .parquet file" in capsys.readouterr().err


def test_a_latin1_file_is_a_one_line_error_and_a_bom_and_blank_lines_are_read(tmp_path, capsys):
    path = tmp_path / "latin.csv"
    path.write_bytes("x,label\n1,caf\xe9\n".encode("latin-1") + b"2,b\n" * 10)
    _one_line_error(tmp_path, capsys, path, [], "not UTF-8 text")
    bom = tmp_path / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + b"label,x\n" + b"a,1\nb,2\n" * 5 + b"\n\n")
    x, y, classes, names = read_table(bom)
    assert names == ["x"] and classes == ["a", "b"] and len(y) == 10


def test_numeric_labels_are_one_class_per_value_not_per_spelling(tmp_path):
    path = _csv(tmp_path / "n.csv", [(0, 0, "1"), (0, 0, "1.0"), (0, 0, "2"), (0, 0, " 2")])
    _, y, classes, _ = read_table(path, "target")
    assert classes == ["1", "2"] and y.tolist() == [0, 0, 1, 1]
