"""A DP-trained LoRA adapter reloaded through PEFT keeps its budget: PeftModel.save_pretrained
writes its record beside it and from_pretrained / load_adapter link it back; an adapter that was
trained before and comes without a record (``_bare``: the adapter's files alone) is refused until
the user composes its record or states the data are disjoint (recorded in the metadata)."""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.errors import PrivacyUsageError
from dpzoo.integrations.trainer_save import read_privacy_metadata, write_privacy_files

peft = pytest.importorskip("peft")

g = torch.Generator().manual_seed(0)
X, Y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _plain_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(fc1=nn.Linear(6, 8), act=nn.ReLU(), fc2=nn.Linear(8, 3)))


def _private(model, steps: int = 0):
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5),
        data_loader=DataLoader(TensorDataset(X, Y), batch_size=16),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        mode="lora",
        sample_seed=1,
    )
    for _, (x, y) in zip(range(steps), loader):
        if len(y):
            F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return engine


@pytest.fixture
def saved_adapter(tmp_path):
    """A LoRA adapter (PEFT's default init: lora_B = 0) trained with DP, saved by PEFT with its record."""
    model = peft.get_peft_model(_plain_model(), peft.LoraConfig(r=2, target_modules=["fc1", "fc2"]))
    engine = _private(model, steps=4)
    model.save_pretrained(tmp_path)
    write_privacy_files(model, tmp_path, engine.privacy_metadata(1e-5), zoo_files=False)
    return tmp_path, engine.get_epsilon(1e-5)


def _bare(directory):
    """A copy of the adapter's own files, without its privacy record (trained elsewhere, or saved
    by something that does not write records)."""
    import shutil

    bare = directory.parent / f"{directory.name}-bare"
    if not bare.exists():
        bare.mkdir()
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copy(directory / name, bare / name)
    return bare


def test_a_fresh_adapter_trains_without_a_record():
    model = peft.get_peft_model(_plain_model(), peft.LoraConfig(r=2, target_modules=["fc1", "fc2"]))
    assert _private(model).accountant.history == []


def test_a_reloaded_adapter_without_its_record_is_refused(saved_adapter):
    directory, _ = saved_adapter
    loaded = peft.PeftModel.from_pretrained(_plain_model(), _bare(directory), is_trainable=True)
    with pytest.raises(
        PrivacyUsageError,
        match=r"unknown origin \(adapter 'default' in base_model\.model\.fc1 and 1 more layers\).*read_privacy_metadata",
    ):
        _private(loaded)


def test_its_record_composes(saved_adapter):
    directory, spent = saved_adapter
    loaded = peft.PeftModel.from_pretrained(_plain_model(), _bare(directory), is_trainable=True)
    loaded.dpzoo_privacy = read_privacy_metadata(directory)
    engine = _private(loaded)
    assert engine.get_epsilon(1e-5) == pytest.approx(spent, rel=1e-6)  # before any new step: the adapter's spending


def test_disjoint_data_is_a_stated_assumption_in_the_metadata(saved_adapter):
    directory, _ = saved_adapter
    loaded = peft.PeftModel.from_pretrained(_plain_model(), _bare(directory), is_trainable=True)
    loaded.dpzoo_privacy = {}
    engine = _private(loaded, steps=1)
    assert engine.accountant.history[0][2] == 1  # a fresh budget: only this run's step
    assert "disjoint" in engine.privacy_metadata(1e-5)["public_statistics"]


def test_adapter_weights_stated_disjoint_stay_of_unknown_origin_after_that_run(saved_adapter):
    """The thirteenth audit: `dpzoo_adapter_privacy = {}` held for every later run (the run linked
    the adapter and cleared the statement), so a run back on the adapter's own data composed nothing."""
    directory, _ = saved_adapter
    loaded = peft.PeftModel.from_pretrained(_plain_model(), _bare(directory), is_trainable=True)
    loaded.dpzoo_adapter_privacy = {}  # this run's data is disjoint from the adapter's
    _private(loaded, steps=2).detach()
    with pytest.raises(PrivacyUsageError, match="stated disjoint for an earlier run"):
        _private(loaded)  # the next run may be on the adapter's data: state again
    loaded.dpzoo_adapter_privacy = read_privacy_metadata(directory)
    assert _private(loaded).accountant.steps == 4 + 2  # the adapter's run and the disjoint one


