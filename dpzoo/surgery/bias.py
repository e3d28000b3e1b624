"""BiTFiT-Add: give every layer that lacks a bias a zero (or small random) one.

DP-BiTFiT paper §3.4 ("DP-BiTFiT-Add"): ResNet convolutions and LLaMA projections have
no bias, so bias-term fine-tuning would have almost nothing to train. Adding zero biases
keeps the function bit-identical (tested per zoo entry) while enlarging the trainable
bias space; the paper also allows a random initialisation.

Covered: ``nn.Linear``, ``nn.Conv{1,2,3}d`` and transposed convolutions (and subclasses),
``nn.MultiheadAttention``'s input projection, affine ``LayerNorm`` / ``GroupNorm`` without
a bias, and RMSNorm layers, which are replaced by :class:`dpzoo.nn.RMSNorm` when a
numerical check proves the replacement computes the same function. Normalisation layers
with ``affine=False`` have no parameters by design and are left alone.
"""

from __future__ import annotations

import copy
import fnmatch
from dataclasses import dataclass, field
from typing import Iterable, cast

import torch
from torch import nn
from torch.nn.modules.conv import _ConvNd

from ..errors import PatchError
from ..nn.rmsnorm import RMSNorm

__all__ = ["add_missing_biases", "BiasReport", "missing_biases", "BIAS_LAYER_TYPES"]

BIAS_LAYER_TYPES = (nn.Linear, _ConvNd)


@dataclass
class BiasReport:
    added: list[str] = field(default_factory=list)  # module names given a bias
    replaced_norms: list[str] = field(default_factory=list)  # RMSNorms swapped for dpzoo's
    not_patched: dict[str, str] = field(default_factory=dict)  # name -> why not


def _matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def _new_bias(size: int, like: torch.Tensor, init: str, std: float, generator: torch.Generator | None) -> nn.Parameter:
    b = torch.zeros(size, dtype=like.dtype, device=like.device)
    if init == "normal" and like.device.type != "meta":
        b.copy_(torch.randn(size, generator=generator, dtype=torch.float32) * std)
    return nn.Parameter(b, requires_grad=like.requires_grad)


_T5_NORMS = ("T5LayerNorm", "MT5LayerNorm", "UMT5LayerNorm", "LongT5LayerNorm")  # RMS norms by another name


def _is_rmsnorm(m: nn.Module) -> bool:
    if isinstance(m, RMSNorm):
        return False
    if isinstance(m, getattr(nn, "RMSNorm", ())):
        return m.weight is not None  # elementwise_affine=False: no parameters, nothing to add
    w = getattr(m, "weight", None)
    return (
        (type(m).__name__.lower().endswith("rmsnorm") or type(m).__name__ in _T5_NORMS)
        and isinstance(w, nn.Parameter)
        and w.dim() == 1
        and getattr(m, "bias", None) is None
    )


def _rmsnorm_replacement(m: nn.Module) -> RMSNorm | None:
    """A dpzoo RMSNorm that provably computes what ``m`` computes, or None."""
    w = cast(torch.Tensor, m.weight)  # a Parameter: callers check _is_rmsnorm(m) first
    if isinstance(m, getattr(nn, "RMSNorm", ())):
        shape = cast(tuple[int, ...], m.normalized_shape)
        if len(shape) != 1 or w is None:
            return None
        new = RMSNorm(shape[0], m.eps, style="torch", device="cpu")
        with torch.device("cpu"):  # also inside a `with torch.device("meta")` block
            return _proven_replacement(m, new, w)
    eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
    if not isinstance(eps, float):
        return None
    # Numerical proof on a CPU copy with random weights: same outputs, bit for bit, for the first
    # arithmetic that matches (LLaMA's w ⊙ x̂, Gemma's (1 + w) ⊙ x̂, or T5's). (Built on the CPU
    # explicitly: an ambient `with torch.device("meta")` would put it on meta.)
    with torch.device("cpu"):  # also inside a `with torch.device("meta")` block
        for style in ("llama", "gemma", "t5"):
            proven = _proven_replacement(m, RMSNorm(w.shape[0], eps, style=style, device="cpu"), w)
            if proven is not None:
                return proven
    return None


