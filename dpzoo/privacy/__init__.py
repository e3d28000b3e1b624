"""dpzoo's DP training engine: Poisson sampling, per-sample clipping through the norm hooks,
Gaussian noise, accounting (see :class:`PrivacyEngine`)."""

from .accountant import ACCOUNTANTS, Accountant, get_noise_multiplier
from .data import DPDataLoader, PoissonBatchSampler, StepSignal
from .engine import MODES, PrivacyEngine, freeze_all_but_biases, sample_mixing_modules
from .verify import SelfCheckReport, self_check
from .optimizer import CLIPPING, DPOptimizer, clip_factors
from .protocols import NoiseAware

__all__ = ["Accountant", "ACCOUNTANTS", "get_noise_multiplier", "PrivacyEngine", "MODES", "DPOptimizer",
           "clip_factors", "CLIPPING", "DPDataLoader", "PoissonBatchSampler", "StepSignal",
           "freeze_all_but_biases", "sample_mixing_modules", "SelfCheckReport", "self_check", "NoiseAware"]
