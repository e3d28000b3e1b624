"""The built-in audit's models, one per training mode: each keeps its canaries' coordinates isolated
and says what the claimed mechanism adds to them.

All three compute the dense linear model on the 64 pixels and m Dirac canary coordinates (canary i
is ``canary_norm`` on coordinate 64 + i): logits = fc(pixels) + canary_norm · (canary i's weight
column). They differ in where that column lives, so that the mode's own per-sample norms and
trainable set are what the audit exercises:

* :class:`DiracCanaryClassifier` (``auto``, ``bk``, ``instantiate``): an embedding row per canary;
* :class:`BiasCanaryClassifier` (``bitfit``, DP-BiTFiT): the rows are the bias of a linear layer,
  so bias-only training moves them;
* :class:`LoraCanaryClassifier` (``lora``, DP-LoRA through PEFT): a zero weight on the one-hot
  canary input, adapted by LoRA; canary i's isolated coordinates are column i of the LoRA ``A``.

Each exposes ``canary_parameters()`` (what only canaries reach) and, for the white-box scorer
(:mod:`dpzoo.audit.white_box`), at the current weights: ``canary_release()``, the optimizer's ``.grad`` on the isolated coordinates as an (m, k) tensor
(None before the first), and ``canary_gradients()``, per canary its own unclipped gradient on those
k coordinates (m, k) and the norm of its whole gradient over the trainable parameters (m,), in
float64, derived by hand from the model (independent of dpzoo's hooks; the tests check it
against autograd). Sharded (FSDP2) parameters are gathered first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DiracCanaryClassifier", "BiasCanaryClassifier", "LoraCanaryClassifier", "canary_model"]


def _full(t: torch.Tensor) -> torch.Tensor:
    """A sharded parameter or gradient (a DTensor under FSDP2) as the whole tensor, float64."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).double()


