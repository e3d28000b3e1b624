"""Opacus adapter: dpzoo's per-sample rules as Opacus grad samplers and norm samplers.

Opacus looks samplers up by exact module type and, without one, falls back to functorch
(``vmap``), which is slow and fails on modules with buffers. :func:`register_opacus_rules`
registers dpzoo's rule for every module type Opacus lacks: dpzoo's RMSNorm, transformers'
Conv1D (GPT-2), timm's Conv2dSame, GroupNormAct and LayerScale, LLaMA's RMSNorm; and, for
ghost mode, a norm sampler for every layer family Opacus only instantiates (Conv, norms). It also
**replaces** Opacus' own ``nn.Embedding`` samplers (globally, for that process), which are wrong
or fail on what dpzoo's sequence models do: the grad sampler ignores ``padding_idx`` (it gives
the padding row the padding positions' gradient, which torch zeroes, inflating every per-sample
norm that has padding), and the ghost norm sampler calls ``view`` on the ids, which fails on
per-sample position ids made by ``expand``. Both were found by comparing Opacus' DP step with
the brute-force reference (tests/test_opacus_engine.py).
:func:`make_private` registers them and calls ``PrivacyEngine.make_private``; where Opacus
cannot do something (ghost clipping with tied embeddings), it says so and points to dpzoo's
own hooks, which handle ties exactly (Phantom Clipping).

Needs the optional extra: ``pip install "dpzoo[opacus]"``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import MissingDependencyError, UnsupportedModuleError
from ..grad_norms import reps as R
from ..grad_norms import rules  # noqa: F401  (registers the built-in rules in RULES)
from ..grad_norms.param_grad import ParamGrad
from ..grad_norms.registry import RULES, find_rule
from ..live_ref import LiveRef
from ..privacy.carried import adapter_statements, refuse_shared_config, refuse_weights_of_unknown_origin
from ..privacy.spending import SpendingLink
from ..surgery.tied import find_tied_parameters

__all__ = ["register_opacus_rules", "make_private", "check_opacus_compatible", "link_opacus_spending", "OpacusSpending"]

_REPLACE = (nn.Embedding,)  # Opacus' samplers for these are wrong with padding_idx / strided ids


def _opacus():
    try:
        import opacus  # noqa: F401
        from opacus.grad_sample import GradSampleModule
        from opacus.grad_sample.grad_sample_module_fast_gradient_clipping import (
            GradSampleModuleFastGradientClipping,
        )
    except ImportError as e:  # pragma: no cover - exercised without the extra
        raise MissingDependencyError(
            "The Opacus engine needs Opacus, which is not installed: pip install 'dpzoo[opacus]'."
        ) from e
    return GradSampleModule, GradSampleModuleFastGradientClipping


def _reps(layer: nn.Module, activations, backprops) -> dict[nn.Parameter, R.Rep]:
    rule = find_rule(layer)
    params = {n for n, p in layer.named_parameters(recurse=False) if p.requires_grad}
    acts = tuple(activations) if activations is not None else None
    reps = rule.fn(layer, acts, backprops, params)
    return {getattr(layer, n): rep for n, rep in reps.items()}


def dpzoo_grad_sampler(layer, activations, backprops):
    """Opacus grad sampler: per-sample gradients (B, *shape) from dpzoo's rule."""
    return {p: R.instantiate(rep).to(p.dtype) for p, rep in _reps(layer, activations, backprops).items()}


def dpzoo_norm_sampler(layer, activations, backprops):
    """Opacus norm sampler: per-sample gradient norms Tensor[B] (ghost or instantiated, BK rule), a
    ghost norm under dpzoo's floating-point guard (:mod:`dpzoo.grad_norms.float_guard`)."""
    return {p: ParamGrad([rep]).sq_norm().sqrt() for p, rep in _reps(layer, activations, backprops).items()}


def register_opacus_rules() -> list[type]:
    """Register dpzoo's rules with Opacus for every module type it lacks. Idempotent.

    Returns the module types registered by this call.
    """
    gsm, fgc = _opacus()
    added = []
    for module_type in RULES:
        if module_type in _REPLACE or module_type not in gsm.GRAD_SAMPLERS:
            gsm.GRAD_SAMPLERS[module_type] = dpzoo_grad_sampler
            added.append(module_type)
        if module_type in _REPLACE or module_type not in fgc.NORM_SAMPLERS:
            fgc.NORM_SAMPLERS[module_type] = dpzoo_norm_sampler
    return added


def check_opacus_compatible(module: nn.Module, grad_sample_mode: str = "hooks") -> None:
    """Raise :class:`~dpzoo.UnsupportedModuleError` where Opacus would fail or be wrong."""
    ties = [
        g
        for g in find_tied_parameters(module)
        if any(p.requires_grad for n, p in module.named_parameters() if n in g.names)
    ]
    if "ghost" in grad_sample_mode and ties:
        names = "; ".join(" = ".join(g.names) for g in ties)
        raise UnsupportedModuleError(
            f"Opacus' ghost clipping does not support tied parameters ({names}): it would need the "
            "cross term between the two uses. Use dpzoo's hooks, which compute it exactly "
            "(Phantom Clipping): dpzoo.attach_norm_hooks(model), or Opacus' grad_sample_mode='hooks'."
        )


