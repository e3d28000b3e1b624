"""DP-FROST: differentially private selection of the parameter partitions to fine-tune
("DP-FROST: differentially private fine-tuning of pre-trained models with freezing parameters",
§4 and App. C). ``dpzoo.frost.select(...)``."""

from .estimation import pgm_est, pgm_variance
from .magnitudes import METHODS, clipped_partition_sums, pgms, sensitivity
from .partitions import Partition, default_partitions, resolve_partitions
from .selection import FrostSelection, compute_sigma, default_loss, psel, select

__all__ = [
    "select",
    "FrostSelection",
    "compute_sigma",
    "psel",
    "pgm_est",
    "pgm_variance",
    "Partition",
    "default_partitions",
    "resolve_partitions",
    "sensitivity",
    "clipped_partition_sums",
    "pgms",
    "METHODS",
    "default_loss",
]
