"""The privacy a run spends, composed with what was spent before it: the sample rate q, the
history a model or a checkpoint carries (composed first), and σ, given or calibrated to spend
a target ε over the epochs (``make_private``, ``DPOptimizer.load_state_dict``)."""

from __future__ import annotations

import os
import warnings
from typing import Mapping

from torch import nn

from ..errors import DPZooError, PrivacyUsageError, WeakPrivacyWarning
from .accountant import Accountant, get_noise_multiplier
from .caller import first_frame_outside_dpzoo
from .provenance import distinct_histories, note_composed

__all__ = [
    "compute_sample_rate",
    "prior_spending",
    "recorded_origin",
    "SpendingLink",
    "ComposedSpending",
    "link_spending",
    "calibrate",
    "restore_history",
]


def compute_sample_rate(batch_size: int, world: int, n: int, unit: str = "samples") -> float:
    """q = batch_size · world / N: each rank Poisson-samples its shard at the one global rate
    (``unit``: what N counts, e.g. users)."""
    q = batch_size * world / n
    if q > 1:
        raise PrivacyUsageError(
            f"batch_size {batch_size}{f' x {world} ranks' if world > 1 else ''} exceeds the dataset's "
            f"{n} {unit} (sample rate q = {q:.3g} > 1): use a batch_size of at most "
            f"{n // world}."
        )
    return q


class SpendingLink:
    """What a model has spent, kept on the model by every engine that trains it
    (``model.dpzoo_spending``): the engine's accountant itself, so the record outlives the engine
    (a new engine on the same model composes after it), shared rather than copied by
    ``copy.deepcopy`` (an EMA / SWA copy averages iterates that go on spending)."""

    def __init__(self, accountant: Accountant):
        self.accountant = accountant

    def __deepcopy__(self, memo: dict) -> "SpendingLink":
        return self

    @property
    def history(self) -> list:
        return [list(h) for h in self.accountant.history]


class ComposedSpending(SpendingLink):
    """The spending of weights made from several linked ones (PEFT's ``add_weighted_adapter`` of
    adapters different engines trained): every part's history, composed."""

    def __init__(self, parts: list):
        self.parts = parts

    @property
    def history(self) -> list:
        return [h for part in self.parts for h in part.history]


def link_spending(module: nn.Module, accountant: Accountant) -> None:
    """Record on ``module`` and on each of its layers with trainable parameters that ``accountant``
    holds their spending: ``dpzoo_spending``, and for a Hugging Face model (or one inside) ``config.dpzoo_privacy`` (the accountant's live history: ``save_pretrained``
    writes it into config.json, so a ``from_pretrained`` of any copy of the weights composes it)."""
    note_composed(accountant, [getattr(m, "dpzoo_spending", None) for m in module.modules()])  # before relinking
    for m in module.modules():  # the model, and every layer it trains (a layer can be reused elsewhere)
        if m is not module and not any(p.requires_grad for p in m.parameters(recurse=False)):
            continue
        link = getattr(m, "dpzoo_spending", None)
        if isinstance(link, SpendingLink):  # updated, not replaced: deep copies that share it follow along
            link.accountant = accountant
        else:
            object.__setattr__(m, "dpzoo_spending", SpendingLink(accountant))
    for m in module.modules():  # a backbone inside the model is saved on its own too (backbone.save_pretrained)
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            config.dpzoo_privacy = {"accountant": accountant.name, "history": accountant.history}
    from ..integrations.peft_statements import clear_marks

    clear_marks(module)  # merged adapters the user stated a record for: this spending now covers them


def recorded_origin(module: nn.Module) -> tuple[dict, str] | None:
    """(privacy record, where) of a model reloaded outside dpzoo: the record a Hugging Face config
    carries (``config.dpzoo_privacy``, written by :func:`link_spending` before ``save_pretrained``),
    else the dpzoo record in the directory ``from_pretrained`` read (``config._name_or_path``; a
    PEFT model's base too). None for a model with neither."""
    from ..integrations.trainer_save import read_privacy_metadata  # imports hub: not at module level

    carried = None
    for m in module.modules():
        config = getattr(m, "config", None)
        path = getattr(config, "_name_or_path", None)
        if isinstance(path, str) and path and os.path.isdir(path):
            meta = read_privacy_metadata(path)
            if meta:  # a full record first: it has ε, δ and the rest, not only the history
                return meta, path
        record = getattr(config, "dpzoo_privacy", None)
        if carried is None and isinstance(record, dict) and record:
            carried = (record, "the model's config")
    return carried


