"""A model trained with Opacus' ``PrivacyEngine``, saved by ``dpzoo.save``: the zoo model taken
out of Opacus' wrapper, and the privacy that Opacus' accountant recorded for it.

    model, optimizer, loader = opacus_engine.make_private(module=dpzoo.load(...), ...)
    ...                                                        # train with Opacus
    dpzoo.save(model, "runs/m", privacy=privacy_metadata(opacus_engine, delta=1e-5, optimizer=optimizer))
    dpzoo.load("runs/m")                                       # the zoo model, Opacus' ε in its metadata

:func:`unwrap` takes the model out of ``GradSampleModule`` / ``GradSampleModuleFastGradientClipping`` (and
Opacus' or torch's DDP wrapper inside it) without removing Opacus' hooks, so training can go on after saving.
:func:`privacy_metadata` reads only what Opacus records: ε from the engine's own accountant at the ``delta``
the user names (Opacus keeps no δ), the (σ, q, steps) history, and the clipping bound if the optimizer is
given. It refuses what would make the saved claim false or unusable: a run whose batches were not Poisson-
sampled (Opacus' ``poisson_sampling=False``: its accountant still reports the Poisson-subsampled ε, which does
not hold for fixed-size shuffled batches; told from the ``data_loader`` make_private returned, refused when
none is given), a run that took more steps than that loader drew batches (a loop over another loader: the
original, shuffled one; told by :func:`count_batches`, which ``dpzoo.engines.opacus.make_private`` applies,
and refused for a loader that does not count; the engine's accountant carries the count and the runs its
history holds through Opacus' ``save_checkpoint`` / ``load_checkpoint``, so a resumed run is counted, and the
checkpoint's run once), Opacus' ``"gdp"`` accountant (an approximation, not an upper bound), a history with
several sample rates (the metadata holds one), an engine that took no step. ``dpzoo.save`` refuses an Opacus-
wrapped model without ``privacy=``, so a DP-trained model never silently loses its spend (a later dpzoo engine
composes after it); ``dpzoo.save(unwrap(model), dir)`` saves it without.

Needs Opacus only for :func:`privacy_metadata`; importing this module does not import Opacus.
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any, Mapping

from torch import nn

from ..errors import AccountingError, MissingDependencyError, PrivacyUsageError, SaveError
from ..live_ref import LiveRef
from ..privacy.accounting.accountant import Accountant, accountant_spec
from ..privacy.metadata import check_delta
from ..privacy.provenance import distinct_histories, new_run, run_id, segments_of, steps_of

__all__ = ["unwrap", "unwrap_for_save", "privacy_metadata", "count_batches", "is_poisson_loader", "ACCOUNTANT_NAMES"]

# Opacus' accountant mechanism -> dpzoo's name for the same accountant
ACCOUNTANT_NAMES = {"rdp": "opacus-rdp", "prv": "prv", "gdp": "gdp"}


def _wrapper_types() -> tuple[type, ...]:
    """Opacus' model wrappers, if Opacus is imported (if it is not, no object can be one)."""
    gsm = sys.modules.get("opacus.grad_sample.gsm_base")
    return (gsm.AbstractGradSampleModule,) if gsm is not None else ()


