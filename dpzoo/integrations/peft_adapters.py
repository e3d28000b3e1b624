"""What dpzoo knows about one PEFT adapter in one tuner layer: where its tensors live, the spending
link a dpzoo engine left on them, whether a resume restored them, whether they move the weights.

A tuner layer keeps each adapter's tensors in per-adapter containers (``lora_A``, ``lora_B``,
``hada_w1_a``, ``ia3_l``, ...: ``nn.ModuleDict`` / ``nn.ParameterDict`` keyed by adapter name);
:func:`holders` are the modules that own them, which is where :func:`dpzoo.privacy.carried.link_spending`
puts an engine's link. :mod:`dpzoo.integrations.peft_merge` (merges, loads, combinations) and
:func:`trained_adapters` (adapters trained elsewhere) read and
write this state through these functions only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "trained_adapters",
    "PARTLY_UNKNOWN",
    "entry",
    "holders",
    "has_adapter",
    "spending_link",
    "set_link",
    "flag_partly_unknown",
    "partly_unknown",
    "flag_loaded_unknown",
    "LOADED_OTHER",
    "loaded_unknown",
    "is_linked",
    "forget_adapter",
    "mark_resumed",
    "composed",
    "fingerprint",
    "changes_weights",
    "other_tuners_trained",
]

PARTLY_UNKNOWN = "dpzoo_partly_unknown"  # an adapter combined from linked and unknown ones (add_weighted_adapter)
LOADED_UNKNOWN = "dpzoo_loaded_unknown"  # an adapter loaded without a record: trained elsewhere, whatever its init
LOADED_OTHER = "dpzoo_loaded_without_record"  # a modules_to_save copy or bias PEFT loaded without a record


def entry(container, adapter: str):
    """``container[adapter]`` for PEFT's per-adapter ModuleDict / ParameterDict, else None."""
    keys = getattr(container, "keys", None)
    return container[adapter] if callable(keys) and adapter in keys() else None


def holders(layer, adapter: str) -> Iterator[Any]:
    """The modules owning ``adapter``'s tensors in ``layer`` (a ParameterDict owns its own)."""
    for container in layer.children():
        found = entry(container, adapter)
        if found is not None:
            yield from found.modules() if hasattr(found, "modules") else [container]


def has_adapter(layer, adapter) -> bool:
    return adapter is not None and any(True for _ in holders(layer, adapter))


def spending_link(layer, adapter: str):
    """The spending link a dpzoo engine left on the adapter's tensors, if it trained them."""
    for m in holders(layer, adapter):
        link = getattr(m, "dpzoo_spending", None)
        if getattr(link, "history", None):
            return link
    return None


def set_link(layer, adapter: str, link) -> None:
    for m in holders(layer, adapter):
        object.__setattr__(m, "dpzoo_spending", link)


def flag_partly_unknown(layer, adapter: str) -> None:
    for m in holders(layer, adapter):
        object.__setattr__(m, PARTLY_UNKNOWN, True)


def partly_unknown(layer, adapter: str) -> bool:
    return any(getattr(m, PARTLY_UNKNOWN, False) for m in holders(layer, adapter))


def flag_loaded_unknown(model, adapter: str, only: set[int] | None = None) -> None:
    """``adapter`` was loaded into ``model`` without a record: its tensors come from elsewhere,
    whatever they are (an initialisation that is not zero cannot tell trained from fresh)."""
    for layer in model.modules():
        for m in holders(layer, adapter):
            if only is None or id(m) in only:
                object.__setattr__(m, LOADED_UNKNOWN, True)


def loaded_unknown(layer, adapter: str) -> bool:
    return any(m.__dict__.get(LOADED_UNKNOWN, False) for m in holders(layer, adapter))


def is_linked(layer, adapter: str) -> bool:
    """Whether a dpzoo engine trained ``adapter`` here, or a DPTrainer resume restored it, and no
    part of it is of unknown origin."""
    if partly_unknown(layer, adapter):
        return False
    return spending_link(layer, adapter) is not None or any(
        getattr(m, "dpzoo_resumed_from", None) for m in holders(layer, adapter)
    )


def forget_adapter(model, adapter, only: set[int] | None = None) -> None:
    """The adapter's tensors now come from elsewhere (loaded, hot-swapped): no engine trained them,
    no resume restored them (``only``: the ids of the modules whose tensors a load replaced)."""
    for layer in model.modules() if model is not None and adapter is not None else ():
        for m in holders(layer, adapter):
            if only is not None and id(m) not in only:
                continue
            m.__dict__.pop("dpzoo_spending", None)
            m.__dict__.pop("dpzoo_resumed_from", None)
            m.__dict__.pop(LOADED_UNKNOWN, None)


