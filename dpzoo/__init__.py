"""dpzoo: a zoo of differentially-private-ready architectures.

>>> import dpzoo
>>> model = dpzoo.load("resnet18-gn-bias", num_classes=10)

The public names are imported on first use (PEP 562), so that ``import dpzoo.cli`` (``dpzoo
--help``) and the light modules (errors, registries) do not import torch, timm and transformers.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from .errors import (
    AccountingError,
    CheckpointError,
    DPZooError,
    InvalidArgumentError,
    LossMixingError,
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
    UntestedVersionWarning,
    WeakPrivacyWarning,
)
from .registry import ModelCard, register_model

if TYPE_CHECKING:  # for type checkers and IDEs: the names __getattr__ imports on first use
    from . import frost
    from .audit import audit
    from .grad_norms import NormHooks, attach_norm_hooks, register_rule
    from .hub.load_save import create_model, load, privacy_metadata, read_config, save
    from .hub.statement import privacy_statement
    from .models import is_model, list_models, model_card, unregister_model
    from .privacy import DPGradScaler, PrivacyEngine, register_accountant, unregister_accountant
    from .privacy.verify import verify
    from .summary import ModelSummary, summary
    from .surgery import check_dp_ready, find_inplace_ops, find_tied_parameters, make_dp_ready

from .versions import __version__, warn_if_untested  # noqa: E402

warn_if_untested()  # once, on import: torch / transformers outside the range the exactness suites ran on

from .integrations.peft_merge import install as _watch_peft_merges  # noqa: E402

_watch_peft_merges()  # a LoRA adapter merged into its base layer keeps its provenance (torch-free until PEFT loads)

from .integrations.hf_save_watch import install as _watch_hf_saves  # noqa: E402

_watch_hf_saves()  # save_pretrained writes what the model it is called on carries (torch-free until transformers loads)

# name -> (module, attribute; None: the module itself), imported when first used
_LAZY: dict[str, tuple[str, str | None]] = {
    "frost": (".frost", None),
    "audit": (".audit", "audit"),
    **{n: (".grad_norms", n) for n in ("NormHooks", "attach_norm_hooks", "register_rule")},
    **{n: (".hub.load_save", n) for n in ("create_model", "load", "privacy_metadata", "read_config", "save")},
    **{n: (".privacy", n) for n in ("PrivacyEngine", "DPGradScaler", "register_accountant", "unregister_accountant")},
    "verify": (".privacy.verify", "verify"),
    **{n: (".models", n) for n in ("is_model", "list_models", "model_card", "unregister_model")},
    "privacy_statement": (".hub.statement", "privacy_statement"),
    **{n: (".summary", n) for n in ("ModelSummary", "summary")},
    **{n: (".surgery", n) for n in ("check_dp_ready", "find_inplace_ops", "find_tied_parameters", "make_dp_ready")},
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'dpzoo' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value: Any = importlib.import_module(module, __name__)
    if attribute is not None:
        value = getattr(value, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(types.ModuleType):
    """``dpzoo.audit`` and ``dpzoo.summary`` are functions, not the submodules of the same names:
    importing ``dpzoo.audit.<anything>`` or ``dpzoo.summary`` would set the package's attribute to
    the submodule (the import system does), so such assignments are ignored (the submodules stay
    in sys.modules)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name, ("", None))[1] is not None:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = [
    "__version__",
    "load",
    "create_model",
    "save",
    "read_config",
    "privacy_metadata",
    "privacy_statement",
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
    "DPGradScaler",
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
    "LossMixingError",
    "AccountingError",
    "SelfCheckError",
    "InvalidArgumentError",
    "MissingDependencyError",
    "UnsupportedBatchError",
    "NoGradientWarning",
    "ReproducibleNoiseWarning",
    "UntestedVersionWarning",
    "WeakPrivacyWarning",
]
