"""What a PEFT model holds, as dpzoo sees it: its LoRA layers and adapters, the ``modules_to_save``
copies, which of them run in forward, the adapters dpzoo cannot clip per sample, and the set
``mode="lora"`` trains (:func:`lora_trainable`). Building a DP-LoRA model is
:mod:`dpzoo.integrations.peft`'s job.

peft is imported only when used: a model can only be a PEFT model once peft is imported, so the
predicates answer False without importing it.
"""

from __future__ import annotations

import sys
from typing import Iterable

from torch import nn

from ..errors import InvalidArgumentError, MissingDependencyError, PrivacyUsageError, UnsupportedModuleError
from ..privacy.bitfit import default_head, head_parameters, is_bias_name

__all__ = [
    "import_peft",
    "is_peft_model",
    "wrapped_model",
    "lora_layers",
    "lora_parameters",
    "lora_trainable",
    "unsupported_lora_layers",
    "inactive_parameters",
    "train_head_patterns",
    "REFUSED_OPTIONS",
    "DATA_DRIVEN_INITS",
    "DATA_FREE_INITS",
    "data_free_init",
    "data_driven_inits",
    "declare_public_init",
    "PUBLIC_INIT_ATTR",
]

# LoraConfig options whose adapters are used outside a module dpzoo has a rule for
REFUSED_OPTIONS = {
    "use_dora": "DoRA computes with lora_B.weight @ lora_A.weight outside the adapters' forward",
    "trainable_token_indices": "PEFT's trainable tokens are a ParameterDict used functionally",
    "target_parameters": "LoRA on bare parameters (lora.ParamWrapper) uses the adapters functionally",
}

# LoRA initialisations computed from data: the adapters then hold a statistic of the data they saw.
# Named where known; any init not in DATA_FREE_INITS is treated the same way (PEFT adds new ones).
DATA_DRIVEN_INITS = {
    "eva": "EVA initialises lora_A with an SVD of the layers' input activations on a data loader",
    "corda": "CorDA initialises the adapters from the covariance of the layers' inputs on a data loader",
    "lora_ga": "LoRA-GA initialises the adapters (and shifts the base weights) from gradients on a data loader",
}
# initialisations computed from the weights or random draws alone (PEFT's LoraConfig.init_lora_weights)
DATA_FREE_INITS = (True, False, "gaussian", "orthogonal", "olora", "loftq")
PUBLIC_INIT_ATTR = "dpzoo_public_init"  # adapter name -> the user's statement that its init data are public


def import_peft():
    """The peft module, or a MissingDependencyError saying how to install it."""
    try:
        import peft
    except ImportError as e:  # pragma: no cover - exercised without the extra
        raise MissingDependencyError("DP-LoRA needs PEFT, which is not installed: pip install 'dpzoo[peft]'.") from e
    return peft


def loaded_peft():
    """The peft module if something imported it already, else None (then no model holds PEFT layers)."""
    return import_peft() if "peft" in sys.modules else None


def is_peft_model(model: nn.Module) -> bool:
    """True for a PEFT model: a ``peft.PeftModel`` / ``PeftMixedModel``, a PEFT tuner model
    (``LoraModel``, ...) or any model PEFT injected adapter layers into
    (``peft.inject_adapter_in_model``)."""
    peft = loaded_peft()
    if peft is None:
        return False
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer

    if isinstance(model, (peft.PeftModel, peft.PeftMixedModel, BaseTuner)):
        return True
    return any(isinstance(m, BaseTunerLayer) for m in model.modules())


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """PEFT's LoRA layers in ``model`` (``lora.Linear``, ``lora.Conv2d``, ``lora.Embedding``, ...), by name."""
    if loaded_peft() is None:
        return {}
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def _adapter_tensors(layer: nn.Module, adapters: Iterable[str]) -> list[nn.Parameter]:
    out = []
    for attr in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"):
        container = getattr(layer, attr, None)
        for a in adapters:
            if isinstance(container, nn.ParameterDict) and a in container:
                out.append(container[a])
            elif isinstance(container, nn.ModuleDict) and a in container:
                out.extend(container[a].parameters())
    return out