def _ddp_types() -> tuple[type, ...]:
    dist = sys.modules.get("opacus.distributed")
    extra = (dist.DifferentiallyPrivateDistributedDataParallel,) if dist is not None else ()
    return (nn.parallel.DistributedDataParallel, *extra)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside Opacus' ``GradSampleModule`` (any of its kinds), and inside a DDP
    wrapper under it; ``model`` itself if Opacus did not wrap it. Opacus' hooks stay on (unlike
    ``to_standard_module()``, which removes them): the wrapper keeps training."""
    wrappers = _wrapper_types()
    if not wrappers or not isinstance(model, wrappers):
        return model
    children = list(model.children())
    if len(children) != 1:
        raise SaveError(
            f"{type(model).__name__} holds {len(children)} modules, not the one Opacus wraps: pass the zoo model "
            "itself (model.to_standard_module())."
        )
    inner = children[0]
    while isinstance(inner, _ddp_types()):
        inner = inner.module
    return inner


def unwrap_for_save(model: nn.Module, privacy: Mapping[str, Any] | None) -> nn.Module:
    """What ``dpzoo.save`` writes for ``model``: :func:`unwrap`'s module. An Opacus-wrapped model
    saved without ``privacy`` is refused: its spend would be lost (and not composed later)."""
    inner = unwrap(model)
    if inner is not model and privacy is None:
        raise SaveError(
            f"This model is wrapped by Opacus ({type(model).__name__}), so it was trained with DP: pass "
            "privacy=dpzoo.integrations.opacus.privacy_metadata(opacus_engine, delta, data_loader=loader) to record its spend, or "
            "save dpzoo.integrations.opacus.unwrap(model) to save it without privacy metadata."
        )
    return inner


def _opacus_accountant_type() -> Any:  # Any: isinstance narrows nothing to `object`
    try:
        from opacus.accountants.accountant import IAccountant
    except ImportError as e:  # pragma: no cover - exercised without the extra
        raise MissingDependencyError(
            "Reading an Opacus engine's privacy needs Opacus, which is not installed: pip install 'dpzoo[opacus]'."
        ) from e
    return IAccountant


def _max_grad_norm(optimizer) -> float | None:
    """The fixed clipping bound of an Opacus DPOptimizer (None for adaptive clipping, whose
    bound moved during training)."""
    from opacus.optimizers import AdaClipDPOptimizer, DPOptimizer

    if not isinstance(optimizer, DPOptimizer):
        raise PrivacyUsageError(
            f"optimizer must be the Opacus DPOptimizer make_private returned, got {type(optimizer).__name__}."
        )
    value = getattr(optimizer, "max_grad_norm", None)
    if isinstance(optimizer, AdaClipDPOptimizer) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def _batch_samplers(data_loader) -> list:
    """The loader's batch sampler and the ones it wraps (``BatchMemoryManager``'s splitting sampler
    keeps the original as ``.sampler``)."""
    out, sampler = [], getattr(data_loader, "batch_sampler", None)
    for _ in range(3):
        if sampler is None:
            break
        out.append(sampler)
        sampler = getattr(sampler, "sampler", None)
    return out


def is_poisson_loader(data_loader) -> bool:
    """Whether ``data_loader`` draws Opacus' Poisson batches: a ``DPDataLoader``, or a loader whose
    batch sampler is Opacus' uniform-with-replacement sampler (possibly inside ``BatchMemoryManager``'s
    splitting sampler)."""
    samplers = sys.modules.get("opacus.utils.uniform_sampler")
    if samplers is None:
        return False
    poisson = (samplers.UniformWithReplacementSampler, samplers.DistributedUniformWithReplacementSampler)
    return any(isinstance(s, poisson) for s in _batch_samplers(data_loader))


_COUNTING: dict[type, type] = {}  # Opacus sampler or accountant type -> its counting subclass


def count_batches(data_loader, opacus_engine=None):
    """``data_loader`` (Opacus' Poisson loader, as its ``make_private`` returned it) made to count
    the batches it draws, in place, and returned: :func:`privacy_metadata` refuses a run that took
    more steps than its loader drew, since Opacus' ε holds only for the Poisson batches, and (with
    ``opacus_engine``, the engine that made it) a loader another engine made. The sampler stays
    an instance of its Opacus class (``BatchMemoryManager`` wraps it as before). Apply it before
    the first batch is drawn; ``dpzoo.engines.opacus.make_private`` does."""
    if not is_poisson_loader(data_loader):
        raise PrivacyUsageError(
            f"count_batches needs Opacus' Poisson loader (the one make_private returned with poisson_sampling=True), "
            f"got {type(data_loader).__name__}."
        )
    samplers = sys.modules["opacus.utils.uniform_sampler"]
    poisson = (samplers.UniformWithReplacementSampler, samplers.DistributedUniformWithReplacementSampler)
    sampler = next(s for s in _batch_samplers(data_loader) if isinstance(s, poisson))
    if not hasattr(sampler, "dpzoo_drawn"):
        sampler.__class__ = _counting_class(type(sampler))
        sampler.dpzoo_drawn = 0
    if opacus_engine is not None:
        accountant = getattr(opacus_engine, "accountant", None)
        sampler.dpzoo_accountant = LiveRef(accountant)
        if accountant is not None:
            _count_through_checkpoints(accountant)
    return data_loader


def _count_through_checkpoints(accountant) -> None:
    """Make ``accountant``'s ``state_dict`` (what Opacus' ``save_checkpoint`` stores) carry the
    batches its loaders drew and the runs its history holds, and its ``load_state_dict`` (Opacus'
    ``load_checkpoint``) restore them: a resumed run's steps are then all Poisson batches it can
    name, and its record names the checkpoint's run, so that run's saved model counts once."""
    if not getattr(type(accountant), "dpzoo_counting", False):
        accountant.__class__ = _counting_class(type(accountant))


def _state_dict(self, destination=None):
    state = super(type(self), self).state_dict(destination)
    key = run_id(self)
    history = [list(h) for h in self.history]
    state["dpzoo_drawn"] = int(getattr(self, "dpzoo_drawn", 0))
    state["dpzoo_runs"] = segments_of(key, getattr(self, "dpzoo_segments", None), history)
    state["dpzoo_earlier"] = [[k, seg, h] for k, seg, h in getattr(self, "dpzoo_earlier_parts", [])]  # the model's
    state["dpzoo_earlier_disjoint"] = bool(getattr(self, "dpzoo_earlier_disjoint", False))  # spending before Opacus
    state["dpzoo_stated"] = [[k, seg, h] for k, seg, h in getattr(self, "dpzoo_stated_parts", [])]
    state["dpzoo_unknown_origin"] = bool(getattr(self, "dpzoo_unknown_origin", False))
    return state


def _load_state_dict(self, state_dict):
    super(type(self), self).load_state_dict(state_dict)
    new_run(self)  # what it held before is gone from its history (and from the module's weights): another run
    # history replaced: so are its batches and runs (none known from a checkpoint dpzoo did not count)
    self.dpzoo_drawn = int(state_dict.get("dpzoo_drawn", 0))
    self.dpzoo_segments = [list(s) for s in state_dict.get("dpzoo_runs", [])]
    # what the checkpoint's model carried before Opacus, beside what this one did (its weights are the checkpoint's)
    stated = [tuple(p) for p in state_dict.get("dpzoo_stated", [])]
    self.dpzoo_stated_parts = list(getattr(self, "dpzoo_stated_parts", [])) + stated
    self.dpzoo_unknown_origin = bool(
        getattr(self, "dpzoo_unknown_origin", False) or state_dict.get("dpzoo_unknown_origin")
    )
    module = getattr(self, "dpzoo_module", lambda: None)()  # the model load_checkpoint loaded the weights into
    if state_dict.get("dpzoo_unknown_origin") and module is not None:
        from .peft_statements import mark_weights_unknown

        mark_weights_unknown(module)
    earlier = [tuple(p) for p in state_dict.get("dpzoo_earlier", [])]
    self.dpzoo_earlier_parts = list(getattr(self, "dpzoo_earlier_parts", [])) + earlier
    self.dpzoo_earlier_disjoint = bool(getattr(self, "dpzoo_earlier_disjoint", False)) and (
        not earlier or bool(state_dict.get("dpzoo_earlier_disjoint"))
    )


def __getattr__(name: str):
    """A counting class by name (an unpickler in a process that has not made it yet)."""
    if name.startswith("Counting"):
        import opacus.accountants as accountants
        import opacus.utils.uniform_sampler as samplers

        base = getattr(samplers, name[8:], None) or getattr(accountants, name[8:], None)
        if isinstance(base, type):
            return _counting_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _counting_class(base: type) -> type:
    """The subclass of an Opacus sampler (counts its batches) or accountant (carries the count
    through checkpoints), under a module-level name of its own so that its instances pickle."""
    if base not in _COUNTING:
        name = f"Counting{base.__name__}"
        body: dict[str, Any]
        if hasattr(base, "state_dict"):
            body = {"state_dict": _state_dict, "load_state_dict": _load_state_dict}
        else:
            body = {"__iter__": _counted_iter}
        _COUNTING[base] = type(
            name, (base,), {**body, "dpzoo_counting": True, "__module__": __name__, "__qualname__": name}
        )
        globals()[name] = _COUNTING[base]
    return _COUNTING[base]


def _counted_iter(self):
    owner = getattr(self, "dpzoo_accountant", None)
    for batch in super(type(self), self).__iter__():
        self.dpzoo_drawn += 1
        accountant = owner() if owner is not None else None
        if accountant is not None:  # all the loaders the engine made: a second make_private draws on
            accountant.dpzoo_drawn = getattr(accountant, "dpzoo_drawn", 0) + 1
        yield batch


def _drawn(data_loader) -> int | None:
    """Batches the loader's counting sampler drew so far; None if it does not count."""
    return next((s.dpzoo_drawn for s in _batch_samplers(data_loader) if hasattr(s, "dpzoo_drawn")), None)


