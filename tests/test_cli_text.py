"""Your own texts from the CLI: `dpzoo train bert-base --data FILE.csv --text-column ... --weights DIR`
(a Hugging Face directory with its tokenizer, built here offline), `dpzoo eval RUN` on the run's
split and on another file, `dpzoo.load(RUN)`, the per-sample padding, and one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

import dpzoo
from dpzoo.cli import main

WORDS = ["good", "great", "fine", "bad", "awful", "poor", "film", "plot", "very", "the"]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """A tiny BERT sequence classifier and its WordPiece tokenizer, saved as a Hugging Face directory."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    d = tmp_path_factory.mktemp("tiny-bert")
    (d / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    BertTokenizer(str(d / "vocab.txt")).save_pretrained(d)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(WORDS) + 5, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, num_labels=2)  # fmt: skip
    BertForSequenceClassification(config).save_pretrained(d)
    return d


def _texts(path, n=40, seed=0, column="review"):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        good = i % 2 == 0
        words = [WORDS[int(j)] for j in torch.randint(0, 3, (3,), generator=g) + (0 if good else 3)]
        rows.append((" ".join(["the", "film", "very", *words[: 1 + i % 3]]), "pos" if good else "neg"))
    path.write_text(f"{column},label\n" + "".join(f'"{t}",{c}\n' for t, c in rows))
    return path


TRAIN = ["train", "bert-base", "--epochs", "1", "--batch-size", "8", "--max-tokens", "8", "--quiet"]


def test_train_eval_and_load_on_a_text_csv(tmp_path, weights, capsys):
    data, out = _texts(tmp_path / "reviews.csv"), tmp_path / "run"
    args = [*TRAIN, "--data", str(data), "--text-column", "review", "--weights", str(weights), "--out", str(out)]
    assert main([*args, "--mode", "bitfit"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["classes"] == ["neg", "pos"] and metrics["text"] == {"column": "review", "max_length": 8}
    model = dpzoo.load(out)
    assert type(model).__name__ == "BertForSequenceClassification" and model.config.num_labels == 2
    assert model.dpzoo_privacy["epsilon"] == pytest.approx(metrics["epsilon"])
    assert (out / "model" / "tokenizer_config.json").is_file()  # the tokenizer, for dpzoo eval
    capsys.readouterr()
    assert main(["eval", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 8  # the held-out 20% of 40
    other = _texts(tmp_path / "other.csv", n=10, seed=1)
    assert main(["eval", str(out), "--data", str(other), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 10


def test_each_text_is_padded_alone(weights):
    """A text's ids and mask do not depend on the other texts (no batch-dependent padding)."""
    from dpzoo.datasets.text import load_tokenizer, tokenize

    tok = load_tokenizer(weights)
    alone = tokenize(tok, ["good film"], 8)
    beside_a_long_one = tokenize(tok, ["good film", "the film very very very good great fine plot"], 8)
    assert alone.shape == (1, 2, 8) and torch.equal(alone[0], beside_a_long_one[0])
    assert beside_a_long_one[1, 1].sum() == 8  # truncated at 8 tokens


@pytest.mark.parametrize(
    "extra, message",
    [
        ([], "give --weights DIR"),
        (["--weights", "W", "--pretrained"], "one of the two"),
        (["--weights", "W", "--text-column", "body"], "no column 'body'"),
        (
            ["--weights", "W", "--image-size", "8"],
            "--image-size is for image classifiers; bert-base is a text classifier",
        ),
    ],
)
def test_mistakes_are_one_line_errors(tmp_path, weights, capsys, extra, message):
    data, out = _texts(tmp_path / "reviews.csv", column="text"), tmp_path / "run"
    extra = [str(weights) if a == "W" else a for a in extra]
    assert main([*TRAIN, "--data", str(data), *extra, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert not out.exists()


def test_a_text_model_needs_a_table(capsys):
    assert main(["train", "bert-base", "--weights", "."]) == 2
    assert "--data FILE.csv (or .parquet) with a text column" in capsys.readouterr().err
