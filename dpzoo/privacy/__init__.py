"""dpzoo's DP training engine: Poisson sampling, per-sample clipping through the norm hooks,
Gaussian noise, accounting (see :class:`PrivacyEngine`)."""

from .accounting.accountant import (
    ACCOUNTANTS,
    Accountant,
    AccountantSpec,
    accountant_spec,
    get_noise_multiplier,
    register_accountant,
    unregister_accountant,
)
from .batch_memory import BatchMemoryManager, PhysicalBatchLoader
from .data import DPDataLoader, PoissonBatchSampler, StepSignal
from .engine import PrivacyEngine, freeze_all_but_biases, sample_mixing_modules
from .grad_scaler import DPGradScaler
from .modes import MODES, TRAINING_MODES, TrainingMode
from .optimizer import CLIPPING, DPOptimizer, clip_factors
from .protocols import NoiseAware
from .verify import SelfCheckReport, self_check

__all__ = [
    "Accountant",
    "ACCOUNTANTS",
    "AccountantSpec",
    "register_accountant",
    "unregister_accountant",
    "accountant_spec",
    "get_noise_multiplier",
    "PrivacyEngine",
    "MODES",
    "TRAINING_MODES",
    "TrainingMode",
    "DPOptimizer",
    "DPGradScaler",
    "clip_factors",
    "CLIPPING",
    "DPDataLoader",
    "PoissonBatchSampler",
    "StepSignal",
    "BatchMemoryManager",
    "PhysicalBatchLoader",
    "freeze_all_but_biases",
    "sample_mixing_modules",
    "SelfCheckReport",
    "self_check",
    "NoiseAware",
]
