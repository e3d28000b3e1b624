"""PeftModel.save_pretrained writes the adapter's privacy record beside it, and from_pretrained /
load_adapter link it back: a DP-trained adapter reloaded through PEFT composes its spending
without a statement, each run once; what the record cannot account for stays refused."""

from __future__ import annotations

import copy
import json
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.errors import PrivacyUsageError
from dpzoo.integrations.trainer_save import PRIVACY_FILE, read_privacy_metadata

peft = pytest.importorskip("peft")

g = torch.Generator().manual_seed(0)
X, Y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _plain() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(fc1=nn.Linear(6, 8), act=nn.ReLU(), fc2=nn.Linear(8, 3)))


def _lora(base=None, **extra) -> nn.Module:
    return peft.get_peft_model(
        base if base is not None else _plain(), peft.LoraConfig(r=2, target_modules=["fc1"], **extra)
    )


def _saved_without_its_record(path) -> dict:
    """A DP-trained adapter (3 steps) saved to ``path`` with its record file taken away: the record,
    for a test to state."""
    trained = _lora()
    _private(trained, steps=3).detach()
    trained.save_pretrained(path)
    record = read_privacy_metadata(path)
    (path / PRIVACY_FILE).unlink()
    return record


def _private(model, steps: int = 0, mode: str = "lora", sigma: float = 1.0, **extra):
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5),
        data_loader=DataLoader(TensorDataset(X, Y), batch_size=16),
        noise_multiplier=sigma,
        max_grad_norm=1.0,
        mode=mode,
        sample_seed=1,
        **{"target_delta": 1e-5, **extra},
    )
    for _, (x, y) in zip(range(steps), loader):
        if len(y):
            F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return engine


def test_save_pretrained_writes_the_record_and_from_pretrained_composes_it(tmp_path):
    model = _lora(modules_to_save=["fc2"])
    run = _private(model, steps=4)
    model.save_pretrained(tmp_path)
    record = read_privacy_metadata(tmp_path)
    assert record["steps"] == 4 and record["epsilon"] == pytest.approx(run.get_epsilon(1e-5), rel=1e-9)
    assert record["delta"] == 1e-5 and record["history"] == [list(h) for h in run.accountant.history]

    loaded = peft.PeftModel.from_pretrained(_plain(), tmp_path, is_trainable=True)
    head = loaded.base_model.model.fc2.modules_to_save["default"]
    assert getattr(head, "dpzoo_spending", None) is not None  # the saved head copy is linked too
    again = _private(loaded, steps=2)
    assert again.accountant.steps == 4 + 2
    assert again.get_epsilon(1e-5) > run.get_epsilon(1e-5)


def test_an_adapter_on_a_dp_trained_base_counts_the_bases_run_once(tmp_path):
    base = _plain()
    engine = _private(base, steps=3, mode="auto")
    engine.detach()
    same_base = copy.deepcopy(base)
    lora = _lora(base)
    run = _private(lora, steps=2)  # composes the base's run
    lora.save_pretrained(tmp_path)
    reloaded = peft.PeftModel.from_pretrained(same_base, tmp_path, is_trainable=True)
    assert _private(reloaded).accountant.steps == run.accountant.steps == 3 + 2


def test_load_adapter_links_the_named_adapter_from_its_folder(tmp_path):
    model = _lora()
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["fc1"]))
    model.set_adapter("other")
    _private(model, steps=3)  # trains "other" only
    model.save_pretrained(tmp_path)
    assert not (tmp_path / PRIVACY_FILE).exists()  # "default" spent nothing
    assert read_privacy_metadata(tmp_path / "other")["steps"] == 3

    fresh = _lora()
    fresh.load_adapter(tmp_path / "other", adapter_name="other", is_trainable=True)
    fresh.set_adapter("other")
    assert _private(fresh).accountant.steps == 3


def test_a_stale_record_is_removed_when_the_adapter_saved_carries_nothing(tmp_path):
    trained = _lora()
    _private(trained, steps=2)
    trained.save_pretrained(tmp_path)
    assert (tmp_path / PRIVACY_FILE).exists()
    _lora().save_pretrained(tmp_path)  # a fresh adapter over it: the old claim must not stay
    assert not (tmp_path / PRIVACY_FILE).exists()