def _active(layer: nn.Module) -> list[str]:
    """The adapters a PEFT layer or wrapper runs in forward ([] while adapters are disabled)."""
    if getattr(layer, "disable_adapters", False):
        return []
    active = getattr(layer, "active_adapters", None) or getattr(layer, "active_adapter", [])
    return [active] if isinstance(active, str) else list(active)


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters of the active LoRA adapters (``lora_A``, ``lora_B`` with its bias if
    ``lora_bias=True``, ``lora_embedding_A/B``, DoRA magnitudes), by their names in ``model``."""
    ids = {id(p) for layer in lora_layers(model).values() for p in _adapter_tensors(layer, _active(layer))}
    return {n: p for n, p in model.named_parameters() if id(p) in ids}


def _wrappers(model: nn.Module) -> dict[str, nn.Module]:
    """PEFT's ``modules_to_save`` wrappers (a trained copy of a module beside its frozen original)."""
    peft = loaded_peft()
    if peft is None:
        return {}
    from peft.utils.other import ModulesToSaveWrapper

    return {n: m for n, m in model.named_modules() if isinstance(m, ModulesToSaveWrapper)}


def _active_copy(wrapper: nn.Module) -> str | None:
    """The adapter whose copy a ``modules_to_save`` wrapper runs in forward, or None (it runs the original)."""
    active = _active(wrapper)
    return active[0] if active and active[0] in wrapper.modules_to_save else None


def inactive_parameters(model: nn.Module) -> set[int]:
    """ids of parameters a PEFT model holds but does not run: the original of a ``modules_to_save``
    wrapper that runs its copy, other adapters' copies and LoRA weights (empty for other models)."""
    dead: set[int] = set()
    for wrapper in _wrappers(model).values():
        run = _active_copy(wrapper)
        if run is not None:
            dead |= {id(p) for p in wrapper.original_module.parameters()}
        for name, copy in wrapper.modules_to_save.items():
            if name != run:
                dead |= {id(p) for p in copy.parameters()}
    for layer in lora_layers(model).values():
        others = [a for a in {*layer.lora_A.keys(), *layer.lora_embedding_A.keys()} if a not in _active(layer)]
        dead |= {id(p) for p in _adapter_tensors(layer, others)}
    return dead


def unsupported_lora_layers(model: nn.Module) -> list[str]:
    """``"name (why)"`` for each active PEFT layer of ``model`` whose adapters dpzoo cannot clip per
    sample (the adapter weights are used outside a module dpzoo has a rule for)."""
    peft = loaded_peft()
    if peft is None:
        return []
    from peft.tuners.lora import layer as lora

    functional = tuple(getattr(lora, c) for c in ("MultiheadAttention", "ParamWrapper") if hasattr(lora, c))
    out = []
    for name, layer in lora_layers(model).items():
        active = _active(layer)
        variants = getattr(layer, "lora_variant", {})
        dora = getattr(layer, "use_dora", {})
        if any(a in layer.lora_embedding_A for a in active):
            out.append(
                f"{name} (LoRA on an embedding: peft's lora.Embedding uses lora_embedding_A/B functionally, "
                "with F.embedding and a matmul, and dpzoo has no per-sample rule for them; leave embeddings out "
                "of target_modules)"
            )
        elif any(a in variants or dora.get(a) for a in active):
            kind = next((type(variants[a]).__name__ for a in active if a in variants), "DoRA")
            out.append(
                f"{name} ({kind}: a LoRA variant computing with the adapter weights outside lora_A/lora_B's forward; "
                "use plain LoRA)"
            )
        elif functional and isinstance(layer, functional) and active:
            out.append(f"{name} (peft's {type(layer).__name__} merges the adapters into the weight functionally)")
    from peft.utils import other

    tokens = getattr(other, "TrainableTokensWrapper", None)
    if tokens is not None:
        for name, m in model.named_modules():
            if isinstance(m, tokens) and _active(m) and any(p.requires_grad for p in m.parameters()):
                out.append(f"{name} ({REFUSED_OPTIONS['trainable_token_indices']}; dpzoo has no per-sample rule)")
    return out


