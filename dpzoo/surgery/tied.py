"""Find parameters shared by more than one module (tied embeddings and the like).

GPT-2 ties its input embedding ``transformer.wte.weight`` to the output projection
``lm_head.weight``: one tensor, two uses, so its per-sample gradient is the sum of two
contributions and the ghost norm of either layer alone is wrong (DPFormer paper, §4 and
Claim 4.1). The per-sample-norm code uses these groups to treat each such tensor once.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["TiedGroup", "find_tied_parameters"]


@dataclass(frozen=True)
class TiedGroup:
    """One parameter tensor reachable under several names."""

    names: tuple[str, ...]  # full parameter names, e.g. ("lm_head.weight", "transformer.wte.weight")
    shape: tuple[int, ...]

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(n.rpartition(".")[0] for n in self.names)

    @property
    def canonical_name(self) -> str:
        """The name ``model.named_parameters()`` reports (the first one registered)."""
        return self.names[0]

    def to_dict(self) -> dict:
        return {"names": list(self.names), "shape": list(self.shape)}


def find_tied_parameters(model: nn.Module) -> list[TiedGroup]:
    """Every parameter tensor registered under more than one name, as :class:`TiedGroup`s."""
    by_id: dict[int, list[str]] = {}
    tensors = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    groups = []
    for pid, names in by_id.items():
        if len(names) > 1:
            # named_parameters(remove_duplicate=True) keeps the first; keep that one first
            groups.append(TiedGroup(tuple(names), tuple(tensors[pid].shape)))
    return groups
