"""Built-in per-sample-gradient rules, one file per layer family."""

from . import conv, embedding, hf_conv1d, layerscale, linear, norms  # noqa: F401