class DiracCanaryClassifier(nn.Module):
    """The linear classifier on 64 pixels and m Dirac canary coordinates, stored sparsely.

    An input row is the 64 pixels and a slot: 0 for no canary, i + 1 for canary i (whose dense
    input is ``canary_norm`` on coordinate 64 + i). The canary coordinates' weight columns are the
    rows of ``canaries`` (an embedding, zero at the start): logits = fc(pixels) + canary_norm ·
    canaries[i] for canary i, exactly the dense model's, and so are the per-sample gradients (a
    canary's reaches only its row and the bias; a digit's never reaches ``canaries``)."""

    def __init__(self, pixels: int, canaries: int, canary_norm: float, num_classes: int = 10):
        super().__init__()
        self.fc = nn.Linear(pixels, num_classes)
        self.canaries = nn.Embedding(canaries, num_classes)
        nn.init.zeros_(self.canaries.weight)
        self.pixels, self.canary_norm, self.num_canaries = pixels, float(canary_norm), canaries

    def forward(self, x):
        slot = x[:, self.pixels].round().long()
        has_canary = (slot > 0).to(x.dtype)[:, None]
        return self.fc(x[:, : self.pixels]) + self.canary_norm * has_canary * self.canary_rows(slot - 1)

    def canary_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Canary ``index``'s weight column per row of the batch (any row for a digit: it is masked)."""
        return self.canaries(index.clamp_min(0))

    def canary_parameters(self) -> list[torch.Tensor]:
        """The parameters only canaries reach (a digit's gradient there is zero)."""
        return [self.canaries.weight]

    def canary_release(self) -> torch.Tensor | None:
        grad = self.canaries.weight.grad
        return None if grad is None else _full(grad)

    def canary_gradients(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = _residual(self._canary_columns() * self.canary_norm + _full(self.fc.bias), labels)
        own = residual * self.canary_norm  # its column; fc.weight gets nothing (pixels are 0)
        bias = residual.norm(dim=1) if self.fc.bias.requires_grad else torch.zeros(len(own), dtype=own.dtype)
        return own, (own.norm(dim=1) ** 2 + bias**2).sqrt()

    def _canary_columns(self) -> torch.Tensor:
        """The (m, classes) canary weight columns, float64."""
        return _full(self.canaries.weight)


class BiasCanaryClassifier(DiracCanaryClassifier):
    """DP-BiTFiT's twin of :class:`DiracCanaryClassifier`: the canary columns are the bias of
    ``canary_bias`` (a linear layer of m · classes outputs on a constant zero input, its weight
    never trained), so ``mode="bitfit"``'s bias-only norms and trainable set carry them."""

    def __init__(self, pixels: int, canaries: int, canary_norm: float, num_classes: int = 10):
        super().__init__(pixels, canaries, canary_norm, num_classes)
        del self.canaries
        self.canary_bias = nn.Linear(1, canaries * num_classes)
        nn.init.zeros_(self.canary_bias.weight)
        nn.init.zeros_(self.canary_bias.bias)
        self.num_classes = num_classes

    def canary_rows(self, index: torch.Tensor) -> torch.Tensor:
        table = self.canary_bias(index.new_zeros(len(index), 1, dtype=self.canary_bias.bias.dtype))
        return table.view(len(index), self.num_canaries, self.num_classes)[torch.arange(len(index)), index.clamp_min(0)]

    def _canary_columns(self) -> torch.Tensor:
        return _full(self.canary_bias.bias).view(self.num_canaries, self.num_classes)

    def canary_parameters(self) -> list[torch.Tensor]:
        return [self.canary_bias.bias]

    def canary_release(self) -> torch.Tensor | None:
        grad = self.canary_bias.bias.grad
        return None if grad is None else _full(grad).view(self.num_canaries, self.num_classes)


class LoraCanaryClassifier(DiracCanaryClassifier):
    """DP-LoRA's twin: canary i's input is ``canary_norm`` times the one-hot e_i through
    ``canary_proj`` (a zero weight, frozen under LoRA); :func:`canary_model` adapts it (and ``fc``)
    with PEFT's LoRA, ``B`` and ``A`` both random (``init_lora_weights=False``), so column i of
    ``A`` is canary i's alone from the first step."""

    def __init__(self, pixels: int, canaries: int, canary_norm: float, num_classes: int = 10):
        super().__init__(pixels, canaries, canary_norm, num_classes)
        del self.canaries
        self.canary_proj = nn.Linear(canaries, num_classes, bias=False)
        nn.init.zeros_(self.canary_proj.weight)

    def forward(self, x):
        slot = x[:, self.pixels].round().long()
        one_hot = F.one_hot((slot - 1).clamp_min(0), self.num_canaries).to(x.dtype) * (slot > 0).to(x.dtype)[:, None]
        return self.fc(x[:, : self.pixels]) + self.canary_proj(self.canary_norm * one_hot)

    def _adapter(self):
        layer = self.canary_proj
        name = layer.active_adapters[0]
        return layer.base_layer.weight, layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name]

    def canary_parameters(self) -> list[torch.Tensor]:
        return list(self._adapter()[1:3])

    def canary_release(self) -> torch.Tensor | None:
        grad = self._adapter()[1].grad
        return None if grad is None else _full(grad).T

    def canary_gradients(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        base, a, b, s = (_full(t) if torch.is_tensor(t) else t for t in self._adapter())
        fc_at_zero = self.fc(torch.zeros(1, self.pixels, dtype=self.fc.base_layer.weight.dtype)).double()
        residual = _residual(self.canary_norm * (base.T + s * (b @ a).T) + fc_at_zero, labels)  # (m, classes)
        own = s * self.canary_norm * residual @ b  # column i of A: s · c · Bᵀ r
        on_b = s * self.canary_norm * residual.norm(dim=1) * a.norm(dim=0)  # B's gradient: s · c · r ⊗ A[:, i]
        bias = self.fc.base_layer.bias
        on_bias = residual.norm(dim=1) if bias.requires_grad else torch.zeros_like(on_b)
        return own, (own.norm(dim=1) ** 2 + on_b**2 + on_bias**2).sqrt()


LORA_B_SCALE = 10.0  # B's share of a canary's gradient is |A_i| / |Bᵀ r̂| of its own; noise grows A_i


def _residual(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """softmax − one-hot of the canaries' labels: the cross-entropy's gradient at the logits."""
    return torch.softmax(logits, 1) - F.one_hot(labels, logits.shape[1]).double()


def canary_model(mode: str, pixels: int, canaries: int, canary_norm: float, num_classes: int = 10) -> nn.Module:
    """A fresh canary model for the engine's ``mode`` (``"lora"``: wrapped by
    :func:`dpzoo.dp_lora`, ``fc`` and ``canary_proj`` adapted at rank 4)."""
    cls = {"bitfit": BiasCanaryClassifier, "lora": LoraCanaryClassifier}.get(mode, DiracCanaryClassifier)
    model = cls(pixels, canaries, canary_norm, num_classes)
    if mode != "lora":
        return model
    from ..integrations.peft import dp_lora

    model = dp_lora(model, r=4, alpha=4, target_modules=["canary_proj", "fc"], modules_to_save=None,
                    task_type=None, init_lora_weights=False)  # fmt: skip
    with torch.no_grad():  # a large B keeps most of a canary's clipped gradient on its own column of A
        model.canary_parameters()[1].mul_(LORA_B_SCALE)
    return model