def wrapped_model(model: nn.Module) -> tuple[str, nn.Module]:
    """(prefix, model) of the model PEFT wraps ("base_model.model." in a PeftModel), or ("", model)."""
    peft = loaded_peft()
    if peft is None:
        return "", model
    from peft.tuners.tuners_utils import BaseTuner

    inner = model
    if isinstance(model, (peft.PeftModel, peft.PeftMixedModel)):
        inner = model.get_base_model()
    elif isinstance(model, BaseTuner):
        inner = model.model
    name = next(n for n, m in model.named_modules() if m is inner)
    return (f"{name}." if name else ""), inner


def train_head_patterns(model: nn.Module, train_head: Iterable[str] | str | None) -> Iterable[str] | str | None:
    """``train_head`` as module-name patterns of ``model``. ``"auto"``: the classification head
    (:func:`~dpzoo.privacy.bitfit.default_head`) found in the model PEFT wraps, named by its path in
    ``model``: PEFT's trained copy when it is in ``modules_to_save``. Anything else is kept."""
    if train_head != "auto":
        return train_head
    prefix, inner = wrapped_model(model)
    out = []
    for name in default_head(inner):
        path = prefix + name
        module = dict(model.named_modules()).get(path)
        wrappers = _wrappers(model)
        copy = _active_copy(module) if module is not None and path in wrappers else None
        out.append(f"{path}.modules_to_save.{copy}" if copy is not None else path)
    return out


