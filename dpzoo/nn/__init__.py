"""DP-ready layers dpzoo substitutes into models (see :mod:`dpzoo.surgery`)."""

from .rmsnorm import RMSNorm
from .resnet_blocks import DPBasicBlock, DPBottleneck

__all__ = ["RMSNorm", "DPBasicBlock", "DPBottleneck"]
