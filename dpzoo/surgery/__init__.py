"""Model surgery that makes any ``nn.Module`` DP-ready (see :func:`make_dp_ready`)."""

from .bias import BiasReport, add_missing_biases, missing_biases
from .dp_ready import PatchReport, check_dp_ready, make_dp_ready, patch_report
from .groupnorm import choose_num_groups, convert_batchnorm
from .inplace import InplaceOp, disable_inplace, find_inplace_ops
from .layers import LayerReport, replace_layers
from .tied import TiedGroup, find_tied_parameters

__all__ = [
    "make_dp_ready",
    "check_dp_ready",
    "PatchReport",
    "patch_report",
    "add_missing_biases",
    "missing_biases",
    "BiasReport",
    "convert_batchnorm",
    "choose_num_groups",
    "replace_layers",
    "LayerReport",
    "disable_inplace",
    "find_inplace_ops",
    "InplaceOp",
    "find_tied_parameters",
    "TiedGroup",
]