def privacy_metadata(opacus_engine, delta: float, *, optimizer=None, data_loader=None) -> dict[str, Any]:
    """The privacy metadata ``dpzoo.save(..., privacy=...)`` records for a model that
    ``opacus_engine`` (Opacus' ``PrivacyEngine``) trained: ε at ``delta`` from the engine's own
    accountant (what ``opacus_engine.get_epsilon(delta)`` returns), its accountant under dpzoo's
    name (``"opacus-rdp"``, ``"prv"``), the steps and the sample rate from its history, the noise
    multiplier if it was one throughout, and the clipping bound if ``optimizer`` (Opacus'
    DPOptimizer) is given. ``data_loader``: the loader Opacus' ``make_private`` returned (or
    ``BatchMemoryManager``'s), required: the ε Opacus reports holds only for Poisson batches. Opacus'
    noise is secret only with ``secure_mode=True``; the metadata's ``noise`` says which. Refused
    (see the module docstring) where the record would be false."""
    accountant, name, history, steps, rates = _accountant_and_history(opacus_engine, delta)
    _check_loader(accountant, data_loader, steps)
    check_delta(float(delta), len(getattr(data_loader, "dataset", ())) or None)  # δ ≥ 1/N says nothing
    bound = _max_grad_norm(optimizer) if optimizer is not None else None  # checks it is Opacus' first
    sigmas = {s for s, _, _ in history}
    meta: dict[str, Any] = {
        "epsilon": float(accountant.get_epsilon(delta)),
        "delta": float(delta),
        "accountant": name,
        "steps": steps,
        "sample_rate": rates[0],
        "run_id": run_id(accountant),  # the run the model's OpacusSpending link stands for: counted once
        "history": [[s, q, n] for s, q, n in history],  # every (σ, q): a noise schedule composes too
    }
    resumed = [list(seg) for seg in getattr(accountant, "dpzoo_segments", None) or []]
    if resumed:  # the runs of the checkpoint it resumed from (Opacus' load_checkpoint)
        meta["composed_runs"] = resumed
    if len(sigmas) == 1:  # a noise schedule has no single σ: left out, so nothing composes a wrong one
        meta["noise_multiplier"] = sigmas.pop()
        if optimizer is not None and not math.isclose(optimizer.noise_multiplier, meta["noise_multiplier"]):
            raise PrivacyUsageError(
                f"The optimizer's noise multiplier {optimizer.noise_multiplier} is not the engine's "
                f"{meta['noise_multiplier']}: pass the optimizer this engine's make_private returned."
            )
    if bound is not None:
        meta["max_grad_norm"] = bound
    _compose_earlier(meta, accountant, name, history, resumed, float(delta), steps)
    if getattr(accountant, "dpzoo_unknown_origin", False):  # weights of unknown origin stated disjoint for this run
        from .peft_statements import UNKNOWN_ORIGIN

        meta["unknown_origin"] = UNKNOWN_ORIGIN
    secure = getattr(opacus_engine, "secure_mode", None)
    if secure is True:
        meta["noise"] = "secret (Opacus secure_mode=True: torchcsprng)"
    elif secure is False:
        meta["noise"] = "not secret: Opacus secure_mode=False draws noise from torch's pseudo-random generator"
    return meta


