"""LayerNorm, GroupNorm (and timm's GroupNormAct), RMSNorm (dpzoo's, torch's, LLaMA's, Gemma's, T5's).

Weight: Σ_t g_t ⊙ x̂_t with x̂ the normalised input (recomputed from the stored input);
bias: Σ_t g_t, activation-free (DP-BiTFiT Algorithm 1). Both are small: per-sample
gradients are instantiated (Dense).
"""

from __future__ import annotations

import importlib
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from ...nn.rmsnorm import RMSNorm
from ..registry import register_rule
from ..reps import Dense
from ._util import sum_all_but


@register_rule(nn.LayerNorm, activation_free={"bias"})
def layernorm_rule(module: nn.LayerNorm, activations, grad_output, params):
    nd = len(module.normalized_shape)
    out = {}
    if "weight" in params:
        xhat = F.layer_norm(activations[0], module.normalized_shape, None, None, module.eps)
        out["weight"] = Dense(sum_all_but(grad_output * xhat, nd))
    if "bias" in params:
        out["bias"] = Dense(sum_all_but(grad_output, nd))
    return out


try:  # timm's LayerNorm computes F.layer_norm too (optionally a fused kernel)
    from timm.layers.norm import LayerNorm as TimmLayerNorm
    from timm.layers.norm import LayerNorm2d as TimmLayerNorm2d
except ImportError:  # pragma: no cover
    TimmLayerNorm = TimmLayerNorm2d = None
if TimmLayerNorm is not None:
    register_rule(TimmLayerNorm, activation_free={"bias"})(layernorm_rule)

    @register_rule(TimmLayerNorm2d, activation_free={"bias"})
    def layernorm2d_rule(module, activations, grad_output, params):
        # channels first: normalise over C at every position, i.e. LayerNorm on (B, H, W, C)
        acts = None if activations is None else (activations[0].permute(0, 2, 3, 1),)
        return layernorm_rule(module, acts, grad_output.permute(0, 2, 3, 1), params)


def _per_channel_sum(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], x.shape[1], -1).sum(2)


@register_rule(nn.GroupNorm, activation_free={"bias"})
def groupnorm_rule(module: nn.GroupNorm, activations, grad_output, params):
    out = {}
    if "weight" in params:
        xhat = F.group_norm(activations[0], module.num_groups, None, None, module.eps)
        out["weight"] = Dense(_per_channel_sum(grad_output * xhat))
    if "bias" in params:
        out["bias"] = Dense(_per_channel_sum(grad_output))
    return out


try:
    from timm.layers.norm_act import GroupNormAct
except ImportError:  # pragma: no cover
    GroupNormAct = None

if GroupNormAct is not None:
    _RANDOM = (nn.RReLU, nn.modules.dropout._DropoutNd)

    def _check_gn_act(module) -> str | None:
        if not isinstance(module.drop, nn.Identity):
            return "GroupNormAct with dropout: its random mask cannot be recomputed"
        # the rule recomputes act(GN(x)) to pull the output gradient back through it: an activation
        # drawing random numbers in training (RReLU's slopes) would be pulled back with other draws
        if any(isinstance(m, _RANDOM) for m in module.act.modules()):
            return (
                f"GroupNormAct with a random activation ({type(module.act).__name__}): the draws of the "
                "forward pass cannot be recomputed"
            )
        return None

    @register_rule(
        GroupNormAct, check=_check_gn_act, activation_free={"bias"}, grad_from=lambda m: cast(nn.Module, m.act)
    )
    def groupnorm_act_rule(module, activations, grad_output, params):
        if activations is None:  # activation-free: grad_output is already ∂L/∂GN(x) (act's input)
            return groupnorm_rule(module, None, grad_output, params)
        # The output is act(GN(x)): pull grad_output back through the activation first.
        x = activations[0]
        with torch.enable_grad():
            y = F.group_norm(
                x, module.num_groups, module.weight.detach(), module.bias.detach(), module.eps
            ).requires_grad_(True)
            (g,) = torch.autograd.grad(module.act(y.clone()), y, grad_output)  # act may be in-place
        return groupnorm_rule(module, activations, g, params)


def _rms_rule(normalize):
    def rule(module, activations, grad_output, params):
        out = {}
        if "weight" in params:
            xhat = normalize(module, activations[0])
            out["weight"] = Dense(sum_all_but(grad_output * xhat, 1))
        if "bias" in params:
            out["bias"] = Dense(sum_all_but(grad_output, 1))
        return out

    return rule


# forward (llama style) and the rule both call normalize: a subclass overriding it changes both, but
# the torch style forward does not call it, so the rule relies on it too
register_rule(RMSNorm, activation_free={"bias"}, methods=("normalize",))(_rms_rule(lambda m, x: m.normalize(x)))

if hasattr(nn, "RMSNorm"):

    def _torch_rms_check(module) -> str | None:
        return None if len(module.normalized_shape) == 1 else "RMSNorm over several dims"

    register_rule(nn.RMSNorm, params=("weight",), check=_torch_rms_check)(
        _rms_rule(lambda m, x: F.rms_norm(x, m.normalized_shape, None, m.eps))
    )


def _llama_normalize(module, x):
    h = x.to(torch.float32)
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)).to(x.dtype)


def _gemma_normalize(module, x):
    # GemmaRMSNorm scales x̂ by (1 + w): ∂/∂w is x̂, as for LLaMA's w ⊙ x̂
    h = x.to(torch.float32)
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.eps)).to(x.dtype)


def _register_hf_rmsnorm(module_path: str, class_name: str, normalize) -> None:
    """The RMSNorm rule for a transformers class (weight only, no bias), if this version has it."""
    try:
        cls = getattr(importlib.import_module(module_path), class_name)
    except (ImportError, AttributeError):  # pragma: no cover
        return
    register_rule(cls, params=("weight",))(_rms_rule(normalize))


_register_hf_rmsnorm("transformers.models.llama.modeling_llama", "LlamaRMSNorm", _llama_normalize)
_register_hf_rmsnorm("transformers.models.gemma.modeling_gemma", "GemmaRMSNorm", _gemma_normalize)


def _t5_normalize(module, x):
    # T5LayerNorm.forward: the variance in float32, x itself (not its float32 copy) scaled, then
    # cast to a half-precision weight's dtype
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    h = x * torch.rsqrt(variance + module.variance_epsilon)
    return h.to(module.weight.dtype) if module.weight.dtype in (torch.float16, torch.bfloat16) else h


try:
    from transformers.models.t5.modeling_t5 import T5LayerNorm
except ImportError:  # pragma: no cover
    T5LayerNorm = None
if T5LayerNorm is not None:  # RMS norm, weight only (no bias, no mean subtracted)
    register_rule(T5LayerNorm, params=("weight",))(_rms_rule(_t5_normalize))
