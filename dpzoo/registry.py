"""The zoo's registry, in timm's style.

A zoo entry is a builder function decorated with :func:`register_model`. The builder
takes ``pretrained``, ``pretrained_tag``, ``weights`` and size overrides, and returns a
model that is already DP-ready (see :mod:`dpzoo.surgery`). Each entry carries a
:class:`ModelCard`: the structured facts behind the markdown card in ``models/``. The lookups
(``list_models``, ``model_card``, ...) are :mod:`dpzoo.models`', which registers dpzoo's own
entries first; this module imports no model.
"""

from __future__ import annotations

import difflib
import inspect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from .errors import InvalidArgumentError, OverrideError

__all__ = [
    "ModelCard",
    "ModelEntry",
    "register_model",
    "reject_unknown_overrides",
    "LOAD_KEYWORDS",
    "OVERRIDE_SYNONYMS",
]

# Keyword arguments of dpzoo.load itself: suggested when a misspelt one arrives as an override.
LOAD_KEYWORDS = ("pretrained", "pretrained_tag", "weights")
# Other libraries' names for an override (timm says num_classes, Hugging Face num_labels): an entry
# that takes one takes the other. Synonym → the name the timm entries' tables use.
OVERRIDE_SYNONYMS = {"num_labels": "num_classes"}


@dataclass(frozen=True)
class ModelCard:
    """What a zoo entry is, what dpzoo did to it, and where its weights come from."""

    name: str
    summary: str
    architecture: str
    library: str  # "timm" | "transformers" | "dpzoo"
    task: str
    patches: tuple[str, ...] = ()
    # Module-name patterns (fnmatch) of Conv/Linear layers that legitimately have no
    # bias after patching (e.g. an output projection tied to the input embedding).
    bias_exempt: tuple[str, ...] = ()
    weight_source: str = "random initialisation"
    pretrained_tags: dict[str, str] = field(default_factory=dict)
    license: str = "unknown"
    papers: tuple[str, ...] = ()
    overrides: dict[str, str] = field(default_factory=dict)
    # A small configuration for tests and quick experiments on a CPU.
    test_overrides: dict[str, Any] = field(default_factory=dict)
    # The input the model expects, for smoke tests: {"kind": "image", "shape": [3, 32, 32]}
    # or {"kind": "tokens", "vocab_size": 256, "seq_len": 16}, or {"kind": "features", "shape": [64]}.
    example_input: dict[str, Any] = field(default_factory=dict)
    # `dpzoo train`'s defaults for this entry where it has its own recipe (epochs, batch_size, lr)
    train_defaults: dict[str, Any] = field(default_factory=dict)
    notes: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_markdown(self) -> str:
        """Render the card as the markdown kept under ``models/<name>.md``."""
        lines = [f"# {self.name}", "", self.summary, ""]
        lines += ["| field | value |", "| --- | --- |"]
        lines += [f"| architecture | {self.architecture} |"]
        lines += [f"| library | {self.library} |", f"| task | {self.task} |"]
        lines += [f"| weights | {self.weight_source} |", f"| licence | {self.license} |"]
        lines += ["", "## Patches applied by dpzoo", ""]
        lines += [f"- {p}" for p in self.patches] or ["- none"]
        if self.bias_exempt:
            lines += [
                "",
                "Layers left without a bias on purpose: " + ", ".join(f"`{p}`" for p in self.bias_exempt) + ".",
            ]
        lines += ["", "## Pretrained tags", ""]
        if self.pretrained_tags:  # each says its normalisation and whether it is DP-ready as it is
            lines += ["| tag | source |", "| --- | --- |"]
            lines += [f"| `{t}` | {s} |" for t, s in self.pretrained_tags.items()]
        else:
            lines += [
                "None: dpzoo offers no pretrained weights for this entry (the weights row above says what it loads)."
            ]
        if self.overrides:
            lines += ["", "## Overrides", "", "Keyword arguments of `dpzoo.load`:", ""]
            lines += ["| override | meaning |", "| --- | --- |"]
            lines += [f"| `{k}` | {v} |" for k, v in self.overrides.items()]
        if self.test_overrides:
            args = ", ".join(f"{k}={v!r}" for k, v in self.test_overrides.items())
            lines += [
                "",
                "## Small configuration (tests, CPU)",
                "",
                "```python",
                f'dpzoo.load("{self.name}", {args})',
                "```",
            ]
        if self.train_defaults:
            args = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in self.train_defaults.items())
            lines += ["", "## Recipe", "", f"`dpzoo train {self.name}` defaults to `{args}`."]
        lines += ["", "## DP results", ""] + _results_lines(self.name)
        if self.papers:
            lines += ["", "## Papers", ""] + [f"- {p}" for p in self.papers]
        if self.notes:
            lines += ["", "## Notes", "", self.notes.strip()]
        return "\n".join(lines) + "\n"


RESULTS_FILE = Path(__file__).parent / "models" / "dp_results.json"  # benchmarks/zoo_results.py, zoo_text_results.py


def dp_results(name: str) -> dict[str, Any] | None:
    """The measured DP result of a zoo entry (``benchmarks/zoo_results.py``, ``zoo_text_results.py``), or None."""
    try:
        return json.loads(RESULTS_FILE.read_text()).get(name)
    except (OSError, ValueError):
        return None