def _accountant_and_history(opacus_engine, delta) -> tuple[Any, str, list, int, list]:
    """(Opacus' accountant, dpzoo's name for it, its history, steps, one sample rate), checked."""
    accountant: Any = getattr(opacus_engine, "accountant", None)
    if not isinstance(accountant, _opacus_accountant_type()):
        raise PrivacyUsageError(
            f"opacus_engine must be Opacus' PrivacyEngine (with an Opacus accountant), got {type(opacus_engine).__name__}. "
            "For dpzoo's engine dpzoo.save records the metadata itself."
        )
    if not isinstance(delta, numbers.Real) or isinstance(delta, bool) or not 0 < delta < 1:
        raise AccountingError(f"delta must be in (0, 1), got {delta!r}: pass the δ of the guarantee, e.g. 1e-5.")
    mechanism = accountant.mechanism()
    name = ACCOUNTANT_NAMES.get(mechanism)
    if name is None:
        raise AccountingError(
            f"Opacus accountant {mechanism!r} ({type(accountant).__name__}) has no dpzoo counterpart: pass "
            f"privacy={{...}} to dpzoo.save yourself. Known: {', '.join(ACCOUNTANT_NAMES)}."
        )
    spec = accountant_spec(name)
    if not spec.upper_bound:
        raise AccountingError(
            f"Opacus' {mechanism!r} accountant is refused: {spec.caveat or 'its ε is not an upper bound'}. Recompute "
            "ε with an upper bound, e.g. dpzoo.privacy.Accountant('prv', opacus_engine.accountant.history), "
            "and pass privacy={...} to dpzoo.save."
        )
    history = [(float(s), float(q), int(n)) for s, q, n in accountant.history]
    steps = sum(n for _, _, n in history)
    if steps == 0:
        raise SaveError(
            "The Opacus engine took no step: there is no privacy spend to record. Save without privacy "
            "(dpzoo.save(dpzoo.integrations.opacus.unwrap(model), dir))."
        )
    rates = sorted({q for _, q, _ in history})
    if len(rates) > 1:
        raise SaveError(
            f"The Opacus engine's history has {len(rates)} sample rates ({', '.join(f'{q:.4g}' for q in rates)}); "
            "dpzoo's metadata records one. Pass privacy={...} to dpzoo.save yourself, with the largest rate."
        )
    return accountant, name, history, steps, rates