def _peft_bias(model: nn.Module) -> set[str]:
    """The ``bias`` settings of the active adapters' PEFT configs (none for an injected model)."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict):
        return set()
    active = getattr(model, "active_adapters", None) or list(configs)
    active = [active] if isinstance(active, str) else active
    return {str(getattr(configs[a], "bias", "none")) for a in active if a in configs}


def lora_trainable(model: nn.Module, train_head: Iterable[str] | str | None = "auto") -> set[int]:
    """ids of the parameters ``mode="lora"`` trains (no mutation): every active LoRA adapter, the
    active copies of PEFT's ``modules_to_save``, the biases the PEFT config's ``bias`` names
    (``"all"``: every bias, as DP-BiTFiT; ``"lora_only"``: those of the adapted layers) and the
    ``train_head`` patterns (``"auto"``: :func:`train_head_patterns`; None: nothing more).

    Refuses a model without PEFT LoRA adapters (:class:`~dpzoo.errors.PrivacyUsageError`) and
    adapters dpzoo cannot clip (:class:`~dpzoo.errors.UnsupportedModuleError`, naming them)."""
    if not is_peft_model(model):
        raise PrivacyUsageError(
            f"mode='lora' trains the LoRA adapters of a PEFT model, and this {type(model).__name__} is not one: "
            "wrap it first (model = dpzoo.integrations.peft.dp_lora(model, r=8), or peft.get_peft_model(model, "
            "LoraConfig(...)); pip install 'dpzoo[peft]'), or use mode='auto' to train what requires grad."
        )
    layers = lora_layers(model)
    if not layers:
        raise PrivacyUsageError(
            "mode='lora' trains LoRA adapters, and this PEFT model has none (another PEFT method): use mode='auto', "
            "which trains whatever requires grad."
        )
    bad = unsupported_lora_layers(model)
    if bad:
        raise UnsupportedModuleError(f"LoRA layer(s) dpzoo cannot clip per sample: {'; '.join(bad[:4])}.")
    keep = {id(p) for p in lora_parameters(model).values()}
    if not keep:
        raise PrivacyUsageError("No LoRA adapter of this PEFT model is active: set_adapter(...) or enable adapters.")
    dead = inactive_parameters(model)
    for wrapper in _wrappers(model).values():
        copy, copies = _active_copy(wrapper), wrapper.get_submodule("modules_to_save")
        if copy is not None:
            keep |= {id(p) for p in copies.get_submodule(copy).parameters()}
    bias = _peft_bias(model)
    if "all" in bias:
        keep |= {id(p) for n, p in model.named_parameters() if is_bias_name(n) and id(p) not in dead}
    if "lora_only" in bias:
        keep |= {id(b) for layer in layers.values() if (b := getattr(layer.get_base_layer(), "bias", None)) is not None}
    patterns = train_head_patterns(model, train_head)
    heads = head_parameters(model, patterns) - dead
    if train_head not in ("auto", None) and not heads:
        names = [patterns] if isinstance(patterns, str) else list(patterns or [])
        raise InvalidArgumentError(
            f"train_head={names!r} matches no parameter of the model: name modules by their path in the PEFT model "
            "(e.g. 'base_model.model.classifier', or a pattern '*classifier*'), or pass train_head=None."
        )
    return keep | heads


def peft_configs(model: nn.Module) -> dict:
    """{adapter name: its PEFT config} of a PeftModel or tuner model ({} for anything else)."""
    configs = getattr(model, "peft_config", None)
    if isinstance(configs, dict):
        return configs
    base = getattr(model, "base_model", None)
    return getattr(base, "peft_config", None) or {}


def data_free_init(init) -> bool:
    if isinstance(init, bool):
        return True
    return isinstance(init, str) and (init in DATA_FREE_INITS or init.startswith("pissa"))  # PiSSA: SVD of W


def data_driven_inits(model: nn.Module) -> dict[str, str]:
    """{adapter: why} for every LoRA adapter anywhere in ``model`` (nested PEFT models and adapters
    added to submodules included) whose initialisation is not known to be data-free (EVA, CorDA,
    LoRA-GA, or one dpzoo does not know), except those :func:`declare_public_init` declared computed
    on public data."""
    if loaded_peft() is None:
        return {}
    public = getattr(model, PUBLIC_INIT_ATTR, {})
    out = {}
    for m in model.modules():
        for name, config in peft_configs(m).items():
            init = getattr(config, "init_lora_weights", True)
            if data_free_init(init) or name in public:
                continue
            key = init.lower() if isinstance(init, str) else init
            out[name] = f"{init}: {DATA_DRIVEN_INITS.get(key, 'an initialisation dpzoo does not know to be data-free')}"
    return out


def declare_public_init(model: nn.Module, adapter: str = "default", source: str = "") -> None:
    """State that ``adapter``'s data-driven initialisation (EVA, CorDA) was computed on public data,
    not on the private training set: dpzoo then trains it, and the privacy metadata records the
    statement (``public_statistics``) as an assumption outside ε. ``source`` names the public data."""
    if not isinstance(source, str) or not source.strip():
        raise InvalidArgumentError(
            "declare_public_init needs source='...': name the public data the initialisation was computed on "
            "(it goes into the privacy metadata)."
        )
    configs = {n: c for m in model.modules() for n, c in peft_configs(m).items()}
    if adapter not in configs:
        raise InvalidArgumentError(
            f"declare_public_init: no adapter {adapter!r} (adapters: {', '.join(configs) or 'none'})."
        )
    public = dict(getattr(model, PUBLIC_INIT_ATTR, {}))
    public[adapter] = (
        f"LoRA adapter {adapter!r} initialised ({configs[adapter].init_lora_weights}) on public data: {source.strip()}"
    )
    object.__setattr__(model, PUBLIC_INIT_ATTR, public)  # a plain attribute, not a submodule
