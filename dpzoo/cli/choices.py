"""The choices ``dpzoo --help`` lists (models, accountants, training modes, datasets), without importing torch.

The registries behind them import torch when they are imported (the zoo's builders, the mode
table's trainable-set functions, the sequence datasets' reader, the ``dpzoo.privacy`` and
``dpzoo.seqrec`` packages), which costs seconds. So each choice is read from its live registry
when that is already imported (a user who registered an accountant, a dataset or a model before
calling :func:`dpzoo.cli.main` sees it offered), and otherwise from the built-in entries listed
here; ``tests/test_cli_tool.py`` holds these lists equal to the registries.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__all__ = [
    "AUDIT_CONTROLS",
    "BUILTIN_MODELS",
    "BUILTIN_ACCOUNTANTS",
    "BUILTIN_MODES",
    "BUILTIN_DATASETS",
    "DEFAULT_CLI_MODE",
    "TRAINABLE_TASKS",
    "model_tasks",
    "trainable_models_help",
    "usable_accountants",
    "mode_names",
    "modes_help",
    "datasets_help",
    "max_len_help",
]

# name -> task of dpzoo's own zoo entries
BUILTIN_MODELS: dict[str, str] = {
    "bert-base": "sequence-classification",
    "cnn-tanh-gn": "image-classification",
    "convnext-tiny": "image-classification",
    "dpformer": "sequential-recommendation",
    "efficientnet-lite0-gn-bias": "image-classification",
    "gemma-bias": "causal-lm",
    "gpt2": "causal-lm",
    "gru-seqrec": "sequential-recommendation",
    "llama-bias": "causal-lm",
    "llama-tiny-bias": "causal-lm",
    "lstm-seqrec": "sequential-recommendation",
    "mistral-bias": "causal-lm",
    "mlp-tanh": "tabular-classification",
    "nf-resnet50": "image-classification",
    "qwen2-bias": "causal-lm",
    "resnet18-gn-bias": "image-classification",
    "resnet34-gn-bias": "image-classification",
    "resnet50-gn-bias": "image-classification",
    "roberta-base": "sequence-classification",
    "t5-small": "text2text-generation",
    "transformer-seqrec": "sequential-recommendation",
    "transformer-seqrec-untied": "sequential-recommendation",
    "vit-base-patch16": "image-classification",
    "vit-small-patch16": "image-classification",
    "vit-tiny-patch16": "image-classification",
    "wrn16-4-gn": "image-classification",
    "wrn28-10-gn": "image-classification",
}
# the built-in accountants whose ε is an upper bound, in registration order ("gdp" is not)
BUILTIN_ACCOUNTANTS: tuple[str, ...] = ("pld", "rdp", "prv", "opacus-rdp")
# name -> description of the engine's training modes (dpzoo.privacy.modes.TRAINING_MODES)
BUILTIN_MODES: dict[str, str] = {
    "auto": "ghost norm or per-sample instantiation per layer, whichever is faster within a memory budget (cost model)",
    "bk-mixopt": "= auto (BK paper's name)",
    "bk": "ghost norm on every generalised linear layer (BK paper §2–3)",
    "instantiate": "per-sample gradients everywhere (Opacus-style)",
    "bitfit": "only biases (plus train_head) are trained, activation-free (DP-BiTFiT Alg. 1)",
    "lora": "only the LoRA adapters of a PEFT model are trained (plus its modules_to_save, the biases "
    "its bias= config names, and train_head); DP-LoRA",
}
DEFAULT_CLI_MODE = "bk-mixopt"
# name -> (description, default input length) of the named sequence datasets (dpzoo.seqrec.downloads)
BUILTIN_DATASETS: dict[str, tuple[str, int]] = {
    "ml-1m": ("MovieLens 1M; SASRec's ml-1m.txt preferred", 200),
    "ml-100k": ("MovieLens 100K", 50),
    "amazon-games": ("Amazon Video Games, 2014 release", 50),
    "amazon-games-2018": ("Amazon Video Games, 2018 release", 50),
}
# the tasks `dpzoo train` trains, and what it trains them on
TRAINABLE_TASKS: dict[str, str] = {
    "image-classification": "image classifiers, on digits",
    "tabular-classification": "tabular classifiers, on a CSV or Parquet file",
    "sequence-classification": "text classifiers, on your CSV or Parquet texts, from pretrained weights",
    "sequential-recommendation": "sequence models, user-level DP",
}


def _live(module: str) -> Any:
    """The registry module if it is imported already (reading it then costs nothing), else None."""
    return importlib.import_module(module) if module in sys.modules else None


def model_tasks() -> dict[str, str]:
    """name -> task of every zoo entry."""
    zoo = _live("dpzoo.models")
    if zoo is None:
        return dict(BUILTIN_MODELS)
    return {name: zoo.model_card(name).task for name in zoo.list_models()}


def trainable_models_help() -> str:
    """The models ``dpzoo train`` accepts, grouped by task, for its --help."""
    tasks = model_tasks()
    groups = []
    for task, what in TRAINABLE_TASKS.items():
        names = sorted(n for n, t in tasks.items() if t == task)
        if names:
            groups.append(f"{what}: {', '.join(names)}")
    return "; ".join(groups)


def usable_accountants() -> list[str]:
    """Registered accountants whose ε is an upper bound (the engine refuses the others, e.g. 'gdp')."""
    registry = _live("dpzoo.privacy.accounting.registry")
    if registry is None:
        return list(BUILTIN_ACCOUNTANTS)
    return [name for name in registry.ACCOUNTANTS if registry.accountant_spec(name).upper_bound]


def _modes() -> dict[str, str]:
    modes = _live("dpzoo.privacy.modes")
    if modes is None:
        return dict(BUILTIN_MODES)
    return {m.name: m.description for m in modes.TRAINING_MODES.values()}


def mode_names() -> list[str]:
    return list(_modes())


def modes_help() -> str:
    return "; ".join(f"{name}: {description}" for name, description in _modes().items())


def _datasets() -> dict[str, tuple[str, int]]:
    downloads = _live("dpzoo.seqrec.downloads")
    if downloads is None:
        return dict(BUILTIN_DATASETS)
    return {d.name: (d.description, d.max_len) for d in downloads.DATASETS.values()}


def datasets_help() -> str:
    return ", ".join(f"{name} ({desc})" if desc else name for name, (desc, _) in _datasets().items())


def max_len_help() -> str:
    """The named datasets whose default input length is not 50 (``ml-1m: 200``)."""
    return ", ".join(f"{name}: {max_len}" for name, (_, max_len) in _datasets().items() if max_len != 50)


# dpzoo.audit.BROKEN, spelled here so that `dpzoo --help` does not import torch (a test keeps them equal)
AUDIT_CONTROLS = [
    "no-noise",
    "unclipped",
    "sensitivity-1.5x",
    "sensitivity-2x",
    "half-noise",
    "noise-skipped-per-epoch",
    "group-outside-engine",
]