def _proven_replacement(m: nn.Module, new: RMSNorm, w: torch.Tensor) -> RMSNorm | None:
    probe_old = copy.deepcopy(m).to_empty(device="cpu") if w.device.type == "meta" else copy.deepcopy(m).cpu()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        rw = torch.randn(w.shape, generator=g).to(w.dtype if w.dtype.is_floating_point else torch.float32)
        probe_old.weight.copy_(rw)
        new = new.to(dtype=rw.dtype)
        new.weight.copy_(rw)
        # torch-style RMSNorm warns on an input dtype other than its weight's: probe only that
        for dtype in (torch.float32,) if new.style == "torch" else (torch.float32, torch.bfloat16):
            x = torch.randn(3, 5, w.shape[0], generator=g).to(dtype)
            try:
                same = torch.equal(probe_old(x), new(x))
            except Exception:  # a module that rejects the probe is not a plain RMSNorm
                return None
            if not same:
                return None
    new = new.to(device=w.device, dtype=w.dtype)
    return new


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def add_missing_biases(
    model: nn.Module,
    *,
    exclude: Iterable[str] = (),
    init: str = "zero",
    std: float = 1e-3,
    norms: bool = True,
    seed: int | None = None,
) -> BiasReport:
    """Add a bias to every Conv/Linear (and affine normalisation layer) that lacks one.

    Args:
        exclude: fnmatch patterns of module names to leave alone (e.g. ``"lm_head"``).
        init: ``"zero"`` (default: the model computes exactly what it did) or ``"normal"``
            (N(0, std²), the paper's "randomly initialized" option).
        norms: also patch normalisation layers (LayerNorm/GroupNorm without bias, RMSNorm).
        seed: seed for ``init="normal"``.

    Returns a :class:`BiasReport`; the model is modified in place.
    """
    if init not in ("zero", "normal"):
        raise PatchError(f"bias init must be 'zero' or 'normal', got {init!r}")
    if init == "normal" and not (std > 0):
        raise PatchError(f"bias std must be > 0 for init='normal', got {std!r}")
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    report = BiasReport()
    for name, m in list(model.named_modules()):
        if not name or _matches(name, exclude):
            continue
        if isinstance(m, BIAS_LAYER_TYPES):
            if m.bias is None:
                out = m.out_channels if isinstance(m, _ConvNd) else m.out_features
                m.bias = _new_bias(out, m.weight, init, std, gen)
                report.added.append(name)
        elif isinstance(m, nn.MultiheadAttention):
            # kdim/vdim != embed_dim: separate q/k/v weights, but still one packed in_proj_bias
            like = m.in_proj_weight if m.in_proj_weight is not None else m.q_proj_weight
            if m.in_proj_bias is None and like is not None:
                m.in_proj_bias = _new_bias(3 * m.embed_dim, like, init, std, gen)
                report.added.append(name)
        elif not norms:
            continue
        elif isinstance(m, (nn.LayerNorm, nn.GroupNorm)):
            if m.weight is None:
                report.not_patched[name] = f"{type(m).__name__} has affine=False (no parameters)"
            elif m.bias is None:
                # numel(), not torch.tensor(shape).prod(): that would be a meta tensor (and
                # .item() fail) inside a `with torch.device("meta")` block
                b = _new_bias(m.weight.numel(), m.weight, init, std, gen)
                m.bias = nn.Parameter(b.data.reshape(m.weight.shape), requires_grad=b.requires_grad)
                report.added.append(name)
        elif isinstance(m, getattr(nn, "RMSNorm", ())) and m.weight is None:
            report.not_patched[name] = "RMSNorm has elementwise_affine=False (no parameters)"
        elif _is_rmsnorm(m):
            new = _rmsnorm_replacement(m)
            if new is None:
                report.not_patched[name] = (
                    f"{type(m).__name__}: not recognised as a standard RMSNorm, left without a bias"
                )
                continue
            with torch.no_grad():
                if m.weight.device.type != "meta":
                    new.weight.copy_(m.weight)
                new.weight.requires_grad_(m.weight.requires_grad)
                new.bias.copy_(_new_bias(new.hidden_size, new.weight, init, std, gen))
                new.bias.requires_grad_(m.weight.requires_grad)
            new.train(m.training)
            _set_submodule(model, name, new)
            report.added.append(name)
            report.replaced_norms.append(name)
    return report


def missing_biases(model: nn.Module, exempt: Iterable[str] = ()) -> list[str]:
    """Names of Conv/Linear layers (and affine norms) without a bias, outside ``exempt``."""
    out = []
    for name, m in model.named_modules():
        if not name or _matches(name, exempt):
            continue
        if isinstance(m, BIAS_LAYER_TYPES) and m.bias is None:
            out.append(name)
        elif isinstance(m, nn.MultiheadAttention) and m.in_proj_bias is None:
            out.append(name)
        elif isinstance(m, (nn.LayerNorm, nn.GroupNorm)) and m.weight is not None and m.bias is None:
            out.append(name)
        elif _is_rmsnorm(m):
            out.append(name)
    return out