def test_without_a_known_delta_no_record_is_written_and_the_reload_is_refused(tmp_path):
    model = _lora()
    _private(model, steps=2, target_delta=None)
    model.save_pretrained(tmp_path)
    assert not (tmp_path / PRIVACY_FILE).exists()
    loaded = peft.PeftModel.from_pretrained(_plain(), tmp_path, is_trainable=True)
    with pytest.raises(PrivacyUsageError, match="unknown origin"):
        _private(loaded)


def test_weights_stated_disjoint_stay_of_unknown_origin_through_the_saved_record(tmp_path):
    """An adapter of unknown origin, stated disjoint for one run (``{}``), is refused for the next
    run in memory; its saved record keeps that, so the reloaded adapter is refused too."""
    first = _lora()
    _private(first, steps=2)
    first.save_pretrained(tmp_path / "first")
    (tmp_path / "first" / PRIVACY_FILE).rename(tmp_path / "first.json")  # its record lost: unknown origin
    loaded = peft.PeftModel.from_pretrained(_plain(), tmp_path / "first", is_trainable=True)
    loaded.dpzoo_adapter_privacy = {}
    _private(loaded, steps=1)
    loaded.save_pretrained(tmp_path / "second")
    assert "unknown origin" in read_privacy_metadata(tmp_path / "second")["unknown_origin"]
    again = peft.PeftModel.from_pretrained(_plain(), tmp_path / "second", is_trainable=True)
    with pytest.raises(PrivacyUsageError, match="stated disjoint for an earlier run"):
        _private(again)
    again.dpzoo_adapter_privacy = json.loads((tmp_path / "first.json").read_text())
    assert _private(again).accountant.steps == 2 + 1


def _unknown_adapter(base, targets):
    lora = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=targets))
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_()  # trained elsewhere, loaded without its record
    lora.dpzoo_adapter_privacy = {}  # stated: trained on data disjoint from this run's
    return lora


def test_weights_stated_disjoint_stay_of_unknown_origin_through_dpzoo_save_and_load(tmp_path):
    zoo = dpzoo.load("mlp-tanh", in_features=6, num_classes=3, width=8)
    lora = _unknown_adapter(zoo, [n for n, m in zoo.named_modules() if isinstance(m, nn.Linear)][:1])
    _private(lora, steps=1, train_head=None)
    merged = lora.merge_and_unload().requires_grad_(True)
    with pytest.raises(PrivacyUsageError, match="stated disjoint for an earlier run"):
        _private(merged, mode="auto")  # in memory: the merged model keeps the mark
    dpzoo.save(merged, tmp_path / "m")
    assert "unknown origin" in dpzoo.privacy_metadata(tmp_path / "m")["unknown_origin"]
    with pytest.raises(PrivacyUsageError, match="stated disjoint for an earlier run"):
        _private(dpzoo.load(tmp_path / "m").requires_grad_(True), mode="auto")
    stated = dpzoo.load(tmp_path / "m").requires_grad_(True)
    stated.dpzoo_adapter_privacy = {}  # stated again, for this run
    assert _private(stated, mode="auto").accountant.steps == 1


def test_weights_stated_disjoint_stay_of_unknown_origin_through_save_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    lora = _unknown_adapter(transformers.GPT2LMHeadModel(config), ["c_attn"])
    ids = torch.randint(0, 50, (32, 8))
    engine = dpzoo.PrivacyEngine()
    engine.make_private(module=lora, optimizer=torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=0.1),
                        data_loader=DataLoader(TensorDataset(ids), batch_size=8), noise_multiplier=1.0,
                        max_grad_norm=1.0, mode="lora")  # fmt: skip
    lora.merge_and_unload().save_pretrained(tmp_path)
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    again = dpzoo.PrivacyEngine()
    with pytest.raises(PrivacyUsageError, match="stated disjoint for an earlier run"):
        again.make_private(module=reloaded, optimizer=torch.optim.SGD(reloaded.parameters(), lr=0.1),
                           data_loader=DataLoader(TensorDataset(ids), batch_size=8), noise_multiplier=1.0,
                           max_grad_norm=1.0)  # fmt: skip


# The fifteenth independent audit's findings: each was a silent undercount on the commit before.


