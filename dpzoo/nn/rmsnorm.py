"""RMSNorm with a bias, for BiTFiT-Add on LLaMA-style models (DP-BiTFiT paper, §3.4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidArgumentError


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with an optional additive bias.

    ``style`` fixes the arithmetic so that, with a zero bias, the output is bit-identical
    to the module it replaces:

    * ``"llama"``: Hugging Face ``LlamaRMSNorm`` (normalise in float32, cast back to the
      input dtype, then scale): ``w ⊙ cast(x / sqrt(mean(x²) + eps)) + b``;
    * ``"torch"``: ``torch.nn.RMSNorm`` (``F.rms_norm``), plus ``b``;
    * ``"gemma"``: Hugging Face ``GemmaRMSNorm``, which scales by ``1 + w`` (its ``w`` starts at 0)
      in float32 and casts the product back: ``cast(x / sqrt(mean(x²) + eps) ⊙ (1 + w)) + b``.
      The per-sample gradient of ``w`` is the same as for ``w ⊙ x̂``;
    * ``"t5"``: Hugging Face ``T5LayerNorm`` (the mean square in float32, the input itself
      scaled, cast to a half-precision weight's dtype, then scaled): ``w ⊙ x̂ + b``.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float | None = 1e-6,
        *,
        bias: bool = True,
        elementwise_affine: bool = True,
        style: str = "llama",
        device=None,
        dtype=None,
    ):
        super().__init__()
        if style not in ("llama", "torch", "gemma", "t5"):
            raise InvalidArgumentError(
                f"RMSNorm style={style!r} is not supported; pass style='llama', 'torch', 'gemma' or 't5'."
            )
        factory = {"device": device, "dtype": dtype}
        self.hidden_size, self.eps, self.style = int(hidden_size), eps, style
        start = torch.zeros if style == "gemma" else torch.ones  # the identity scale either way
        self.weight = nn.Parameter(start(hidden_size, **factory)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(hidden_size, **factory)) if bias else None

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised input x̂, before the affine map (the per-sample-norm rules use it)."""
        if self.style == "torch":
            return F.rms_norm(x, (self.hidden_size,), None, self.eps)
        if self.style == "t5":
            h = x * torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + self.eps)
            half = self.weight is not None and self.weight.dtype in (torch.float16, torch.bfloat16)
            return h.to(self.weight.dtype) if half else h
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "torch":
            out = F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        elif self.style == "gemma":
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            out = (h * (1.0 + self.weight.float()) if self.weight is not None else h).type_as(x)
        else:
            out = self.normalize(x)
            if self.weight is not None:
                out = self.weight * out
        if self.bias is not None:
            out = out + self.bias
        return out

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, style={self.style}, bias={self.bias is not None}"
