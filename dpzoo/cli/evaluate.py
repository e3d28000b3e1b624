"""``dpzoo eval RUN``: a finished ``dpzoo train`` run's model, scored on its test split or on
other data (the built-in digits, an image folder with the run's classes, or a table with the
run's classes and feature columns)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import InvalidArgumentError
from .args import option

__all__ = ["add_eval_parser", "cmd_eval"]


def add_eval_parser(sub) -> None:
    s = sub.add_parser(
        "eval",
        help="score a trained run's model",
        description="Load the model of a `dpzoo train --out RUN` directory and report its test accuracy.",
    )
    s.add_argument(
        "run", metavar="RUN", help="the --out directory of a finished dpzoo train run of an image or tabular classifier"
    )
    option(
        s,
        "--data",
        default=None,
        help="digits, an image folder (its val/ or test/ if it has one, else every image) or, for a tabular run, a "
        ".csv or .parquet file (every row); default: the run's own test split",
    )
    option(s, "--json", kind="flag", help="print the result as one JSON object")
    s.set_defaults(fn=cmd_eval)


def _run_metrics(run: Path) -> dict:
    path = run / "metrics.json"
    if not path.is_file():
        raise InvalidArgumentError(
            f"{run} has no metrics.json: give the --out directory of a finished `dpzoo train` run "
            "(an unfinished one continues with `dpzoo train --resume`)."
        )
    metrics = json.loads(path.read_text())
    if "classes" not in metrics or not any(k in metrics for k in ("image_size", "features", "text")):
        raise InvalidArgumentError(
            f"{run} is not a run of an image or tabular classifier (or was made by an older dpzoo): dpzoo eval scores "
            "classifiers; a sequence model's run has its test metrics in metrics.json."
        )
    return metrics


def cmd_eval(args: argparse.Namespace) -> int:
    run = Path(args.run)
    metrics = _run_metrics(run)
    import torch

    from ..hub.load_save import load
    from ..runs.classifier import evaluate_accuracy

    data = args.data or metrics["data"]
    if data != "digits" and Path(data).exists():
        data = str(Path(data).resolve())  # as the run recorded it
    test, classes = _eval_set(metrics, data, run)
    if list(classes) != list(metrics["classes"]):
        raise InvalidArgumentError(
            f"--data {data} has the classes {classes[:5]}{'…' if len(classes) > 5 else ''}, the run was trained on "
            f"{metrics['classes'][:5]}{'…' if len(metrics['classes']) > 5 else ''}: give data with the same class folders."
        )
    model = load(run)
    if "text" in metrics:  # packed (ids, mask) inputs, as the run trained it
        from ..datasets.text import PackedTextClassifier

        model = PackedTextClassifier(model)
    accuracy = evaluate_accuracy(model, test, torch.device("cpu"))
    result = {
        "run": str(run),
        "model": metrics.get("model"),
        "data": data,
        ("images" if "image_size" in metrics else "rows"): len(test),
        "test_accuracy": accuracy,
        "epsilon": metrics.get("epsilon"),
        "delta": metrics.get("delta"),
    }
    if args.json:
        print(json.dumps(result))
    else:
        eps = f"ε = {result['epsilon']:.3g} at δ = {result['delta']:.3g}" if result["epsilon"] is not None else "no DP"
        rows = "images" if "image_size" in metrics else "rows"
        print(f"{result['model']} on {data}: test accuracy {accuracy:.4f} ({len(test)} {rows}); trained with {eps}")
    return 0


def _eval_set(metrics: dict, data: str, run: Path):
    """(dataset, class names) to score: the run's own test split when ``data`` is the run's (or
    digits), else every example of ``data`` (an image folder's val/ or test/ split if it has one)."""
    from ..datasets import image_folder_eval_set, table_eval_set
    from ..runs.classifier import image_splits, table_data

    seed, own = int(metrics.get("seed", 0)), data in (metrics["data"], "digits")
    if "text" in metrics:  # a text run: the tokenizer saved beside its model
        from ..datasets.text import load_tokenizer, text_eval_set, text_splits

        tokenizer = load_tokenizer(run / "model")
        column, length = metrics["text"]["column"], int(metrics["text"]["max_length"])
        if own:
            _, test, classes = text_splits(data, column, metrics["label_column"], tokenizer, length, seed=seed)
            return test, classes
        test = text_eval_set(data, column, metrics["label_column"], metrics["classes"], tokenizer, length)
        return test, metrics["classes"]
    if "features" in metrics:  # a tabular run
        if own:
            _, test, classes, _ = table_data(data, metrics["label_column"], seed)
            return test, classes
        return table_eval_set(data, metrics["label_column"], metrics["classes"], metrics["features"]), metrics[
            "classes"
        ]
    size = int(metrics["image_size"])
    if own:
        _, test, classes = image_splits(data, size, seed)
        return test, classes
    return image_folder_eval_set(data, size)