@pytest.mark.parametrize("init", [False, "olora"])
def test_an_adapter_of_any_init_loaded_without_a_record_is_refused(tmp_path, init):
    """A factor that does not start at zero cannot tell trained from fresh: loaded without a record
    (here: no target_delta, so none was written), the adapter composed nothing."""
    model = _lora(init_lora_weights=init)
    _private(model, steps=2, target_delta=None)
    model.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(_plain(), tmp_path, is_trainable=True)
    with pytest.raises(PrivacyUsageError, match="unknown origin"):
        _private(loaded)


def test_an_untrained_adapter_loaded_without_a_record_trains(tmp_path):
    _lora().save_pretrained(tmp_path)  # lora_B = 0: moves nothing
    assert _private(peft.PeftModel.from_pretrained(_plain(), tmp_path, is_trainable=True)).accountant.steps == 0


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_an_adapters_biases_loaded_onto_a_dp_trained_base_compose_with_it(tmp_path, bias):
    """The record replaced the base layer's link, whose weight still held the base's run."""
    adapter = _lora(bias=bias)
    _private(adapter, steps=3)
    adapter.save_pretrained(tmp_path)
    base = _plain()
    _private(base, steps=4, mode="auto").detach()
    moved = nn.Sequential(OrderedDict(fc1=base.fc1, act=nn.ReLU(), fc2=nn.Linear(8, 3)))  # fc1 carries the run
    loaded = peft.PeftModel.from_pretrained(moved, tmp_path, is_trainable=True)
    assert _private(loaded).accountant.steps == 4 + 3


def test_a_combination_with_an_adapter_of_unknown_origin_is_saved_without_a_record(tmp_path):
    """add_weighted_adapter of a trained adapter and one of unknown origin: the saved record held
    the known one's steps only, and the reload composed them."""
    unknown = _lora()
    _private(unknown, steps=4)
    unknown.save_pretrained(tmp_path / "u")
    (tmp_path / "u" / PRIVACY_FILE).unlink()
    model = _lora()
    _private(model, steps=3)
    model.load_adapter(tmp_path / "u", adapter_name="u")
    model.add_weighted_adapter(["default", "u"], [1.0, 1.0], adapter_name="combo", combination_type="linear")
    model.set_adapter("combo")
    model.delete_adapter("u")
    model.save_pretrained(tmp_path / "out", selected_adapters=["combo"])
    assert not (tmp_path / "out" / "combo" / PRIVACY_FILE).exists()
    reloaded = peft.PeftModel.from_pretrained(_plain(), tmp_path / "out" / "combo", is_trainable=True)
    with pytest.raises(PrivacyUsageError, match="unknown origin"):
        _private(reloaded)


def test_a_statement_on_the_lora_layer_survives_merge_and_unload(tmp_path):
    unknown = _lora()
    _private(unknown, steps=4)
    unknown.save_pretrained(tmp_path)
    (tmp_path / PRIVACY_FILE).unlink()
    loaded = peft.PeftModel.from_pretrained(_plain(), tmp_path, is_trainable=True)
    loaded.base_model.model.fc1.dpzoo_adapter_privacy = {}  # on the module holding the layer
    _private(loaded, steps=2)
    merged = loaded.merge_and_unload().requires_grad_(True)
    with pytest.raises(PrivacyUsageError, match="stated disjoint for an earlier run"):
        _private(merged, mode="auto")


# The sixteenth independent audit's finding: `dpzoo_privacy = {}` covered an adapter of unknown
# origin for one run, and every later run, copy and record forgot it was unknown.


@pytest.mark.parametrize("where", ["model", "layer"])
def test_a_model_statement_that_covered_unknown_weights_holds_for_one_run(tmp_path, where):
    unknown = _lora()
    _private(unknown, steps=4)
    unknown.save_pretrained(tmp_path / "u")
    (tmp_path / "u" / PRIVACY_FILE).unlink()
    loaded = peft.PeftModel.from_pretrained(_plain(), tmp_path / "u", is_trainable=True)
    holder = loaded if where == "model" else loaded.base_model.model.fc1
    holder.dpzoo_privacy = {}  # the data are disjoint from the weights' (of unknown origin)
    _private(loaded, steps=2)
    with pytest.raises(PrivacyUsageError, match="stated disjoint for an earlier run"):
        _private(loaded)
    loaded.save_pretrained(tmp_path / "out")
    assert "unknown origin" in read_privacy_metadata(tmp_path / "out")["unknown_origin"]