def test_a_stated_adapter_record_counts_the_base_run_it_composed_once(tmp_path):
    """The thirteenth audit (an overcount): a DP-LoRA run on a DP-trained base composes the base's
    run; its record, stated for the adapter on the same base, counted that run a second time."""
    base = _plain_model()
    engine = dpzoo.PrivacyEngine()
    base, opt, loader = engine.make_private(module=base, optimizer=torch.optim.SGD(base.parameters(), lr=0.1),
                                            data_loader=DataLoader(TensorDataset(X, Y), batch_size=16),
                                            noise_multiplier=1.0, max_grad_norm=1.0, sample_seed=1)  # fmt: skip
    for _, (x, y) in zip(range(3), loader):
        F.cross_entropy(base(x), y).backward()
        opt.step()
        opt.zero_grad()
    engine.detach()
    same_base = copy.deepcopy(base)
    lora = _new_adapter(base)
    run = _private(lora, steps=2)  # composes the base's run
    lora.save_pretrained(tmp_path)
    write_privacy_files(lora, tmp_path, run.privacy_metadata(1e-5), zoo_files=False)
    again = peft.PeftModel.from_pretrained(same_base, tmp_path, is_trainable=True)
    again.dpzoo_adapter_privacy = read_privacy_metadata(tmp_path)
    assert _private(again).accountant.steps == run.accountant.steps  # the base's run once, and the LoRA run


def _new_adapter(base: nn.Module):
    return peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["fc1", "fc2"]))


@pytest.mark.parametrize("unload", ["merge_and_unload", "merge_adapter_then_unload"])
def test_a_reloaded_adapter_merged_without_its_record_is_refused(saved_adapter, unload):
    """PEFT's merge puts ΔW into the base layers and drops the adapter: without the watch, a new
    adapter on the merged model trained with a fresh budget."""
    directory, _ = saved_adapter
    loaded = peft.PeftModel.from_pretrained(_plain_model(), _bare(directory), is_trainable=True)
    if unload == "merge_and_unload":
        merged = loaded.merge_and_unload()
    else:
        loaded.merge_adapter()
        merged = loaded.unload()
    with pytest.raises(
        PrivacyUsageError,
        match=r"merged adapter 'default' in base_model\.model\.fc1\.base_layer",
    ):
        _private(_new_adapter(merged))
    reused = nn.Sequential(merged.fc2)  # one merged layer reused elsewhere carries the mark too
    with pytest.raises(PrivacyUsageError, match="merged adapter 'default'"):
        _private(_new_adapter(nn.Sequential(OrderedDict(fc1=nn.Linear(6, 3), fc2=reused[0]))))


def test_a_merged_adapter_composes_its_record_or_states_disjoint_data(saved_adapter):
    directory, spent = saved_adapter
    merged = peft.PeftModel.from_pretrained(_plain_model(), _bare(directory)).merge_and_unload()
    merged.dpzoo_adapter_privacy = read_privacy_metadata(directory)
    assert _private(_new_adapter(merged)).get_epsilon(1e-5) == pytest.approx(spent, rel=1e-6)
    other = peft.PeftModel.from_pretrained(_plain_model(), _bare(directory)).merge_and_unload()
    fresh = _new_adapter(other)
    fresh.dpzoo_adapter_privacy = {}
    assert "disjoint" in _private(fresh, steps=1).privacy_metadata(1e-5)["public_statistics"]


