"""DP-ready layers dpzoo substitutes into models (see :mod:`dpzoo.surgery`)."""

from .recurrent import DPGRU, DPLSTM
from .rmsnorm import RMSNorm
from .resnet_blocks import DPBasicBlock, DPBottleneck

__all__ = ["DPGRU", "DPLSTM", "RMSNorm", "DPBasicBlock", "DPBottleneck"]