def make_private(privacy_engine, *, module: nn.Module, grad_sample_mode: str = "hooks", **kwargs: Any):
    """``privacy_engine.make_private(...)`` with dpzoo's rules registered and checked first; its
    Poisson loader counts the batches it draws (:func:`dpzoo.integrations.opacus.count_batches`),
    so that ``privacy_metadata`` can tell the steps trained on them, and the model carries Opacus'
    spending (:class:`OpacusSpending`), so a later dpzoo engine on it composes that spending."""
    from ..integrations.opacus import count_batches, is_poisson_loader

    check_opacus_compatible(module, grad_sample_mode)
    refuse_shared_config(module)  # its record would replace another model's
    adapter_statements(module)  # a statement that is not a record or {} is refused by name
    refuse_weights_of_unknown_origin(module)  # as dpzoo's engine: weights no record accounts for
    register_opacus_rules()
    made = privacy_engine.make_private(module=module, grad_sample_mode=grad_sample_mode, **kwargs)
    if is_poisson_loader(made[-1]):  # (module, optimizer, [criterion,] data_loader)
        count_batches(made[-1], privacy_engine)
    link_opacus_spending(module, privacy_engine.accountant)
    return made


class OpacusSpending(SpendingLink):
    """What Opacus' accountant recorded for a model, as dpzoo's spending link: a dpzoo engine on
    the same model later (``to_standard_module()``, a layer reused) composes it; an earlier link
    on the model comes first."""

    def __init__(self, opacus_accountant, earlier: SpendingLink | None = None):
        self.opacus, self.earlier = opacus_accountant, earlier

    def relink(self, accountant) -> None:
        """A dpzoo engine trains the module now: its run composed Opacus' (in place, for the copies that follow)."""
        self.opacus, self.earlier = None, SpendingLink(accountant)


def link_opacus_spending(module: nn.Module, opacus_accountant) -> None:
    """Put an :class:`OpacusSpending` on ``module`` and every layer it trains, and a live record on
    its Hugging Face configs; what the model carried before is kept on ``opacus_accountant`` too
    (``dpzoo_earlier_parts``), so ``privacy_metadata`` composes it into the saved record, or, for
    data stated disjoint (``model.dpzoo_privacy = {}``, cleared: it was for this run), keeps it
    beside (``disjoint_spending``)."""
    from ..integrations.opacus import ACCOUNTANT_NAMES
    from ..integrations.peft_statements import (
        clear_marks,
        disjoint_statement,
        unknown_origin_note,
        unknown_weights,
        use,
    )
    from ..privacy.carried import carried_parts, write_live_records
    from ..privacy.provenance import run_id

    own = run_id(opacus_accountant)  # a second make_private adds what the model carries now (Opacus' own steps aside)
    unknown = unknown_weights(module)  # before Opacus' link covers them: the statements that let this run on
    found = [part for part in carried_parts(module, statements=False) if part[0] != own]
    opacus_accountant.dpzoo_earlier_parts = list(getattr(opacus_accountant, "dpzoo_earlier_parts", [])) + found
    stated = list(getattr(opacus_accountant, "dpzoo_stated_parts", []))  # records stated for adapters: always composed
    opacus_accountant.dpzoo_stated_parts = stated + [p for p in adapter_statements(module) if p not in stated]
    disjoint = disjoint_statement(module)
    if disjoint:  # for this run: a copy made before it shares the object
        opacus_accountant.dpzoo_earlier_disjoint = True
        use(module.__dict__.pop("dpzoo_privacy"))
    for m in module.modules():
        if m is not module and not any(p.requires_grad for p in m.parameters(recurse=False)):
            continue
        m.__dict__.pop("dpzoo_loaded_without_record", None)  # this run was allowed on it: statements cover it
        earlier = getattr(m, "dpzoo_spending", None)
        if not (isinstance(earlier, OpacusSpending) and earlier.opacus is opacus_accountant):
            object.__setattr__(m, "dpzoo_spending", OpacusSpending(opacus_accountant, earlier))
    clear_marks(module, unknown, disjoint)  # statements used; weights stated disjoint stay of unknown origin
    if unknown_origin_note(module):  # the record privacy_metadata writes says so
        opacus_accountant.dpzoo_unknown_origin = True
    opacus_accountant.dpzoo_module = LiveRef(module)  # a checkpoint loaded later marks the model it loads into
    write_live_records(module, ACCOUNTANT_NAMES.get(opacus_accountant.mechanism(), "prv"))