def _results_lines(name: str) -> list[str]:
    r = dp_results(name)
    if r is None:
        return [
            "None measured yet (`benchmarks/zoo_results.py` measures the image entries on the bundled digits, "
            "`benchmarks/zoo_text_results.py` the language entries on the bundled docstring sentences)."
        ]
    metric = r.get("metric", "test_accuracy")
    bits = metric == "test_bits_per_byte"  # causal LMs: lower is better
    show = (lambda v: f"{v:.2f}") if bits else (lambda v: f"{v:.1%}")
    spread = f"{show(r[f'{metric}_min'])}–{show(r[f'{metric}_max'])}"
    header = "test bits per byte (lower is better)" if bits else "test accuracy"
    by = r["command"] if "metric" in r else f"python benchmarks/zoo_results.py {name}"
    lines = [
        f"Measured by `{by}` on {r['measured']['date']} ({r['measured']['machine']}); {r['runs']} runs, secret noise:",
        "",
        f"| data | configuration | ε (δ) | steps | {header} | without DP | command |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {r['data']} | {r['configuration']} | {r['epsilon']:g} ({r['delta']:g}, {r['accountant']}) | {r['steps']} "
        f"| {show(r[f'{metric}_mean'])} ({spread}) | {show(r[f'non_private_{metric}'])} | `{r['command']}` |",
    ]
    if "metric" in r:  # language entries: the recipe and the reference point
        ref = (
            f"a uniform guess is {r['uniform_bits_per_byte']:g} bits"
            if bits
            else f"chance is {r['chance_accuracy']:.0%}, always the most frequent family {r['majority_test_accuracy']:.1%}"
        )
        lines += [
            "",
            f"Trained from scratch on {r['train_size']} sentences ({r['test_size']} held out), {r['tokens']}; "
            f"Adam lr {r['lr']:g}, expected batch {r['batch_size']}, {r['epochs']} epochs, clipping {r['max_grad_norm']:g}, "
            f"σ {r['noise_multiplier']:g}; without DP: the same recipe, clipping and noise off; {ref}.",
        ]
    return lines


@dataclass(frozen=True)
class ModelEntry:
    name: str
    builder: Callable[..., Any]
    card: ModelCard

    @property
    def accepts_weights(self) -> bool:
        params = inspect.signature(self.builder).parameters
        return "weights" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


ENTRIES: dict[str, ModelEntry] = {}  # every registered entry; :mod:`dpzoo.models` looks them up, its own included


def register_model(name: str | Callable | None = None, *, card: ModelCard | None = None):
    """Register a builder as a zoo entry, like ``timm.models.register_model``.

    Use as ``@register_model`` (the name is the function's, with ``_`` → ``-``) or
    ``@register_model("my-net", card=ModelCard(...))``. The builder is called as
    ``builder(pretrained=..., pretrained_tag=..., weights=..., **overrides)`` and must
    return a DP-ready ``nn.Module`` (``dpzoo.make_dp_ready`` does the surgery).
    """

    def decorate(fn: Callable, entry_name: str | None) -> Callable:
        entry_name = entry_name or fn.__name__.replace("_", "-")
        if entry_name in ENTRIES and ENTRIES[entry_name].builder is not fn:
            raise InvalidArgumentError(
                f"A zoo entry named {entry_name!r} is already registered; register yours under another name (name=...)."
            )
        entry_card = card or ModelCard(
            name=entry_name,
            summary=(inspect.getdoc(fn) or "User-registered model.").splitlines()[0],
            architecture=f"`{fn.__module__}.{fn.__qualname__}`",
            library="user",
            task="unspecified",
        )
        if entry_card.name != entry_name:
            raise InvalidArgumentError(
                f"The card is named {entry_card.name!r} but the entry {entry_name!r}; "
                "give the ModelCard the entry's name."
            )
        ENTRIES[entry_name] = ModelEntry(entry_name, fn, entry_card)
        return fn

    if callable(name):  # bare @register_model
        return decorate(name, None)
    return lambda fn: decorate(fn, name)


def reject_unknown_overrides(entry: str, given: Iterable[str], accepted: Iterable[str]) -> None:
    """Raise :class:`OverrideError` naming every override in ``given`` that is not in ``accepted``,
    each with a did-you-mean (among the accepted overrides and dpzoo.load's own keywords)."""
    accepted = sorted(set(accepted))
    bad = [k for k in given if k not in accepted]
    if not bad:
        return
    vocabulary = accepted + [k for k in LOAD_KEYWORDS if k not in accepted]
    close = {k: difflib.get_close_matches(k, vocabulary, n=1, cutoff=0.6) for k in bad}
    hint = "; ".join(f"did you mean {c[0]!r} for {k!r}?" for k, c in close.items() if c)
    raise OverrideError(
        f"{entry} does not accept override(s) {', '.join(map(repr, bad))}"
        + (f" ({hint})" if hint else "")
        + f". Accepted: {', '.join(accepted) or 'none'}. (`dpzoo.model_card({entry!r})` documents them.)"
    )