def test_a_model_statement_without_unknown_weights_does_not_refuse_later_runs():
    model = _lora()
    _private(model, steps=2).detach()
    model.dpzoo_privacy = {}  # the earlier run's data are disjoint: its spending is kept for later runs
    _private(model, steps=1).detach()
    assert _private(model).accountant.steps == 2 + 1


# The seventeenth independent audit's findings.


def test_a_stated_record_that_holds_weights_of_unknown_origin_covers_only_its_own_spending(tmp_path):
    """The record of a run on weights stated disjoint says so (unknown_origin); stated for a reload,
    it made those weights known, and the next save dropped unknown_origin."""
    unknown = _lora()
    _private(unknown, steps=4)
    unknown.save_pretrained(tmp_path / "u")
    (tmp_path / "u" / PRIVACY_FILE).unlink()
    loaded = peft.PeftModel.from_pretrained(_plain(), tmp_path / "u", is_trainable=True)
    loaded.dpzoo_adapter_privacy = {}
    _private(loaded, steps=2)
    loaded.save_pretrained(tmp_path / "r1")
    record = read_privacy_metadata(tmp_path / "r1")
    again = peft.PeftModel.from_pretrained(_plain(), tmp_path / "r1", is_trainable=True)
    again.dpzoo_adapter_privacy = record
    with pytest.raises(PrivacyUsageError, match="states only its own spending"):
        _private(again)
    again.dpzoo_privacy, again.dpzoo_adapter_privacy = record, {}  # its spending composed, the rest stated
    assert _private(again, steps=1).accountant.steps == 2 + 1
    again.save_pretrained(tmp_path / "r2")
    assert read_privacy_metadata(tmp_path / "r2").get("unknown_origin")


def test_a_shallow_copy_does_not_make_a_second_run_on_one_statement():
    """copy.copy shares the layers and the statement: a run on the original used it."""
    base = _plain()
    lora = _lora(base)
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_()  # trained elsewhere
    merged = lora.merge_and_unload().requires_grad_(True)
    merged.dpzoo_adapter_privacy = {}
    twin = copy.copy(merged)
    _private(merged, steps=2, mode="auto").detach()
    with pytest.raises(PrivacyUsageError, match="unknown origin"):
        _private(twin, mode="auto")


# The eighteenth independent audit's findings.


def _reloaded_without_record(tmp_path, **config):
    trained = _lora(**config)
    for n, p in trained.named_parameters():
        if config and "lora_" in n:
            p.requires_grad_(False)  # only the head copy / the biases train
    _private(trained, steps=3, mode="auto" if config else "lora").detach()
    trained.save_pretrained(tmp_path / "u")
    (tmp_path / "u" / PRIVACY_FILE).unlink()
    return peft.PeftModel.from_pretrained(_plain(), tmp_path / "u", is_trainable=True)