def _check_loader(accountant, data_loader, steps: int) -> None:
    """Refuse unless every step trained on a batch this engine's Poisson loader drew."""
    if data_loader is None:
        raise PrivacyUsageError(
            "privacy_metadata needs data_loader= (the loader Opacus' make_private returned): Opacus' ε holds only "
            "for Poisson-sampled batches, and only the loader tells whether they were."
        )
    if not is_poisson_loader(data_loader):
        raise PrivacyUsageError(
            f"The data loader ({type(data_loader).__name__}) does not draw Poisson batches (Opacus' "
            "make_private(poisson_sampling=False), or another loader): Opacus' accountant reports the ε of "
            "Poisson sampling, which does not hold for these batches. Train with poisson_sampling=True."
        )
    drawn = _drawn(data_loader)
    owner = next((s.dpzoo_accountant() for s in _batch_samplers(data_loader) if hasattr(s, "dpzoo_accountant")), None)
    if drawn is not None and owner is accountant:  # every counting loader this engine made
        drawn = max(drawn, getattr(accountant, "dpzoo_drawn", 0))
    if owner is not None and owner is not accountant:
        raise PrivacyUsageError(
            "This data loader was made by another Opacus engine's make_private: pass the loader this engine returned."
        )
    if drawn is None:
        raise PrivacyUsageError(
            "The data loader does not count the batches it drew, so nothing tells whether the steps trained on them: "
            "make it with dpzoo.engines.opacus.make_private(opacus_engine, ...), or apply "
            "dpzoo.integrations.opacus.count_batches(loader) right after Opacus' make_private."
        )
    if steps > drawn:
        raise PrivacyUsageError(
            f"The engine took {steps} steps but its Poisson loader drew {drawn} batches: the other steps trained on "
            "batches from another loader (the original, shuffled one?), for which Opacus' ε does not hold. Train on "
            "the loader make_private returned (a resumed run: call load_checkpoint after "
            "dpzoo.engines.opacus.make_private, on a checkpoint saved by such a run)."
        )


def _compose_earlier(meta: dict, accountant, name: str, history, resumed: list, delta: float, steps: int) -> None:
    """What the model carried before: composed into ``meta`` (each run once), or kept beside it."""
    earlier = list(getattr(accountant, "dpzoo_earlier_parts", ()))  # what the model carried
    stated = list(getattr(accountant, "dpzoo_stated_parts", ()))  # records stated for adapters: always composed
    before = distinct_histories(earlier)
    if before and getattr(accountant, "dpzoo_earlier_disjoint", False):  # stated disjoint: beside ε, for later runs
        meta["disjoint_spending"] = {"history": list(before), "run_id": f"{run_id(accountant)}-before",
                                     "composed_runs": before.segments}  # fmt: skip
        earlier = []
    if earlier or stated:  # composed, as a dpzoo engine would, each run's steps once (Opacus' first ones may be in it)
        key = run_id(accountant)
        own = [list(h) for h in history]
        composed = distinct_histories([*earlier, *stated, (key, segments_of(key, resumed, own), own)])
        meta.update(epsilon=Accountant(name, list(composed)).get_epsilon(delta), steps=steps_of(composed))
        # every step is in composed_runs' runs: the record's own id has none of its own
        meta.update(history=list(composed), run_id=f"{key}-composed", composed_runs=composed.segments)
