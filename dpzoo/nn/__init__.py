"""DP-ready layers dpzoo substitutes into models (see :mod:`dpzoo.surgery`)."""

from .attention import DPMultiheadAttention, SequenceBias
from .hf_blocks import DPOPTDecoderLayer
from .recurrent import DPGRU, DPLSTM, DPRNN
from .resnet_blocks import DPBasicBlock, DPBottleneck
from .rmsnorm import RMSNorm

__all__ = [
    "DPGRU",
    "DPLSTM",
    "DPRNN",
    "DPMultiheadAttention",
    "SequenceBias",
    "DPOPTDecoderLayer",
    "RMSNorm",
    "DPBasicBlock",
    "DPBottleneck",
]
