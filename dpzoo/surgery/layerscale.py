"""Give a ConvNeXt block's layer scale a module of its own, so its per-sample gradient has a rule.

timm's ``ConvNeXtBlock`` multiplies its MLP's output by a loose parameter, ``x.mul(self.gamma.reshape(1,
-1, 1, 1))``, inside the block's forward: no module owns that product, so no per-sample rule can
see γ's gradient (Σ over positions of the output gradient times the MLP's output), and dpzoo's
hooks refuse the block. :func:`move_layer_scales` moves γ into timm's own ``LayerScale`` (channels
last) or ``LayerScale2d`` (``conv_mlp``, channels first), appended to the block's MLP, and sets the
block's ``gamma`` to None, so timm's forward skips its own product: the same products of the same
numbers, bit for bit (checked on a probe input; a block that differs is left alone and reported),
and γ gets the existing rules of ``grad_norms/rules/layerscale.py``. ``load_state_dict`` still
accepts timm's keys (``gamma``, ``mlp.fc1.weight``, ...).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["move_layer_scales"]


def _convnext_block_type():
    try:
        from timm.models.convnext import ConvNeXtBlock
    except ImportError:  # pragma: no cover - timm is a dependency
        return None
    return ConvNeXtBlock


def move_layer_scales(model: nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """Move the layer scale of every timm ConvNeXt block of ``model`` into its MLP, in place.
    Returns ({block name: what was done}, {block name: why it was left alone})."""
    block_type = _convnext_block_type()
    done: dict[str, str] = {}
    left: dict[str, str] = {}
    if block_type is None:
        return done, left
    for name, block in model.named_modules():
        if type(block) is not block_type or getattr(block, "gamma", None) is None:
            continue
        why = _move(block)
        if why is None:
            done[name] = "ConvNeXtBlock.gamma -> LayerScale after its MLP"
        else:
            left[name] = why
    return done, left


def _move(block: nn.Module) -> str | None:
    from timm.layers import LayerScale, LayerScale2d

    if "forward" in vars(block) or block._forward_hooks or block._forward_pre_hooks:
        return "its forward was replaced or hooked on the instance: left alone"
    gamma = block.gamma
    assert isinstance(gamma, nn.Parameter)  # a ConvNeXtBlock with a layer scale (checked by the caller)
    scale = (LayerScale2d if block.use_conv_mlp else LayerScale)(gamma.shape[0], device=gamma.device, dtype=gamma.dtype)
    scale.gamma = gamma  # the same Parameter: the optimizer and requires_grad follow it
    x = _probe_input(block, gamma)
    before = _eval_output(block, x)
    old_mlp = block.mlp
    block.mlp = nn.Sequential(old_mlp, scale)
    block.gamma = None
    after = _eval_output(block, x)
    if before is None or after is None or not torch.equal(before, after):
        block.mlp, block.gamma = old_mlp, gamma  # undo: this timm computes something else
        return "moving its layer scale changed (or could not check) its outputs: left alone"
    block.register_load_state_dict_pre_hook(_accept_timm_keys)
    return None


def _probe_input(block: nn.Module, gamma: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, block.conv_dw.in_channels, 7, 7, generator=g).to(device=gamma.device, dtype=gamma.dtype)


@torch.no_grad()
def _eval_output(block: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The block's output on ``x`` in eval mode (drop path off), or None if it rejects ``x``."""
    was = block.training
    block.eval()
    try:
        return block(x)
    except Exception:  # noqa: BLE001 - a block that needs other inputs is left alone
        return None
    finally:
        block.train(was)


def _accept_timm_keys(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    """timm's keys for this block (``gamma``, ``mlp.<name>``) read as the moved ones."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix) :]
        if rest == "gamma":
            state_dict[prefix + "mlp.1.gamma"] = state_dict.pop(key)
        elif rest.startswith("mlp.") and not rest.startswith(("mlp.0.", "mlp.1.")):
            state_dict[prefix + "mlp.0." + rest[4:]] = state_dict.pop(key)
