"""Built-in per-sample-gradient rules, one file per layer family; :mod:`.loose` declares the
tensors used outside a rule (loose tensors, broadcast lookups)."""

from . import (  # noqa: F401
    attention,
    conv,
    conv_transpose,
    embedding,
    hf_conv1d,
    hf_positions,
    instance_norm,
    layerscale,
    linear,
    loose,
    norms,
    prelu,
    scaled_embedding,
)
