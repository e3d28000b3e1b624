"""Plots of a training run's metrics over epochs, with ε beside them (matplotlib, optional).

``metrics.png`` of ``dpzoo train``: the evaluation metrics per epoch (solid: test, dashed:
validation), horizontal reference lines (e.g. the popularity ranking of a next-item task) and
the ε spent so far on a second axis. Without matplotlib nothing is drawn (``pip install
dpzoo[plot]``); the numbers are in metrics.csv and metrics.json either way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

__all__ = ["plot_metrics"]


def plot_metrics(
    history: Sequence[dict],
    path: Path,
    title: str,
    series: Sequence[tuple[str, str]],
    *,
    percent: bool = False,
    references: dict[str, float] | None = None,
    ylabel: str = "",
) -> bool:
    """Draw ``series`` (pairs of a history key and its label) over the epochs of ``history`` into
    ``path``; keys starting with ``valid_`` are dashed. ``references``: label -> value, drawn as
    horizontal dotted lines. Returns False (nothing written) when matplotlib is not installed or
    the history is empty."""
    if not history:
        return False
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scale = 100.0 if percent else 1.0
    epochs = [h["epoch"] for h in history]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (key, label) in enumerate(series):
        if key not in history[0]:
            continue
        style = "--" if key.startswith("valid_") else "-"
        colour = colours[i % len(colours)]
        ax.plot(epochs, [scale * h[key] for h in history], style, marker="o", color=colour, label=label)
    for j, (label, value) in enumerate((references or {}).items()):
        ax.axhline(scale * value, linestyle=":", color=colours[(len(series) + j) % len(colours)], label=label)
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel or ("%" if percent else ""))
    ax.set_title(title, fontsize=9)
    eps = [h.get("epsilon") for h in history]
    if all(e is not None for e in eps):
        twin = ax.twinx()
        twin.plot(epochs, eps, color="grey", linewidth=1, alpha=0.7, label="ε spent")
        twin.set_ylabel("ε spent", color="grey")
        twin.set_ylim(bottom=0)
        lines, labels = ax.get_legend_handles_labels()
        more, more_labels = twin.get_legend_handles_labels()
        ax.legend(lines + more, labels + more_labels, fontsize=8)
    else:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
