"""DP-LoRA with PEFT: wrap a model in LoRA adapters that dpzoo clips exactly, and name the set
``mode="lora"`` trains.

LoRA (Hu et al., ICLR 2022, §4.1) adds ``(α/r)·B A x`` beside a frozen weight; DP-LoRA (Yu et
al., "Differentially Private Fine-tuning of Language Models", ICLR 2022) trains only ``A``, ``B``
and a task head with DP-SGD. PEFT's ``lora.Linear`` and ``lora.Conv*d`` compute
``lora_B(lora_A(dropout(x)))`` with plain ``nn.Linear`` / ``nn.Conv*d`` modules, so dpzoo's
Linear and convolution rules see each adapter's real input (the dropout mask of the step
included) and its per-sample gradients are exact in every mode; the frozen ``base_layer``
(``nn.Linear``, GPT-2's ``Conv1D`` under ``fan_in_fan_out``) needs a rule only for a trained bias
(LoRA + DP-BiTFiT: PEFT's ``bias="all"`` or ``"lora_only"``). What dpzoo cannot clip is refused by
name (:func:`unsupported_lora_layers`): LoRA on embeddings (``lora.Embedding`` uses its
``lora_embedding_A/B`` functionally), LoRA variants computing with the adapter weights outside the
adapters' forward (DoRA, ...), ``lora.MultiheadAttention``, ``lora.ParamWrapper``, PEFT's trainable
tokens.

    model = dp_lora(dpzoo.load("bert-base", weights=DIR, num_classes=2), r=8, alpha=16)
    model, opt, loader = dpzoo.PrivacyEngine().make_private(module=model, ..., mode="lora")

peft is optional (``pip install 'dpzoo[peft]'``) and imported only when used: a model can only be
a PEFT model once peft is imported, so the predicates answer False without importing it.
"""

from __future__ import annotations

import numbers
from typing import Any, Iterable

from torch import nn
from transformers.pytorch_utils import Conv1D

from ..errors import InvalidArgumentError, UnsupportedModuleError
from ..grad_norms.plan import plan_model
from ..privacy.bitfit import default_head
from .peft_layers import (
    DATA_DRIVEN_INITS,
    REFUSED_OPTIONS,
    data_driven_inits,
    data_free_init,
    declare_public_init,
    import_peft,
    inactive_parameters,
    is_peft_model,
    lora_layers,
    lora_parameters,
    lora_trainable,
    train_head_patterns,
    unsupported_lora_layers,
    wrapped_model,
)

__all__ = [
    "dp_lora",
    "is_peft_model",
    "wrapped_model",
    "lora_layers",
    "lora_parameters",
    "lora_trainable",
    "unsupported_lora_layers",
    "inactive_parameters",
    "train_head_patterns",
    "default_target_modules",
    "declare_public_init",
    "data_driven_inits",
]