def _opacus_steps(model, steps):
    opacus = pytest.importorskip("opacus")
    from dpzoo.engines.opacus import make_private

    engine = opacus.PrivacyEngine(accountant="rdp")
    params = [p for p in model.parameters() if p.requires_grad]
    wrapped, opt, loader = make_private(engine, module=model, optimizer=torch.optim.SGD(params, lr=0.5),
                                        data_loader=DataLoader(TensorDataset(X, Y), batch_size=16),
                                        noise_multiplier=1.3, max_grad_norm=1.0)  # fmt: skip
    for _, (x, y) in zip(range(steps), loader):
        F.cross_entropy(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()
    return engine, opt, loader


def test_opacus_refuses_weights_of_unknown_origin_and_keeps_statements_to_one_run(tmp_path):
    """Opacus trained an adapter of unknown origin (linking it, so it looked known afterwards), and
    left out the record stated for it."""
    from dpzoo.integrations.opacus import privacy_metadata

    loaded = _reloaded_without_record(tmp_path)
    with pytest.raises(PrivacyUsageError, match="unknown origin"):
        _opacus_steps(loaded, 2)
    loaded.dpzoo_adapter_privacy = {}
    engine, opt, loader = _opacus_steps(loaded, 2)
    assert privacy_metadata(engine, 1e-5, optimizer=opt, data_loader=loader).get("unknown_origin")
    with pytest.raises(PrivacyUsageError, match="unknown origin"):
        _private(loaded)  # the statement was for the Opacus run


def test_opacus_composes_the_record_stated_for_an_adapter(tmp_path):
    from dpzoo.integrations.opacus import privacy_metadata

    record = _saved_without_its_record(tmp_path / "a")
    loaded = peft.PeftModel.from_pretrained(_plain(), tmp_path / "a", is_trainable=True)
    loaded.dpzoo_adapter_privacy = record
    engine, opt, loader = _opacus_steps(loaded, 2)
    assert privacy_metadata(engine, 1e-5, optimizer=opt, data_loader=loader)["steps"] == 3 + 2


def test_a_load_into_an_existing_adapter_links_only_the_layers_it_loaded(tmp_path):
    """An adapter file for fc1 loaded over an adapter of unknown origin on fc1 and fc2: its record
    was linked to fc2 too, whose weights it did not hold."""
    unknown = peft.get_peft_model(_plain(), peft.LoraConfig(r=2, target_modules=["fc1", "fc2"]))
    _private(unknown, steps=3).detach()
    unknown.save_pretrained(tmp_path / "u")
    (tmp_path / "u" / PRIVACY_FILE).unlink()
    known = _lora()  # fc1 only
    _private(known, steps=2, sigma=2.0).detach()
    known.save_pretrained(tmp_path / "k")
    loaded = peft.PeftModel.from_pretrained(_plain(), tmp_path / "u", is_trainable=True)
    loaded.load_adapter(tmp_path / "k", adapter_name="default", is_trainable=True)
    with pytest.raises(PrivacyUsageError, match="unknown origin.*fc2"):
        _private(loaded)
    loaded.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out" / PRIVACY_FILE).exists()  # part of it is of unknown origin: no record


@pytest.mark.parametrize("config", [{"modules_to_save": ["fc2"]}, {"bias": "all"}])
def test_a_head_copy_or_biases_loaded_without_a_record_are_of_unknown_origin(tmp_path, config):
    loaded = _reloaded_without_record(tmp_path, **config)
    with pytest.raises(PrivacyUsageError, match="loaded without a record"):
        _private(loaded, mode="auto")


# The nineteenth independent audit's findings.


def test_a_checkpoint_of_a_run_on_weights_of_unknown_origin_marks_the_model_it_resumes(tmp_path):
    """Opacus' load_checkpoint (and dpzoo's engine.load_state_dict) restored the run's history
    into a fresh model, which then looked known: the next run composed only the resumed run."""
    loaded = _reloaded_without_record(tmp_path)
    loaded.dpzoo_privacy = {}  # stated for the Opacus run
    engine, opt, loader = _opacus_steps(loaded, 2)
    engine.save_checkpoint(path=tmp_path / "ck.pt", module=loaded, optimizer=opt)
    fresh = _lora()
    resumed, opt2, loader2 = _opacus_steps(fresh, 0)
    resumed.load_checkpoint(path=tmp_path / "ck.pt", module=fresh, optimizer=opt2)
    with pytest.raises(PrivacyUsageError, match="unknown origin"):
        _private(fresh)


def test_an_engine_checkpoint_of_a_run_on_weights_of_unknown_origin_marks_the_model_it_resumes(tmp_path):
    loaded = _reloaded_without_record(tmp_path)
    loaded.dpzoo_adapter_privacy = {}
    run = _private(loaded, steps=2)
    state = run.state_dict()
    run.detach()
    fresh = _lora()
    again = _private(fresh)
    again.load_state_dict(state)
    again.detach()
    with pytest.raises(PrivacyUsageError, match="unknown origin"):
        _private(fresh)


def test_an_adapter_loads_with_low_cpu_mem_usage(tmp_path):
    trained = _lora()
    _private(trained, steps=3).detach()
    trained.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(_plain(), tmp_path, is_trainable=True, low_cpu_mem_usage=True)
    assert _private(loaded).accountant.steps == 3


def test_one_record_can_be_stated_for_two_models(tmp_path):
    record = _saved_without_its_record(tmp_path / "a")
    for _ in range(2):  # a record composes its runs once wherever it is stated: it is not used up
        loaded = peft.PeftModel.from_pretrained(_plain(), tmp_path / "a", is_trainable=True)
        loaded.dpzoo_adapter_privacy = record
        assert _private(loaded, steps=1).accountant.steps == 3 + 1