def mark_resumed(model, checkpoint: str) -> None:
    """The active adapters' tensors of ``model`` were restored from ``checkpoint`` by a DPTrainer
    resume, whose optimizer state restores their spending: not of unknown origin. Other adapters
    (loaded separately, inactive) stay as they were."""
    from .peft_layers import is_peft_model

    if not is_peft_model(model):  # a plain transformers model's active_adapters() needs its own PEFT setup
        return
    adapters = getattr(model, "active_adapters", None)
    if callable(adapters):
        adapters = adapters()
    for layer in model.modules() if adapters else ():
        for adapter in adapters:
            for m in holders(layer, adapter):
                object.__setattr__(m, "dpzoo_resumed_from", checkpoint)


def composed(links: list):
    """One link for several: itself when they are one engine's, else their histories composed."""
    from ..privacy.spending import ComposedSpending

    distinct = list({id(link): link for link in links}.values())
    return distinct[0] if len(distinct) == 1 else ComposedSpending(distinct)


def fingerprint(layer, adapter: str) -> tuple[float, float] | None:
    """Two float64 sums of the adapter's ΔW (None where it cannot be formed)."""
    import torch

    try:
        with torch.no_grad():
            delta = layer.get_delta_weight(adapter).double()
    except Exception:  # noqa: BLE001 - no ΔW for this family: never taken for an unmerge
        return None
    return float(delta.sum()), float(delta.abs().sum())


def changes_weights(layer, adapter: str) -> bool:
    """Whether the adapter's ΔW is not exactly zero (a tuner family without ``get_delta_weight``,
    e.g. IA³'s scaling, is taken to change the weights)."""
    import torch

    delta = getattr(layer, "get_delta_weight", None)
    if not callable(delta):
        return True
    bias = getattr(entry(getattr(layer, "lora_B", None), adapter), "bias", None)
    if bias is not None and bool(bias.detach().ne(0).any()):  # LoRA's lora_bias: merged into the base bias
        return True
    try:
        with torch.no_grad():
            return bool(delta(adapter).ne(0).any())
    except Exception:  # noqa: BLE001 - a family whose ΔW cannot be formed here: assume it changed
        return True


def other_tuners_trained(model) -> list[tuple[str, str]]:
    """(layer, adapter) for adapters of PEFT's other tuner families (LoHa, LoKr, IA³, ...) that move
    the weights and that no dpzoo engine trained or resume restored: trained elsewhere."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from torch import nn

    out = []
    for name, layer in model.named_modules():
        if not isinstance(layer, BaseTunerLayer) or isinstance(layer, LoraLayer) or not isinstance(layer, nn.Module):
            continue
        per_adapter = (c for c in layer.children() if isinstance(c, (nn.ModuleDict, nn.ParameterDict)))
        for adapter in sorted({k for c in per_adapter for k in c.keys()}):
            if not is_linked(layer, adapter) and changes_weights(layer, adapter):
                out.append((name, adapter))
    return out


ZERO_B_INITS = (True, "gaussian")  # LoRA inits whose lora_B starts at exactly zero


def trained_adapters(model: nn.Module) -> list[tuple[str, str]]:
    """(layer, adapter) for adapters whose initialisation sets a factor to zero (lora_B; an
    Embedding's lora_embedding_A; AdaLoRA's lora_E, its lora_B starts random) but whose factor is
    not zero now, and that no dpzoo engine trained here (no spending link): trained before,
    elsewhere (loaded with ``PeftModel.from_pretrained`` or ``load_adapter``); adapters of any
    initialisation loaded without a record that move the weights; and adapters of PEFT's other
    tuner families that move the weights with no link."""
    from torch import nn  # not at module level: `import dpzoo` (peft_merge) stays torch-free

    from .peft_layers import loaded_peft, lora_layers, peft_configs

    if loaded_peft() is None:
        return []
    zero_init = {  # adapter name -> the factors that start at zero
        n: ("lora_E",) if type(c).__name__ == "AdaLoraConfig" else ("lora_B", "lora_embedding_A")
        for m in model.modules()
        for n, c in peft_configs(m).items()
        if getattr(c, "init_lora_weights", True) in ZERO_B_INITS
    }
    found = []
    for layer_name, layer in lora_layers(model).items():
        for name, attrs in zero_init.items():
            for attr in attrs:
                container = getattr(layer, attr, None)
                if not isinstance(container, (nn.ModuleDict, nn.ParameterDict)) or name not in container:
                    continue
                tensors = container[name].parameters() if isinstance(container, nn.ModuleDict) else [container[name]]
                # not linked: no dpzoo engine trained it here, no DPTrainer resume restored it
                if not is_linked(layer, name) and any(bool(t.detach().ne(0).any()) for t in tensors):
                    if (layer_name, name) not in found:
                        found.append((layer_name, name))
    for layer_name, layer in lora_layers(model).items():  # loaded without a record, whatever the init
        for name in getattr(layer, "lora_A", {}).keys():
            unknown = loaded_unknown(layer, name) and not is_linked(layer, name) and changes_weights(layer, name)
            if unknown and (layer_name, name) not in found:
                found.append((layer_name, name))
    found += [f for f in other_tuners_trained(model) if f not in found]
    return found