# base layers whose PEFT LoRA layer runs its adapters as plain nn.Linear / nn.Conv*d modules
_TARGET_TYPES = (nn.Linear, Conv1D, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def default_target_modules(model: nn.Module) -> list[str]:
    """The modules :func:`dp_lora` adapts when ``target_modules`` is None: the attention
    projections LoRA adapts (W_q and W_v, Hu et al. §4.2 and §7.1; PEFT's defaults per Hugging Face
    model type: GPT-2's fused ``c_attn``, LLaMA's ``q_proj``/``v_proj``, BERT's ``query``/``value``),
    timm ViTs' fused ``qkv``. Other architectures: :class:`~dpzoo.errors.InvalidArgumentError`."""
    defaults = import_peft().utils.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in defaults:
        return list(defaults[model_type])
    if any(n.endswith("attn.qkv") and isinstance(m, nn.Linear) for n, m in model.named_modules()):
        return ["qkv"]
    raise InvalidArgumentError(
        f"dp_lora has no default target modules for {type(model).__name__}: pass target_modules=[...] (names of its "
        "nn.Linear / Conv layers, e.g. the attention projections) or target_modules='all-linear'."
    )


def _task_type(model: nn.Module) -> str | None:
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "CAUSAL_LM"
    if name.endswith("ForSequenceClassification"):
        return "SEQ_CLS"
    if name.endswith("ForTokenClassification"):
        return "TOKEN_CLS"
    return None


def _check_targets(model: nn.Module, config) -> None:
    """Refuse, before PEFT changes the model, a target whose LoRA layer dpzoo cannot clip."""
    if isinstance(config.target_modules, str) and config.target_modules.lower() == "all-linear":
        return  # PEFT adapts nn.Linear / Conv1D layers only
    from peft.tuners.tuners_utils import check_target_module_exists

    bad = [
        f"{n} ({type(m).__name__})"
        for n, m in model.named_modules()
        if n and check_target_module_exists(config, n) and not isinstance(m, _TARGET_TYPES)
    ]
    if bad:
        raise UnsupportedModuleError(
            f"dp_lora: target module(s) {', '.join(bad[:6])} are not nn.Linear, Conv1D or nn.Conv*d; their LoRA "
            "layers (e.g. lora.Embedding, which uses lora_embedding_A/B functionally) have no per-sample rule in "
            "dpzoo. Leave them out of target_modules (train an embedding with mode='auto' instead)."
        )


def dp_lora(
    model: nn.Module,
    r: int = 8,
    alpha: float = 16,
    target_modules: Iterable[str] | str | None = None,
    *,
    dropout: float = 0.0,
    bias: str = "none",
    modules_to_save: Iterable[str] | str | None = "auto",
    task_type: str | None = "auto",
    adapter_name: str = "default",
    public_init: str | None = None,
    **lora_kwargs: Any,
) -> nn.Module:
    """``peft.get_peft_model(model, LoraConfig(...))`` with defaults for dpzoo's zoo, checked to be
    clippable: returns the PEFT model, whose LoRA adapters (and head) are the trainable parameters,
    ready for ``dpzoo.PrivacyEngine().make_private(..., mode="lora")`` (or ``"auto"``).

    ``r``, ``alpha`` (``lora_alpha``; the update is scaled by α/r), ``dropout`` (``lora_dropout``:
    exact per sample, the adapters see the dropped input) and ``bias`` (``"all"``: LoRA + DP-BiTFiT;
    ``"lora_only"``) are PEFT's. ``target_modules``: None picks :func:`default_target_modules`.
    ``modules_to_save="auto"``: the classification head (``classifier``, ``head``, ...) if the model
    has one, trained in full beside the adapters. ``task_type="auto"``: ``CAUSAL_LM`` /
    ``SEQ_CLS`` / ``TOKEN_CLS`` from a Hugging Face class name. Other keywords go to ``LoraConfig``
    (``use_rslora``, ``init_lora_weights``, ``layers_to_transform``, ``exclude_modules``, ...).
    Refused: embeddings or other non-linear layers as targets, DoRA, trainable tokens, bare-parameter
    targets (their adapters are used functionally; dpzoo would have to refuse them at attach), and
    data-driven initialisations (``init_lora_weights="eva"`` or ``"corda"``: computed on the private
    data they release a statistic of it outside ε) unless ``public_init`` names the public data they
    are computed on (recorded in the privacy metadata, :func:`declare_public_init`).
    """
    peft = import_peft()
    if is_peft_model(model):
        raise InvalidArgumentError(
            "dp_lora: the model is a PEFT model already; add an adapter with PEFT's model.add_adapter(...)."
        )
    if not isinstance(r, numbers.Integral) or isinstance(r, bool) or r < 1:
        raise InvalidArgumentError(f"dp_lora: r (the LoRA rank) must be a positive integer, got {r!r}.")
    if not isinstance(alpha, numbers.Real) or isinstance(alpha, bool) or not alpha > 0:
        raise InvalidArgumentError(f"dp_lora: alpha must be a number > 0 (the update is scaled by α/r), got {alpha!r}.")
    if not isinstance(dropout, numbers.Real) or not 0 <= dropout < 1:
        raise InvalidArgumentError(f"dp_lora: dropout must be in [0, 1), got {dropout!r}.")
    if bias not in ("none", "all", "lora_only"):
        raise InvalidArgumentError(
            f"dp_lora: bias must be 'none', 'all' (LoRA + DP-BiTFiT) or 'lora_only', got {bias!r}."
        )
    for option, why in REFUSED_OPTIONS.items():
        if lora_kwargs.get(option):
            raise UnsupportedModuleError(f"dp_lora: {option} is refused: {why}, which dpzoo cannot clip per sample.")
    init = lora_kwargs.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() == "mica":
        raise UnsupportedModuleError(
            "dp_lora: init_lora_weights='mica' is refused: MiCA is computed from the base weights alone (data-free), "
            "but it runs as a PEFT LoRA variant (lora_B frozen, its own forward) that dpzoo has no per-sample rule for."
        )
    data_driven = not data_free_init(init)
    if data_driven and public_init is None:
        why = DATA_DRIVEN_INITS.get(init.lower() if isinstance(init, str) else init, "not known to be data-free")
        raise UnsupportedModuleError(
            f"dp_lora: init_lora_weights={init!r} is refused: {why}, a statistic of the private data released outside "
            "ε. Use the default initialisation, or pass public_init='<the public data it is computed on>'."
        )
    if public_init is not None and not data_driven:
        raise InvalidArgumentError(
            "dp_lora: public_init applies to a data-driven init_lora_weights ('eva', 'corda', 'lora_ga') only."
        )
    heads = default_head(model) if modules_to_save == "auto" else modules_to_save
    heads = [heads] if isinstance(heads, str) else list(heads or [])
    config = peft.LoraConfig(
        r=int(r),
        lora_alpha=alpha,
        target_modules=default_target_modules(model) if target_modules is None else target_modules,
        lora_dropout=float(dropout),
        bias=bias,
        modules_to_save=heads or None,
        task_type=_task_type(model) if task_type == "auto" else task_type,
        **lora_kwargs,
    )
    _check_targets(model, config)
    wrapped = peft.get_peft_model(model, config, adapter_name=adapter_name)
    bad = unsupported_lora_layers(wrapped)
    if bad:
        wrapped.unload()  # puts the original modules back into the user's model
        raise UnsupportedModuleError(f"dp_lora: LoRA layer(s) dpzoo cannot clip per sample: {'; '.join(bad[:4])}.")
    dead = inactive_parameters(wrapped)  # e.g. the original of the head under bias="all": never run
    for p in wrapped.parameters():
        if id(p) in dead:
            p.requires_grad_(False)
    plan_model(wrapped)  # every trainable parameter has a per-sample rule, or the error names it
    if public_init is not None:
        declare_public_init(wrapped, adapter_name, public_init)
    return wrapped