def recorded_origins(module: nn.Module) -> list[dict]:
    """Every record the Hugging Face models inside ``module`` were reloaded with (two reloaded
    models combined in one carry two): per config, the dpzoo record of the directory it was read
    from, else the record it carries; each config once."""
    from ..integrations.trainer_save import read_privacy_metadata  # imports hub: not at module level

    found: dict[int, dict] = {}
    for m in module.modules():
        config = getattr(m, "config", None)
        if config is None or id(config) in found:
            continue
        path = getattr(config, "_name_or_path", None)
        meta = read_privacy_metadata(path) if isinstance(path, str) and path and os.path.isdir(path) else None
        record = meta or getattr(config, "dpzoo_privacy", None)
        if isinstance(record, dict) and record:
            found[id(config)] = record
    return list(found.values())


def prior_spending(module: nn.Module, earlier: list) -> list:
    """The (σ, q, steps) history a model already spent: ``earlier`` (an earlier engine on it, alive),
    else everything found in it: the spending every earlier engine linked to it or a layer
    (:class:`SpendingLink`), the records ``dpzoo.load`` attached (the whole history when recorded,
    else the last σ, q and step count), the record a Hugging Face reload carries
    (:func:`recorded_origin`); ``[]`` of those for a model whose ``dpzoo_privacy`` the user set to
    ``{}`` (new data disjoint from the earlier run's). Then, always, what the user stated for LoRA
    weights of unknown origin (``dpzoo_adapter_privacy`` records, :func:`adapter_statements`)."""
    stated = adapter_statements(module)  # first: a statement that is not a record is refused as such
    refuse_weights_of_unknown_origin(module)
    if getattr(module, "dpzoo_privacy", None) == {}:
        return stated  # the user stated the new data disjoint from what the model was trained on
    # a live earlier engine's history, every reloaded model's record, and everything else inside, each once
    more = ([[list(h) for h in earlier]] if earlier else []) + [history_of(r) for r in recorded_origins(module)]
    return spent_inside(module, more) + stated


def adapter_statements(module: nn.Module) -> list:
    """The histories the user stated for adapters of unknown origin (``m.dpzoo_adapter_privacy =
    read_privacy_metadata(ADAPTER_DIR)`` on the model or a module holding them), each composed
    (``{}``: their data is disjoint from this run's, nothing to compose)."""
    out: list = []
    for name, m in module.named_modules():
        meta = m.__dict__.get("dpzoo_adapter_privacy")
        if meta is None:
            continue
        if not isinstance(meta, Mapping):
            raise PrivacyUsageError(
                f"{name or 'model'}.dpzoo_adapter_privacy must be a privacy record (read_privacy_metadata(DIR)) or {{}} "
                f"(data disjoint from this run's), got {type(meta).__name__}."
            )
        if meta:
            out += history_of(meta)
    return out


def spent_inside(module: nn.Module, more: list | None = None) -> list:
    """What the model or any module inside it spent (a DP-trained model reused in a new one, a
    layer of it): every engine's spending link and every record on a module (``dpzoo_privacy``),
    with the ``more`` histories, each run once (:mod:`dpzoo.privacy.provenance`)."""
    links, records = [], list(more or [])
    for name, m in module.named_modules():
        link = getattr(m, "dpzoo_spending", None)
        meta = m.__dict__.get("dpzoo_privacy")
        if meta is not None and not isinstance(meta, Mapping):
            raise PrivacyUsageError(
                f"{name or 'model'}.dpzoo_privacy must be a privacy record (read_privacy_metadata(DIR)) or {{}} "
                f"(new data disjoint from the earlier run's), got {type(meta).__name__}."
            )
        if isinstance(link, SpendingLink):
            links.append(link)
        if meta:
            records.append(history_of(meta))
    return distinct_histories(links, records)


def history_of(meta: dict) -> list:
    """The (σ, q, steps) history of a privacy record: the whole one when recorded, else its last
    σ, q and step count; refused when it has no σ to compose with."""
    if meta.get("history"):  # every release composed into the saved ε, not only the last (σ, q)
        return [list(h) for h in meta["history"]]
    if meta.get("noise_multiplier") is None or not meta.get("steps"):
        raise PrivacyUsageError(
            f"This model was trained with DP before (ε = {meta.get('epsilon')}) but its metadata lacks the noise "
            "multiplier to compose with: pass accountant=Accountant(name, history) with the earlier steps, or set "
            "model.dpzoo_privacy = {} if the new data is disjoint from the data it was trained on."
        )
    return [[float(meta["noise_multiplier"]), float(meta["sample_rate"]), int(meta["steps"])]]


def refuse_weights_of_unknown_origin(module: nn.Module) -> None:
    """Trained LoRA weights no record accounts for: an adapter trained before (a factor that starts
    at zero is not) with no engine's link, and adapters merged into a layer without one
    (:mod:`dpzoo.integrations.peft_merge`). PEFT's from_pretrained keeps no trace of the directory
    a DP run saved the adapter to, and its merge none of the adapter, so the user says which
    applies, on the model or on the module that holds them; refused otherwise, whatever else the
    model carries."""
    from ..integrations.peft_layers import trained_adapters
    from ..integrations.peft_statements import merged_without_record, refuse_unknown_origin

    unknown = [(layer, a, "adapter") for layer, a in trained_adapters(module)]
    unknown += [(layer, a, "merged adapter") for layer, a in merged_without_record(module)]
    if unknown:
        refuse_unknown_origin(module, unknown)


