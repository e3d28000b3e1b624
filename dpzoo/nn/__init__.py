"""DP-ready layers dpzoo substitutes into models (see :mod:`dpzoo.surgery`)."""

from .recurrent import DPGRU, DPLSTM
from .resnet_blocks import DPBasicBlock, DPBottleneck
from .rmsnorm import RMSNorm

__all__ = ["DPGRU", "DPLSTM", "RMSNorm", "DPBasicBlock", "DPBottleneck"]
