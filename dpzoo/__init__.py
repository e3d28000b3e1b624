"""dpzoo: a zoo of differentially-private-ready architectures.

>>> import dpzoo
>>> model = dpzoo.load("resnet18-gn-bias", num_classes=10)
"""

__version__ = "0.1.0"

from . import frost  # noqa: E402  (dpzoo.frost.select)
from .audit import audit  # noqa: E402  (dpzoo.audit(...); the module's other names: from dpzoo.audit import ...)
from .errors import (
    AccountingError,
    CheckpointError,
    DPZooError,
    InvalidArgumentError,
    MissingDependencyError,
    NoGradientWarning,
    OverrideError,
    PatchError,
    PrivacyUsageError,
    ReproducibleNoiseWarning,
    SaveError,
    SelfCheckError,
    UnknownModelError,
    UnsupportedBatchError,
    UnsupportedModuleError,
)
from .grad_norms import NormHooks, attach_norm_hooks, register_rule
from .hub import create_model, load, privacy_metadata, read_config, save
from .privacy import PrivacyEngine, register_accountant, unregister_accountant
from .privacy.verify import verify
from .registry import ModelCard, is_model, list_models, model_card, register_model, unregister_model
from .summary import ModelSummary, summary
from .surgery import check_dp_ready, find_inplace_ops, find_tied_parameters, make_dp_ready

__all__ = [
    "__version__",
    "load",
    "create_model",
    "save",
    "read_config",
    "privacy_metadata",
    "list_models",
    "register_model",
    "unregister_model",
    "model_card",
    "is_model",
    "ModelCard",
    "summary",
    "ModelSummary",
    "make_dp_ready",
    "check_dp_ready",
    "find_tied_parameters",
    "find_inplace_ops",
    "PrivacyEngine",
    "register_accountant",
    "unregister_accountant",
    "verify",
    "attach_norm_hooks",
    "NormHooks",
    "register_rule",
    "frost",
    "audit",
    "DPZooError",
    "UnknownModelError",
    "UnsupportedModuleError",
    "OverrideError",
    "CheckpointError",
    "PatchError",
    "SaveError",
    "PrivacyUsageError",
    "AccountingError",
    "SelfCheckError",
    "InvalidArgumentError",
    "MissingDependencyError",
    "UnsupportedBatchError",
    "NoGradientWarning",
    "ReproducibleNoiseWarning",
]