def test_an_adapter_dpzoo_trained_composes_through_its_merged_layers():
    """In-process, the engine's spending link moves to each merged base layer: a layer of the
    merged model reused in a new model composes the adapter's spending."""
    model = _new_adapter(_plain_model())
    first = _private(model, steps=3)
    merged = model.merge_and_unload()
    reused = nn.Sequential(OrderedDict(fc1=nn.Linear(6, 8), act=nn.ReLU(), fc2=merged.fc2))
    assert _private(_new_adapter(reused)).accountant.history == first.accountant.history


def test_an_untrained_adapter_merges_without_a_trace():
    merged = _new_adapter(_plain_model()).merge_and_unload()  # lora_B = 0: ΔW = 0
    assert _private(_new_adapter(merged)).accountant.history == []


def test_the_watch_installs_after_peft_without_importing_torch_first():
    """`import dpzoo` stays torch-free; a probe for peft (transformers' is_peft_available) before the
    real import must not switch the watch off."""
    import subprocess
    import sys

    code = (
        "import sys, dpzoo; assert 'torch' not in sys.modules; import importlib.util; "
        "assert importlib.util.find_spec('peft') is not None; from transformers import TrainingArguments; "
        "import peft; from torch.nn.modules import module as M; "
        "from dpzoo.integrations.peft_merge import _on_child_assigned; "
        "assert _on_child_assigned in M._global_module_registration_hooks.values(); "
        "from peft.tuners.lora.layer import Linear; assert Linear.merge.dpzoo_watched"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_merge_adapter_then_a_new_adapter_of_the_same_name_is_refused(saved_adapter):
    """merge_adapter() keeps the tuner layers; get_peft_model on the base model re-initialises
    'default' (lora_B = 0) and unmerges a zero ΔW: the trained ΔW stays in the weights."""
    directory, _ = saved_adapter
    loaded = peft.PeftModel.from_pretrained(_plain_model(), _bare(directory), is_trainable=True)
    loaded.merge_adapter()
    again = _new_adapter(loaded.get_base_model())
    with pytest.raises(PrivacyUsageError, match="merged adapter 'default'"):
        _private(again)


def test_an_adapter_merged_then_unmerged_leaves_no_mark(saved_adapter):
    directory, _ = saved_adapter
    loaded = peft.PeftModel.from_pretrained(_plain_model(), _bare(directory), is_trainable=True)
    loaded.merge_adapter()
    loaded.unmerge_adapter()
    base = loaded.unload()  # the adapter is dropped, its ΔW taken back out
    assert _private(_new_adapter(base)).accountant.history == []


def test_an_unknown_merged_adapter_is_refused_beside_a_known_one():
    """A record found elsewhere in the model (an engine's link) does not account for an adapter of
    unknown origin merged into the same layers."""
    model = _new_adapter(_plain_model())
    _private(model, steps=3)
    merged = model.merge_and_unload()  # linked: this process trained it
    stacked = _new_adapter(merged)
    with torch.no_grad():
        for name, p in stacked.named_parameters():
            if "lora_B" in name:
                p.normal_()  # as if loaded from a DP run without its record
    with pytest.raises(PrivacyUsageError, match="merged adapter 'default'"):
        _private(_new_adapter(stacked.merge_and_unload()))


def test_the_longer_spending_link_wins_on_merge():
    """A layer trained with DP, then adapted with DP-LoRA (composing the first run), then merged:
    the merged layer carries the LoRA run's longer history."""
    base = _plain_model()
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD(base.parameters(), lr=0.1)
    base, opt, loader = engine.make_private(module=base, optimizer=opt, data_loader=DataLoader(TensorDataset(X, Y), batch_size=16),
                                            noise_multiplier=1.0, max_grad_norm=1.0, sample_seed=1)  # fmt: skip
    for _, (x, y) in zip(range(2), loader):
        F.cross_entropy(base(x), y).backward()
        opt.step()
        opt.zero_grad()
    engine.detach()
    lora = _new_adapter(base)
    second = _private(lora, steps=3)
    merged = lora.merge_and_unload()
    reused = nn.Sequential(OrderedDict(fc1=nn.Linear(6, 8), act=nn.ReLU(), fc2=merged.fc2))
    assert _private(_new_adapter(reused)).accountant.history == second.accountant.history


def test_a_replaced_layer_hands_on_its_mark():
    """Surgery (or any module replacement) keeps a merged layer's provenance on its replacement."""
    model = _new_adapter(_plain_model())
    with torch.no_grad():
        model.base_model.model.fc2.lora_B["default"].weight.normal_()
    merged = model.merge_and_unload()
    merged.fc2 = nn.Linear(8, 3)  # e.g. a converted layer with the same weights
    with pytest.raises(PrivacyUsageError, match="merged adapter 'default' in base_model.model.fc2"):
        _private(_new_adapter(merged))


def test_a_fresh_embedding_adapter_is_not_taken_for_a_trained_one():
    """PEFT starts an Embedding LoRA with lora_embedding_A = 0 (B random): fresh, it is not a
    trained adapter; with A no longer zero (trained, reloaded without a record), it is."""
    from dpzoo.integrations.peft_adapters import trained_adapters

    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(emb=nn.Embedding(10, 6), fc=nn.Linear(6, 3)))
    fresh = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["emb"]))
    assert trained_adapters(fresh) == []
    with torch.no_grad():
        fresh.base_model.model.emb.lora_embedding_A["default"].normal_()
    assert trained_adapters(fresh) == [("base_model.model.emb", "default")]


