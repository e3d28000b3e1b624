"""Built-in per-sample-gradient rules, one file per layer family; :mod:`.loose` declares the
tensors used outside a rule (loose tensors, broadcast lookups)."""

from . import conv, embedding, hf_conv1d, layerscale, linear, loose, norms  # noqa: F401