def stated_assumptions(module: nn.Module) -> list[str]:
    """What the user stated about data outside ε, for the privacy metadata: public data behind an
    adapter's initialisation, that a model trained before saw other data (dpzoo_privacy = {}), and
    that adapters of unknown origin did (dpzoo_adapter_privacy = {}, on any module)."""
    out = list(getattr(module, "dpzoo_public_init", {}).values())
    if getattr(module, "dpzoo_privacy", None) == {}:
        out.append(
            "the model was trained before on data stated to be disjoint from this run's (model.dpzoo_privacy = {}): "
            "that spending is not composed"
        )
    for name, m in module.named_modules():
        if m.__dict__.get("dpzoo_adapter_privacy") == {}:
            out.append(
                f"LoRA weights of unknown origin in {name or 'the model'} stated to be trained on data disjoint from this "
                "run's (dpzoo_adapter_privacy = {}): their spending is not composed"
            )
    return out


def calibrate(
    accountant: Accountant,
    prior: list,
    *,
    noise_multiplier,
    target_epsilon,
    target_delta,
    epochs,
    sample_rate: float,
    steps_per_epoch: int,
):
    """σ: ``noise_multiplier``, or the one that spends ``target_epsilon`` over ``epochs`` after the
    privacy the model already spent (``prior``, composed into ``accountant`` first). Refused if
    ``accountant`` cannot compose its history with (σ, q)."""
    if prior:  # the model already spent privacy on its data (dpzoo.load, an earlier engine): compose after it
        accountant.load_state_dict({"name": accountant.name, "history": prior + accountant.history})
    if target_epsilon is not None:
        try:
            noise_multiplier = get_noise_multiplier(
                target_epsilon,
                target_delta,
                sample_rate,
                int(epochs) * steps_per_epoch,
                accountant.name,
                history=accountant.history,
                group=accountant.group,
            )
        except ValueError as e:
            if isinstance(e, DPZooError):
                raise
            raise PrivacyUsageError(f"Cannot calibrate the noise: {e}") from None
    accountant.check(float(noise_multiplier), sample_rate)  # e.g. a history this accountant cannot compose
    warn_weak_budget(float(noise_multiplier), target_epsilon)
    return noise_multiplier


WEAK_EPSILON = 100.0  # a target at or above it says little (DP training papers report ε ≤ 10)


def warn_weak_budget(noise_multiplier: float, target_epsilon: float | None) -> None:
    """A :class:`~dpzoo.errors.WeakPrivacyWarning` for no noise (ε = ∞) or a target ε ≥ 100."""
    if noise_multiplier == 0:
        warnings.warn(
            "noise_multiplier = 0: no noise, so ε = ∞ and the run is not differentially private (the metadata "
            "will say so). Use a target_epsilon or a noise_multiplier > 0.",
            WeakPrivacyWarning,
            stacklevel=first_frame_outside_dpzoo(),
        )
    elif target_epsilon is not None and target_epsilon >= WEAK_EPSILON:
        warnings.warn(
            f"target_epsilon = {target_epsilon:g}: a guarantee this weak says little (e^ε bounds how much more "
            "likely any outcome becomes with one sample); DP training usually targets ε ≤ 10.",
            WeakPrivacyWarning,
            stacklevel=first_frame_outside_dpzoo(),
        )


def restore_history(accountant: Accountant, state: dict) -> None:
    """Load the accountant history of an optimizer checkpoint ``state`` into ``accountant``,
    composed after any history it already has (e.g. a DP-FROST selection) unless that is the
    checkpoint's own beginning. Refused for a checkpoint of another accountant, or one that
    took steps but records no history."""
    if state.get("steps", 0) and "accountant" not in state:
        raise PrivacyUsageError(
            f"This optimizer checkpoint took {state['steps']} private steps but records no accountant history "
            "(saved by an older dpzoo): ε would restart from 0. Restore the history with "
            "engine.accountant.load_state_dict(...) from the run's engine.state_dict()."
        )
    if "accountant" in state:
        saved = [list(h) for h in state["accountant"]["history"]]
        now = [list(h) for h in accountant.history]
        if now and now[len(now) - len(saved) :] == saved:
            saved = now  # restored already (the engine's state, then its optimizer's): not twice
        elif saved[: len(now)] != now:  # the checkpoint does not start with what is spent here: compose
            saved = now + saved
        if state["accountant"].get("name") != accountant.name:
            raise PrivacyUsageError(
                f"The checkpoint was accounted with {state['accountant'].get('name')!r}, this engine uses "
                f"{accountant.name!r}: make the engine with the checkpoint's accountant."
            )
        accountant.load_state_dict({"name": accountant.name, "history": saved})
