"""timm LayerScale (x · γ, channels last) and LayerScale2d (channels first): γ's per-sample
gradient is Σ_t g_t ⊙ x_t."""

from __future__ import annotations

from ..registry import register_rule
from ..reps import Dense
from ._util import channels_to_last, tokens_last

try:
    from timm.layers import LayerScale, LayerScale2d
except ImportError:  # pragma: no cover
    LayerScale = LayerScale2d = None

if LayerScale is not None:

    @register_rule(LayerScale, params=("gamma",))
    def layerscale_rule(module, activations, grad_output, params):
        return {"gamma": Dense((tokens_last(grad_output) * tokens_last(activations[0])).sum(1))}

    @register_rule(LayerScale2d, params=("gamma",))
    def layerscale2d_rule(module, activations, grad_output, params):
        return {"gamma": Dense((channels_to_last(grad_output) * channels_to_last(activations[0])).sum(1))}