def test_dpzoo_save_refuses_a_model_with_an_adapter_of_unknown_origin_merged(tmp_path):
    zoo = dpzoo.load("mlp-tanh", in_features=6, num_classes=3, width=8)
    names = [n for n, m in zoo.named_modules() if isinstance(m, nn.Linear)]
    model = peft.get_peft_model(zoo, peft.LoraConfig(r=2, target_modules=names[:1]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_()
    merged = model.merge_and_unload()
    with pytest.raises(PrivacyUsageError, match="merged adapter 'default'"):
        dpzoo.save(merged, tmp_path / "m")
    assert not (tmp_path / "m").exists()
    merged.dpzoo_adapter_privacy = {}  # stated: trained on other data
    dpzoo.save(merged, tmp_path / "m")


def test_a_hugging_face_model_keeps_the_mark_through_save_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    lora = peft.get_peft_model(transformers.GPT2LMHeadModel(config), peft.LoraConfig(r=2, target_modules=["c_attn"]))
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_()  # an adapter trained elsewhere, loaded without its record
    lora.merge_and_unload().save_pretrained(tmp_path)
    assert "dpzoo_merged_adapters" in (tmp_path / "config.json").read_text()
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    with pytest.raises(PrivacyUsageError, match="merged adapter 'default' in base_model.model"):
        _private_lm(peft.get_peft_model(reloaded, peft.LoraConfig(r=2, target_modules=["c_attn"])))
    stated = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    stated.dpzoo_adapter_privacy = {}
    trained = peft.get_peft_model(stated, peft.LoraConfig(r=2, target_modules=["c_attn"]))
    _private_lm(trained)
    assert not hasattr(stated.config, "dpzoo_merged_adapters")  # consumed: this run's spending covers it now


def _private_lm(model):
    ids = torch.randint(0, 50, (32, 8))
    engine = dpzoo.PrivacyEngine()
    return engine.make_private(
        module=model,
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        data_loader=DataLoader(TensorDataset(ids), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        mode="lora",
    )


def _per_mechanism(history):
    """Steps per (σ, q): equal however the entries are split."""
    out: dict = {}
    for sigma, q, n, *k in history:
        out[(sigma, q, *k)] = out.get((sigma, q, *k), 0) + n
    return out


def test_a_statement_for_merged_adapters_adds_to_the_models_own_spending(saved_adapter):
    """The fifth audit: a record stated for a merged adapter replaced the model's own spending (a
    link, a loaded record) instead of adding to it; now both are composed, and `{}` for the adapter
    keeps the model's own history."""
    directory, _ = saved_adapter
    adapter = read_privacy_metadata(directory)["history"]
    lora = _new_adapter(_plain_model())
    own = _private(lora, steps=3)  # this process's run on the model: a link
    merged = peft.PeftModel.from_pretrained(lora.merge_and_unload(), _bare(directory)).merge_and_unload()
    merged.dpzoo_adapter_privacy = read_privacy_metadata(directory)
    history = _private(_new_adapter(merged)).accountant.history
    assert _per_mechanism(history) == _per_mechanism(own.accountant.history + adapter)  # both runs' steps
    for bad in (False, "disjoint", 0):
        other = peft.PeftModel.from_pretrained(_plain_model(), _bare(directory)).merge_and_unload()
        other.dpzoo_adapter_privacy = bad
        with pytest.raises(PrivacyUsageError, match="must be a privacy record"):
            _private(_new_adapter(other))


def test_an_adapter_loaded_over_one_dpzoo_trained_loses_its_link(saved_adapter):
    """load_adapter(dir, adapter_name="default") over an adapter this process trained replaces its
    weights: the engine's link no longer covers them, so they are of unknown origin."""
    directory, _ = saved_adapter
    model = _new_adapter(_plain_model())
    _private(model, steps=2)
    model.load_adapter(_bare(directory), adapter_name="default", is_trainable=True)
    with pytest.raises(PrivacyUsageError, match="adapter 'default'"):
        _private(model)


def test_a_weights_file_beside_a_hugging_face_record_is_refused(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    model.config.dpzoo_privacy = {"accountant": "rdp", "history": [[1.0, 0.2, 3]]}
    model.save_pretrained(tmp_path)
    with pytest.raises(dpzoo.DPZooError, match="pass the directory"):
        dpzoo.load(
            "gpt2",
            weights=tmp_path / "model.safetensors",
            vocab_size=50,
            n_positions=16,
            n_embd=16,
            n_layer=1,
            n_head=2,
        )


def test_a_weighted_combination_of_adapters_dpzoo_trained_keeps_their_spending():
    model = _new_adapter(_plain_model())
    first = _private(model, steps=2)
    model.add_weighted_adapter(["default"], [1.0], adapter_name="combo", combination_type="linear")
    model.set_adapter("combo")
    merged = model.merge_and_unload(adapter_names=["combo"])
    assert _private(_new_adapter(merged)).accountant.history == first.accountant.history


def _dp_trained_plain(steps, sigma=1.0):
    model = _plain_model()
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(X, Y), batch_size=16)
    model, opt, loader = engine.make_private(module=model, optimizer=opt, data_loader=loader, noise_multiplier=sigma,
                                             max_grad_norm=1.0, sample_seed=1)  # fmt: skip
    for _, (x, y) in zip(range(steps), loader):
        if len(y):
            F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    engine.detach()
    return model, engine


def test_two_runs_with_equal_histories_are_both_composed():
    """The sixth audit: records were told apart by value, so layers from two independent runs with
    the same σ, q and steps counted once. Links are told apart by their run now."""
    a, first = _dp_trained_plain(3)
    b, _ = _dp_trained_plain(3)
    both = nn.Sequential(OrderedDict(fc1=a.fc1, act=nn.ReLU(), fc2=b.fc2))
    assert _per_mechanism(_private(_new_adapter(both)).accountant.history) == _per_mechanism(
        first.accountant.history * 2
    )


def test_a_live_engine_does_not_hide_a_layer_from_another_run():
    model, _ = _dp_trained_plain(2)
    again = dpzoo.PrivacyEngine()  # alive: its history was the only one taken before
    again.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                       data_loader=DataLoader(TensorDataset(X, Y), batch_size=16), noise_multiplier=1.0,
                       max_grad_norm=1.0)  # fmt: skip
    again.detach()
    other, second = _dp_trained_plain(3, sigma=2.0)
    model.fc2 = other.fc2
    history = _private(_new_adapter(model)).accountant.history
    assert second.accountant.history[0] in history and len(history) == 2


def test_a_combination_with_an_adapter_of_unknown_origin_keeps_both_parts(saved_adapter):
    directory, _ = saved_adapter
    model = _new_adapter(_plain_model())
    own = _private(model, steps=3)
    model.load_adapter(_bare(directory), adapter_name="ext")
    model.add_weighted_adapter(["default", "ext"], [1.0, 1.0], adapter_name="combo", combination_type="cat")
    model.set_adapter("combo")
    merged = model.merge_and_unload(adapter_names=["combo"])
    with pytest.raises(PrivacyUsageError, match="merged adapter 'combo'"):
        _private(_new_adapter(merged))
    merged.dpzoo_adapter_privacy = read_privacy_metadata(directory)
    history = _private(_new_adapter(merged)).accountant.history
    assert _per_mechanism(history) == _per_mechanism(
        own.accountant.history + read_privacy_metadata(directory)["history"]
    )


def test_other_tuner_families_trained_elsewhere_are_refused_unmerged():
    loha = peft.get_peft_model(_plain_model(), peft.LoHaConfig(r=2, target_modules=["fc1"], modules_to_save=["fc2"]))
    with torch.no_grad():
        for name, p in loha.named_parameters():
            if "hada_w2_b" in name:
                p.normal_()  # trained elsewhere, loaded without a record
    with pytest.raises(PrivacyUsageError, match="adapter 'default' in base_model.model.fc1"):
        _private(loha)


def test_a_hot_swapped_adapter_loses_the_link(saved_adapter, tmp_path):
    from peft.utils.hotswap import hotswap_adapter

    directory, _ = saved_adapter
    model = _new_adapter(_plain_model())
    _private(model, steps=2)
    hotswap_adapter(model, str(_bare(directory)), adapter_name="default")
    with pytest.raises(PrivacyUsageError, match="adapter 'default'"):
        _private(model)


def test_a_resume_marks_only_the_adapters_it_restored(saved_adapter):
    from dpzoo.integrations.peft_adapters import mark_resumed

    directory, _ = saved_adapter
    model = _new_adapter(_plain_model())
    model.load_adapter(_bare(directory), adapter_name="ext")
    with torch.no_grad():
        model.base_model.model.fc1.lora_B["default"].weight.normal_()  # as restored from a checkpoint
    mark_resumed(model, "checkpoint-2")
    from dpzoo.integrations.peft_adapters import trained_adapters

    assert {a for _, a in trained_adapters(model)} == {"ext"}


def test_engine_load_state_dict_composes_after_what_the_model_carries():
    """The seventh audit: engine.load_state_dict replaced the history make_private had composed (a
    layer from another run in the model); it now composes after it, as the optimizer's does."""
    a, first = _dp_trained_plain(3)
    state = first.state_dict()
    b, second = _dp_trained_plain(4, sigma=0.8)
    resumed = _plain_model()
    resumed.load_state_dict(a.state_dict())
    resumed.fc2 = b.fc2
    engine = dpzoo.PrivacyEngine()
    engine.make_private(module=resumed, optimizer=torch.optim.SGD(resumed.parameters(), lr=0.1),
                        data_loader=DataLoader(TensorDataset(X, Y), batch_size=16), noise_multiplier=1.0,
                        max_grad_norm=1.0)  # fmt: skip
    engine.load_state_dict(state)
    assert engine.accountant.history == second.accountant.history + first.accountant.history


def test_two_reloaded_hugging_face_models_carry_both_records(tmp_path):
    transformers = pytest.importorskip("transformers")
    from dpzoo.privacy.budget import prior_spending

    histories = {"a": [[1.0, 0.25, 3]], "b": [[2.0, 0.25, 2]]}
    for name, history in histories.items():
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2)
        )
        model.config.dpzoo_privacy = {"accountant": "rdp", "history": history}
        model.save_pretrained(tmp_path / name)
    both = nn.ModuleList([transformers.GPT2LMHeadModel.from_pretrained(tmp_path / n) for n in histories])
    assert sorted(prior_spending(both)) == sorted(histories["a"] + histories["b"])
