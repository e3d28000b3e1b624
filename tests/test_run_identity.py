"""Runs are told apart by identity, never by equal values (:mod:`dpzoo.privacy.provenance`).

Found by the seventh independent audit, each silent (ε too small):

* records saved to disk carried no run id, so two independent saved runs with equal histories
  counted once;
* a ``copy.deepcopy`` shared the original's spending link: a copy trained by another engine while
  the original went on re-pointed the original's link to the copy's run;
* an optimizer checkpoint whose history happened to begin with what the model carried was taken
  as its continuation.

And one conservative double count made exact: a model copied through ``save_pretrained``, trained
on, and recombined with the original counted the first run twice.

Found by the eighth, on the first version of this (each silent): a config object two models share;
an EMA copy whose original was retrained on data stated disjoint; ``dpzoo.save`` after the engine
was gone, or of Opacus' record after a dpzoo run; segments left stale by the user's
``accountant.load_state_dict``; one accountant continued as two copies; a new release (a DP-FROST
selection) taken for the checkpoint's by value; an EMA of a copy that a new engine trains; and an
anonymous record matched across two runs' steps.

Found by the ninth, on the second version (each silent): the ``{}`` statement outlived its run
and erased the earlier run from the model for good; an EMA's ``save_pretrained`` wrote the record
frozen at the copy; a stale ``dpzoo_privacy.json`` hid the newer ``config.json`` beside it; Opacus'
steps were not in ``save_pretrained``'s record; a stated record was dropped again in calibration;
Opacus' record put its segments out of order. And two false refusals: a linear probe's record on
the frozen backbone's config, a DPTrainer on a copy detaching the original's engine.

Found by the tenth, on the third version (each silent): Opacus on a reloaded model replaced the
record it was loaded with; Opacus on a model sharing its config; ``{}`` on a ``dpzoo.load``-ed
model overwrote the loaded record; a stated adapter record lost its ``disjoint_spending``;
``from_pretrained(dir, config=...)`` dropped the record in ``dir/config.json``; ``{}`` outlived an
Opacus run. And false refusals: ``dpzoo.save`` after Opacus on a loaded model, the Trainer's
``create_model_card`` over dpzoo's card, a shallow ``copy.copy(config)``.

Found by the eleventh, on the fourth version (silent): a layer taken out of a ``dpzoo.load``-ed
model lost the record; the live config record belonged to the innermost module with the config
(GPT-2's attention), so a run on the LM head alone was not saved; Opacus' ``privacy_metadata``
missed a dpzoo run between two of its ``make_private`` calls. And false refusals: two
``make_private`` calls on one Opacus engine, a run on an LM's body after a head probe.

Found by the twelfth, on the fifth version (silent): a record without a run id composed by a run
was dropped again as if it were that run's own steps; ``save_pretrained`` of a model no run wrapped
as a whole (its head trained alone, the body of an LM that is gone, an EMA copy of the body) wrote
none of its steps; a DPTrainer that trained nothing wrote the reloaded directory's stale record.
And a false refusal: Opacus' record of a noise schedule could not be saved.

Found by the thirteenth (silent): a deep-copied or pickled Opacus accountant kept its run id, so
two branches of one Opacus run counted as one (Opacus' accountants are now named by identity: a
copy is another run; conservative, it counts the steps before the copy twice).

Found by the fourteenth (silent): a LoRA adapter Opacus trained on a DP-trained base lost Opacus'
steps when merged (the longer link won the base layer); ``dpzoo.save``'s ``config.json`` dropped
the spending a run on data stated disjoint kept.
"""

from __future__ import annotations

import copy
import gc
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.errors import PrivacyUsageError
from dpzoo.integrations.trainer_save import write_privacy_files
from dpzoo.privacy.accounting.accountant import Accountant
from dpzoo.privacy.budget import prior_spending

GEN = torch.Generator().manual_seed(0)
IDS, Y = torch.randint(1, 40, (64, 5), generator=GEN), torch.randint(0, 3, (64,), generator=GEN)
DATA = TensorDataset(IDS, Y)


class _Classifier(nn.Module):
    def __init__(self, backbone):
        super().__init__()
        self.backbone, self.head = backbone, nn.Linear(16, 3)

    def forward(self, ids):
        return self.head(self.backbone(input_ids=ids).last_hidden_state[:, -1])


class _Two(nn.Module):
    """Two DP-trained backbones in one model (an ensemble, a merge of two runs' layers)."""

    def __init__(self, a, b):
        super().__init__()
        self.a, self.b, self.head = a, b, nn.Linear(32, 3)

    def forward(self, ids):
        h = [m(input_ids=ids).last_hidden_state[:, -1] for m in (self.a, self.b)]
        return self.head(torch.cat(h, -1))


def _backbone(seed=0):
    torch.manual_seed(seed)
    return transformers.GPT2Model(transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=8))


def _make(model, sigma=1.0):
    engine = dpzoo.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
            data_loader=DataLoader(DATA, batch_size=16),
            noise_multiplier=sigma,
            max_grad_norm=1.0,
            self_check=False,
            target_delta=1e-5,
        )
    return engine, opt, loader


def _steps(model, opt, loader, n):
    """``n`` DP steps (over as many epochs of the Poisson loader as they take)."""
    while n > 0:
        for x, y in loader:
            if n == 0:
                break
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            n -= 1


def _train(model, n, sigma=1.0):
    engine, opt, loader = _make(model, sigma)
    _steps(model, opt, loader, n)
    return engine


def _prior(model):
    """The history a new engine on ``model`` composes before its own steps."""
    engine = _make(model)[0]
    engine.detach()
    return [list(h) for h in engine.accountant.history]


def _count(history):
    return sum(h[2] for h in history)


def test_two_saved_runs_with_equal_histories_both_count(tmp_path):
    for name, seed in (("one", 0), ("two", 1)):
        clf = _Classifier(_backbone(seed))
        _train(clf, 3).detach()
        clf.backbone.save_pretrained(tmp_path / name)
    a, b = (transformers.GPT2Model.from_pretrained(tmp_path / name) for name in ("one", "two"))
    assert a.config.dpzoo_privacy["history"] == b.config.dpzoo_privacy["history"] == [[1.0, 0.25, 3]]
    assert _count(_prior(_Two(a, b))) == 6  # two runs on the same data: 3 + 3, not 3


def test_a_saved_copy_trained_on_and_recombined_counts_each_step_once(tmp_path):
    original = _Classifier(_backbone())
    engine, opt, loader = _make(original)
    _steps(original, opt, loader, 3)
    original.backbone.save_pretrained(tmp_path / "at3")
    _steps(original, opt, loader, 2)  # the original goes on: 5 steps of its run
    copy_clf = _Classifier(transformers.GPT2Model.from_pretrained(tmp_path / "at3"))
    _train(copy_clf, 1, sigma=2.0).detach()  # the copy: its 3 steps, then 1 of its own
    engine.detach()
    both = _prior(_Two(original.backbone, copy_clf.backbone))
    assert sorted(both) == [[1.0, 0.25, 5], [2.0, 0.25, 1]]  # the first run's 5 steps once, and the copy's 1


def test_a_deep_copy_trained_by_another_engine_leaves_the_original_its_own_run():
    original = _Classifier(_backbone())
    engine, opt, loader = _make(original)
    _steps(original, opt, loader, 3)
    twin = copy.deepcopy(original)
    _train(twin, 1, sigma=2.0).detach()  # the copy's run composes the first 3 steps
    _steps(original, opt, loader, 4)  # the original goes on with its own engine: 7 steps
    engine.detach()
    assert _count(_prior(original)) == 7  # its own run, not the copy's 3 + 1
    assert _count(_prior(twin)) == 4
    assert _count(_prior(_Two(original.backbone, twin.backbone))) == 7 + 1  # the first 3 steps once


def test_a_deep_copy_follows_the_original_until_it_is_trained_itself():
    original = _Classifier(_backbone())
    first = _train(original, 2)
    ema = copy.deepcopy(original)  # an EMA / SWA copy: averages iterates that go on spending
    first.detach()
    _train(original, 3, sigma=2.0).detach()  # a later engine on the original: the copy follows
    assert _count(_prior(ema)) == 5


def test_a_checkpoint_whose_history_equals_the_models_record_is_another_run(tmp_path):
    clf = _Classifier(_backbone())
    _train(clf, 3).detach()
    clf.backbone.save_pretrained(tmp_path / "x")  # run X: [1.0, 0.25, 3]
    other = _Classifier(_backbone(1))
    engine_y, opt_y, loader_y = _make(other)
    _steps(other, opt_y, loader_y, 3)  # run Y, unrelated, with the same history
    checkpoint = opt_y.state_dict()
    reloaded = _Classifier(transformers.GPT2Model.from_pretrained(tmp_path / "x"))
    engine, opt, _ = _make(reloaded)
    assert engine.accountant.history == [[1.0, 0.25, 3]]
    opt.load_state_dict(checkpoint)
    assert _count(engine.accountant.history) == 6  # X's and Y's, not Y's taken as X's continuation


def test_resuming_the_models_own_run_counts_it_once(tmp_path):
    clf = _Classifier(_backbone())
    engine_x, opt_x, loader_x = _make(clf)
    _steps(clf, opt_x, loader_x, 3)
    checkpoint = {"engine": engine_x.state_dict(), "optimizer": opt_x.state_dict()}
    clf.backbone.save_pretrained(tmp_path / "x")
    reloaded = _Classifier(transformers.GPT2Model.from_pretrained(tmp_path / "x"))
    reloaded.head.load_state_dict(clf.head.state_dict())
    engine, opt, loader = _make(reloaded)
    engine.load_state_dict(checkpoint["engine"])  # then the optimizer's: the same run, restored twice
    opt.load_state_dict(checkpoint["optimizer"])
    assert engine.accountant.history == [[1.0, 0.25, 3]]
    _steps(reloaded, opt, loader, 2)
    assert engine.accountant.history == [[1.0, 0.25, 5]]


def test_a_run_id_travels_in_every_record(tmp_path):
    clf = _Classifier(_backbone())
    engine = _train(clf, 2)
    meta = engine.privacy_metadata()
    assert meta["run_id"] == engine.accountant.state_dict()["run_id"]
    assert clf.backbone.config.dpzoo_privacy["composed_runs"] == [[meta["run_id"], 2]]  # what save_pretrained writes
    assert meta["composed_runs"] == []
    engine.detach()
    later = _train(clf, 1)
    assert later.privacy_metadata()["composed_runs"] == [[meta["run_id"], 2]]
    saved = later.state_dict()["accountant"]
    assert saved["run_id"] == later.privacy_metadata()["run_id"] != meta["run_id"]
    assert saved["composed_runs"] == [[meta["run_id"], 2]] and saved["history"] == [[1.0, 0.25, 3]]


def test_a_model_pickled_with_the_hooks_attached_loads_and_keeps_its_run(tmp_path):
    original = _Classifier(_backbone())
    engine, opt, loader = _make(original)
    _steps(original, opt, loader, 2)
    torch.save(original, tmp_path / "model.pt")  # the hooks attached: they load as hooks that do nothing
    _steps(original, opt, loader, 1)
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    original.eval(), loaded.eval()
    with torch.no_grad():
        assert not torch.equal(original(IDS[:4]), loaded(IDS[:4]))  # the original stepped on
    engine.detach()
    assert _count(_prior(loaded)) == 2
    assert _count(_prior(_Two(original.backbone, loaded.backbone))) == 3  # one run: its 3 steps, once


def test_a_config_object_two_models_share_is_refused():
    config = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=8)
    a, b = _Classifier(transformers.GPT2Model(config)), _Classifier(transformers.GPT2Model(config))
    _train(a, 2).detach()
    b.dpzoo_privacy = {}  # stated disjoint: it would have overwritten a's record on the shared config
    with pytest.raises(PrivacyUsageError, match="config object is shared"):
        _make(b)
    _train(_Classifier(transformers.GPT2Model(copy.deepcopy(config))), 1)  # its own config: fine


def test_an_ema_copy_keeps_the_run_it_averaged_when_the_original_is_retrained_on_other_data():
    original = _Classifier(_backbone())
    first = _train(original, 6)
    ema = copy.deepcopy(original)
    first.detach()
    original.dpzoo_privacy = {}  # the next run's data is disjoint from the first's
    _train(original, 2, sigma=3.0).detach()
    assert sorted(_prior(ema)) == [[1.0, 0.25, 6], [3.0, 0.25, 2]]  # the first run's steps stay


def test_an_ema_of_a_copy_follows_the_engine_that_trains_the_copy():
    first = _Classifier(_backbone())
    _train(first, 3).detach()
    twin = copy.deepcopy(first)
    ema = copy.deepcopy(twin)
    _train(twin, 5, sigma=2.0).detach()
    assert _prior(ema) == [[1.0, 0.25, 3], [2.0, 0.25, 5]]


def test_saving_a_model_whose_spending_the_record_leaves_out_is_refused(tmp_path):
    model = dpzoo.load("mlp-tanh", **dpzoo.model_card("mlp-tanh").test_overrides)
    card = dpzoo.model_card("mlp-tanh")
    data = TensorDataset(torch.randn(64, *card.example_input["shape"]), torch.randint(0, 2, (64,)))
    engine = dpzoo.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                 data_loader=DataLoader(data, batch_size=16), noise_multiplier=1.0,
                                                 max_grad_norm=1.0, target_delta=1e-5, self_check=False)  # fmt: skip
    _steps(model, opt, loader, 3)
    record = engine.privacy_metadata()
    engine.detach()
    del engine, opt, loader  # gone (a training function that returns only the model)
    gc.collect()
    with pytest.raises(PrivacyUsageError, match="3 DP step"):
        dpzoo.save(model, tmp_path / "none")  # no record would be written
    short = {**record, "history": [[1.0, 0.25, 1]], "steps": 1, "run_id": "another"}
    with pytest.raises(PrivacyUsageError, match="carries 3 DP step"):
        dpzoo.save(model, tmp_path / "short", privacy=short)
    dpzoo.save(model, tmp_path / "full", privacy=record)
    assert prior_spending(dpzoo.load(tmp_path / "full")) == [[1.0, 0.25, 3]]


def test_the_users_load_state_dict_of_its_own_state_keeps_its_run():
    clf = _Classifier(_backbone())
    engine, opt, loader = _make(clf)
    _steps(clf, opt, loader, 2)
    mine = engine.accountant.state_dict()
    other = _Classifier(_backbone(1))
    engine_y, opt_y, loader_y = _make(other, sigma=2.0)
    _steps(other, opt_y, loader_y, 3)
    opt.load_state_dict(opt_y.state_dict())
    engine.accountant.load_state_dict(mine)  # undone by hand
    _steps(clf, opt, loader, 3)
    engine.detach(), engine_y.detach()
    _steps(other, *_make(other, sigma=2.0)[1:], 10)
    both = _prior(_Two(clf.backbone, other.backbone))
    assert sorted(both) == [[1.0, 0.25, 5], [2.0, 0.25, 13]]


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_an_accountant_continued_as_two_copies_counts_both(how):
    base = _Classifier(_backbone())
    engine = _train(base, 3)
    engine.accountant.state_dict()  # the run gets its id
    engine.detach()
    branches = []
    for n in (2, 6):
        acc = copy.deepcopy(engine.accountant) if how == "deepcopy" else pickle.loads(pickle.dumps(engine.accountant))
        branch = copy.deepcopy(base)
        e = dpzoo.PrivacyEngine(accountant=acc)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            branch, opt, loader = e.make_private(module=branch, optimizer=torch.optim.SGD(branch.parameters(), lr=0.1),
                                                 data_loader=DataLoader(DATA, batch_size=16), noise_multiplier=1.0,
                                                 max_grad_norm=1.0, self_check=False, target_delta=1e-5)  # fmt: skip
        _steps(branch, opt, loader, n)
        e.detach()
        branches.append(branch)
    assert _count(_prior(_Two(branches[0].backbone, branches[1].backbone))) == 3 + 2 + 6


def test_a_release_recorded_before_a_restore_counts_even_when_it_equals_the_checkpoints_beginning():
    clf = _Classifier(_backbone())
    engine = dpzoo.PrivacyEngine(accountant=Accountant("rdp", [[2.0, 0.1, 5]]))  # e.g. a new DP-FROST selection
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine.make_private(module=clf, optimizer=torch.optim.SGD(clf.parameters(), lr=0.1),
                            data_loader=DataLoader(DATA, batch_size=16), noise_multiplier=1.0, max_grad_norm=1.0,
                            self_check=False, target_delta=1e-5)  # fmt: skip
    checkpoint = {"accountant": {"name": "rdp", "history": [[2.0, 0.1, 5], [1.0, 0.25, 3]], "run_id": "earlier"}}
    engine.load_state_dict(checkpoint)  # the earlier process's selection was another release
    assert _count(engine.accountant.history) == 5 + 5 + 3


def test_reusing_an_accountant_on_the_model_it_trained_counts_its_steps_once():
    clf = _Classifier(_backbone())
    first = _train(clf, 3)
    first.detach()
    again = dpzoo.PrivacyEngine(accountant=first.accountant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again.make_private(module=clf, optimizer=torch.optim.SGD(clf.parameters(), lr=0.1),
                           data_loader=DataLoader(DATA, batch_size=16), noise_multiplier=1.0, max_grad_norm=1.0,
                           self_check=False, target_delta=1e-5)  # fmt: skip
    assert again.accountant.history == [[1.0, 0.25, 3]]


def test_a_record_without_a_run_id_is_not_matched_across_two_runs_steps():
    a, b = _Classifier(_backbone()), _Classifier(_backbone(1))
    _train(a, 3).detach()
    _train(b, 2, sigma=2.0).detach()
    legacy = _Classifier(_backbone(2))
    legacy.dpzoo_privacy = {"history": [[1.0, 0.25, 3], [2.0, 0.25, 2]]}  # an older record: no run id
    both = nn.ModuleList([a, b, legacy])
    assert _count(prior_spending(both)) == 3 + 2 + 5


def test_the_disjoint_statement_is_for_one_run_and_keeps_the_earlier_run_for_later_ones(tmp_path):
    clf = _Classifier(_backbone())
    _train(clf, 4).detach()  # run A, on D1
    clf.dpzoo_privacy = {}  # run B's data, D2, is disjoint from D1
    second = _train(clf, 1, sigma=3.0)
    second.detach()
    assert second.accountant.history == [[3.0, 0.25, 1]]
    assert "dpzoo_privacy" not in clf.__dict__  # the statement was for that run
    later = _prior(clf)  # run C, on D1 or D2: both runs are composed
    assert sorted(later) == [[1.0, 0.25, 4], [3.0, 0.25, 1]]
    clf.backbone.save_pretrained(tmp_path / "after")
    again = _Classifier(transformers.GPT2Model.from_pretrained(tmp_path / "after"))
    assert _count(_prior(again)) == 5  # the saved record keeps both runs too


def test_an_ema_copys_save_pretrained_writes_its_spending_then(tmp_path):
    original = _Classifier(_backbone())
    engine, opt, loader = _make(original)
    _steps(original, opt, loader, 2)
    ema = torch.optim.swa_utils.AveragedModel(original)
    for _ in range(3):
        _steps(original, opt, loader, 1)
        ema.update_parameters(original)
    ema.module.backbone.save_pretrained(tmp_path / "ema")
    engine.detach()
    assert _prior(_Classifier(transformers.GPT2Model.from_pretrained(tmp_path / "ema"))) == [[1.0, 0.25, 5]]


def test_a_stale_privacy_file_beside_a_newer_config_counts_the_newer_steps(tmp_path):
    clf = _Classifier(_backbone())
    engine, opt, loader = _make(clf)
    _steps(clf, opt, loader, 2)
    clf.backbone.save_pretrained(tmp_path / "d")
    write_privacy_files(clf.backbone, tmp_path / "d", engine.privacy_metadata(), zoo_files=False)
    _steps(clf, opt, loader, 3)
    clf.backbone.save_pretrained(tmp_path / "d")  # config.json now holds 5 steps, dpzoo_privacy.json 2
    engine.detach()
    assert _prior(_Classifier(transformers.GPT2Model.from_pretrained(tmp_path / "d"))) == [[1.0, 0.25, 5]]


def test_a_stated_record_equal_to_a_carried_run_is_added_not_dropped():
    clf = _Classifier(_backbone())
    _train(clf, 3).detach()
    clf.head.dpzoo_adapter_privacy = {"history": [[1.0, 0.25, 3]]}  # an older record: no run id
    assert _count(_make(clf)[0].accountant.history) == 6


def test_a_probe_on_a_frozen_backbone_leaves_the_backbone_free():
    backbone = _backbone()
    backbone.requires_grad_(False)
    _train(_Classifier(backbone), 2).detach()  # a linear probe: the backbone spent nothing
    assert not hasattr(backbone.config, "dpzoo_privacy")
    backbone.requires_grad_(True)
    _make(_Classifier(backbone))  # fine-tuning it under a new head: not a shared config


@pytest.fixture()
def opacus_model():
    opacus = pytest.importorskip("opacus")
    clf = _Classifier(_backbone())
    clf.backbone.wpe.requires_grad_(False)  # Opacus' embedding rule does not take GPT-2's position ids
    return opacus, clf


def _opacus_steps(opacus, clf, n, sigma=0.8):
    from dpzoo.engines.opacus import make_private

    engine = opacus.PrivacyEngine(accountant="rdp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = make_private(engine, module=clf, optimizer=torch.optim.SGD(
            [p for p in clf.parameters() if p.requires_grad], lr=0.1), data_loader=DataLoader(DATA, batch_size=16),
            noise_multiplier=sigma, max_grad_norm=1.0)  # fmt: skip
    _steps(model, opt, loader, n)
    return engine, opt, loader


def test_opacus_steps_after_a_dpzoo_run_are_in_save_pretrained_and_in_order(opacus_model, tmp_path):
    from dpzoo.integrations.opacus import privacy_metadata
    from dpzoo.privacy.carried import record_parts

    opacus, clf = opacus_model
    clf.head.dpzoo_privacy = {"history": [[2.0, 0.25, 2]]}  # an older record without a run id
    _train(clf, 3).detach()
    engine, opt, loader = _opacus_steps(opacus, clf, 4)
    clf.backbone.save_pretrained(tmp_path / "o")
    reloaded = _Classifier(transformers.GPT2Model.from_pretrained(tmp_path / "o"))
    assert _per_mechanism(_prior(reloaded)) == {(2.0, 0.25): 2, (1.0, 0.25): 3, (0.8, 0.25): 4}
    meta = privacy_metadata(engine, 1e-5, optimizer=opt, data_loader=loader)
    alone = [h for _, _, history in record_parts(meta) for h in history]
    assert _per_mechanism(alone) == {(2.0, 0.25): 2, (1.0, 0.25): 3, (0.8, 0.25): 4}  # read alone: every step
    assert meta["steps"] == 9


def _per_mechanism(history):
    out: dict = {}
    for sigma, q, n, *k in history:
        out[(sigma, q, *k)] = out.get((sigma, q, *k), 0) + n
    return out


def _zoo_mlp():
    card = dpzoo.model_card("mlp-tanh")
    data = TensorDataset(torch.randn(64, *card.example_input["shape"]), torch.randint(0, 2, (64,)))
    return dpzoo.load("mlp-tanh", **card.test_overrides), data


def _train_zoo(model, data, n, sigma=1.0):
    engine = dpzoo.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                 data_loader=DataLoader(data, batch_size=16), noise_multiplier=sigma,
                                                 max_grad_norm=1.0, target_delta=1e-5, self_check=False)  # fmt: skip
    _steps(model, opt, loader, n)
    return engine


def test_opacus_on_a_reloaded_model_keeps_the_record_it_was_loaded_with(opacus_model, tmp_path):
    from dpzoo.integrations.opacus import privacy_metadata

    opacus, clf = opacus_model
    _train(clf, 3).detach()
    clf.backbone.save_pretrained(tmp_path / "a")
    reloaded = _Classifier(transformers.GPT2Model.from_pretrained(tmp_path / "a")).train()  # (Opacus: train mode)
    reloaded.backbone.wpe.requires_grad_(False)
    engine, opt, loader = _opacus_steps(opacus, reloaded, 2, sigma=3.0)
    assert _per_mechanism(prior_spending(reloaded)) == {(1.0, 0.25): 3, (3.0, 0.25): 2}
    assert privacy_metadata(engine, 1e-5, optimizer=opt, data_loader=loader)["steps"] == 5
    reloaded.backbone.save_pretrained(tmp_path / "b")
    again = _Classifier(transformers.GPT2Model.from_pretrained(tmp_path / "b"))
    assert _per_mechanism(_prior(again)) == {(1.0, 0.25): 3, (3.0, 0.25): 2}


def test_opacus_on_a_model_sharing_its_config_is_refused(opacus_model):
    opacus, _ = opacus_model
    config = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=8)
    a, b = _Classifier(transformers.GPT2Model(config)), _Classifier(transformers.GPT2Model(config))
    _train(a, 2).detach()
    b.backbone.wpe.requires_grad_(False)
    with pytest.raises(PrivacyUsageError, match="config object is shared"):
        _opacus_steps(opacus, b, 1)


def test_opacus_clears_the_disjoint_statement_it_was_made_for(opacus_model):
    opacus, clf = opacus_model
    _train(clf, 2).detach()
    clf.dpzoo_privacy = {}
    _opacus_steps(opacus, clf, 3)
    assert "dpzoo_privacy" not in clf.__dict__
    assert _per_mechanism(_prior(clf)) == {(1.0, 0.25): 2, (0.8, 0.25): 3}


def test_a_disjoint_run_on_a_loaded_model_keeps_the_loaded_record(tmp_path):
    model, data = _zoo_mlp()
    _train_zoo(model, data, 5, sigma=0.8).detach()
    dpzoo.save(model, tmp_path / "a")
    loaded = dpzoo.load(tmp_path / "a")
    loaded.dpzoo_privacy = {}  # run B's data is disjoint: it replaces the attribute dpzoo.load set
    b = _train_zoo(loaded, data, 2, sigma=2.0)
    record = b.privacy_metadata()
    assert record["history"] == [[2.0, 0.25, 2]] and record["disjoint_spending"]["history"] == [[0.8, 0.25, 5]]
    b.detach()
    dpzoo.save(loaded, tmp_path / "b", privacy=record)
    assert _per_mechanism(prior_spending(dpzoo.load(tmp_path / "b"))) == {(0.8, 0.25): 5, (2.0, 0.25): 2}
    head = nn.Linear(2, 2)
    head.dpzoo_adapter_privacy = dpzoo.privacy_metadata(tmp_path / "b")  # stated: its disjoint part too
    assert _count(prior_spending(head)) == 7


def test_a_config_given_to_from_pretrained_keeps_the_directorys_record(tmp_path):
    clf = _Classifier(_backbone())
    _train(clf, 3).detach()
    clf.backbone.save_pretrained(tmp_path / "a")
    config = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=8, resid_pdrop=0.0)
    reloaded = transformers.GPT2Model.from_pretrained(tmp_path / "a", config=config)
    assert _prior(_Classifier(reloaded)) == [[1.0, 0.25, 3]]


def test_dpzoo_save_after_opacus_on_a_loaded_model_counts_both(tmp_path):
    opacus = pytest.importorskip("opacus")
    from dpzoo.engines.opacus import make_private
    from dpzoo.integrations.opacus import privacy_metadata, unwrap

    model, data = _zoo_mlp()
    _train_zoo(model, data, 3).detach()
    dpzoo.save(model, tmp_path / "a")
    loaded = dpzoo.load(tmp_path / "a")
    engine = opacus.PrivacyEngine(accountant="rdp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped, opt, loader = make_private(engine, module=loaded, optimizer=torch.optim.SGD(loaded.parameters(),
                                            lr=0.1), data_loader=DataLoader(data, batch_size=16), noise_multiplier=0.8,
                                            max_grad_norm=1.0)  # fmt: skip
    _steps(wrapped, opt, loader, 4)
    meta = privacy_metadata(engine, 1e-5, optimizer=opt, data_loader=loader)
    dpzoo.save(unwrap(wrapped), tmp_path / "b", privacy=meta)
    assert _per_mechanism(prior_spending(dpzoo.load(tmp_path / "b"))) == {(1.0, 0.25): 3, (0.8, 0.25): 4}


def test_a_shallow_copy_of_a_config_is_not_a_shared_config():
    clf = _Classifier(_backbone())
    _train(clf, 2).detach()
    fresh = _Classifier(transformers.GPT2Model(copy.copy(clf.backbone.config)))
    assert _prior(fresh) == []  # its weights spent nothing


def test_a_deep_copys_record_outlives_the_copy():
    clf = _Classifier(_backbone())
    _train(clf, 2).detach()
    config = copy.deepcopy(clf).backbone.config  # the copied model is gone at once
    gc.collect()
    assert config.dpzoo_privacy["history"] == [[1.0, 0.25, 2]]


def test_a_layer_of_a_loaded_model_keeps_the_record(tmp_path):
    model, data = _zoo_mlp()
    _train_zoo(model, data, 5, sigma=0.8).detach()
    dpzoo.save(model, tmp_path / "a")
    loaded = dpzoo.load(tmp_path / "a")
    reused = nn.Sequential(loaded.features, nn.Linear(loaded.classifier.in_features, 2))
    assert _per_mechanism(prior_spending(reused)) == {(0.8, 0.25): 5}


def _lm_and_probe_data():
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=8, tie_word_embeddings=False)
    )

    class _Last(nn.Module):  # the LM's logits at the last position, as a 40-way classifier
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, ids):
            return self.inner(input_ids=ids).logits[:, -1]

    return lm, _Last


def test_a_run_on_the_lm_head_alone_is_in_the_lms_saved_record(tmp_path):
    lm, last = _lm_and_probe_data()
    _train(last(lm), 3, sigma=0.8).detach()  # the whole LM
    with torch.no_grad():
        features = lm.transformer(input_ids=IDS).last_hidden_state[:, -1]
    head = lm.lm_head
    engine = dpzoo.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        head, opt, loader = engine.make_private(module=head, optimizer=torch.optim.SGD(head.parameters(), lr=0.1),
                                                data_loader=DataLoader(TensorDataset(features, Y), batch_size=16),
                                                noise_multiplier=2.0, max_grad_norm=1.0, self_check=False,
                                                target_delta=1e-5)  # fmt: skip
    _steps(head, opt, loader, 2)
    engine.detach()
    lm.save_pretrained(tmp_path / "lm")
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "lm")
    assert _per_mechanism(prior_spending(reloaded)) == {(0.8, 0.25): 3, (2.0, 0.25): 2}
    _make(_Classifier(lm.transformer))[0].detach()  # the body under a new head: one model, not a shared config


def test_opacus_metadata_counts_a_dpzoo_run_between_two_make_private_calls(opacus_model):
    from dpzoo.engines.opacus import make_private
    from dpzoo.integrations.opacus import privacy_metadata

    opacus, clf = opacus_model
    engine = opacus.PrivacyEngine(accountant="rdp")
    phases = []
    for n in (1, 3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt, loader = make_private(engine, module=clf, optimizer=torch.optim.SGD(
                [p for p in clf.parameters() if p.requires_grad], lr=0.1), data_loader=DataLoader(DATA, batch_size=16),
                noise_multiplier=0.8, max_grad_norm=1.0)  # fmt: skip
        _steps(model, opt, loader, n)
        clf = model.to_standard_module()
        for p in clf.parameters():
            p.grad = None
        phases.append((opt, loader))
        if n == 1:
            _train(clf, 2, sigma=2.0).detach()  # a dpzoo run between the two
    meta = privacy_metadata(engine, 1e-5, optimizer=phases[-1][0], data_loader=phases[-1][1])
    assert _per_mechanism(meta["history"]) == {(0.8, 0.25): 4, (2.0, 0.25): 2} and meta["steps"] == 6


def test_an_anonymous_record_a_run_composed_stays_apart_from_that_runs_steps(tmp_path):
    model, data = _zoo_mlp()
    dpzoo.save(model, tmp_path / "a", privacy={"epsilon": 1.0, "delta": 1e-5, "accountant": "rdp", "steps": 3,
                                               "sample_rate": 0.25, "noise_multiplier": 1.0})  # fmt: skip
    loaded = dpzoo.load(tmp_path / "a")
    b = _train_zoo(loaded, data, 5)  # the same σ and q: its own 5 steps look like the record's 3
    assert _count(b.accountant.history) == 8
    record = b.privacy_metadata()
    b.detach()
    dpzoo.save(loaded, tmp_path / "b", privacy=record)
    assert _count(prior_spending(dpzoo.load(tmp_path / "b"))) == 8


def test_save_pretrained_of_a_model_whose_head_alone_was_trained_holds_its_steps(tmp_path):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=40, n_embd=16, n_layer=1, n_head=2, n_positions=8, num_labels=3,
                                     pad_token_id=0)  # fmt: skip
    seq = transformers.GPT2ForSequenceClassification(config)
    with torch.no_grad():
        features = seq.transformer(input_ids=IDS).last_hidden_state[:, -1]
    engine = dpzoo.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        head, opt, loader = engine.make_private(module=seq.score, optimizer=torch.optim.SGD(seq.score.parameters(),
                                                lr=0.1), data_loader=DataLoader(TensorDataset(features, Y),
                                                batch_size=16), noise_multiplier=0.8, max_grad_norm=1.0,
                                                self_check=False, target_delta=1e-5)  # fmt: skip
    _steps(head, opt, loader, 4)
    engine.detach()
    seq.save_pretrained(tmp_path / "seq")
    reloaded = transformers.GPT2ForSequenceClassification.from_pretrained(tmp_path / "seq")
    assert prior_spending(reloaded) == [[0.8, 0.25, 4]]


def test_save_pretrained_of_a_body_whose_model_is_gone_or_of_its_ema_holds_its_steps(tmp_path):
    lm, last = _lm_and_probe_data()
    whole = last(lm)
    engine, opt, loader = _make(whole)
    _steps(whole, opt, loader, 2)
    ema = copy.deepcopy(lm.transformer)  # an EMA of the body only
    _steps(whole, opt, loader, 3)
    with torch.no_grad():
        for e, p in zip(ema.parameters(), lm.transformer.parameters()):
            e.mul_(0.5).add_(p, alpha=0.5)
    engine.detach()
    body = lm.transformer
    del lm, whole, engine, opt, loader
    gc.collect()
    body.save_pretrained(tmp_path / "body")
    ema.save_pretrained(tmp_path / "ema")
    for name in ("body", "ema"):
        assert prior_spending(transformers.GPT2Model.from_pretrained(tmp_path / name)) == [[1.0, 0.25, 5]]


def test_a_noise_schedule_in_opacus_saves_its_whole_history(tmp_path):
    opacus = pytest.importorskip("opacus")
    from dpzoo.engines.opacus import make_private
    from dpzoo.integrations.opacus import privacy_metadata, unwrap

    model, data = _zoo_mlp()
    engine = opacus.PrivacyEngine(accountant="rdp")
    for sigma, n in ((0.8, 2), (1.5, 3)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapped, opt, loader = make_private(engine, module=model, optimizer=torch.optim.SGD(model.parameters(),
                                                lr=0.1), data_loader=DataLoader(data, batch_size=16),
                                                noise_multiplier=sigma, max_grad_norm=1.0)  # fmt: skip
        _steps(wrapped, opt, loader, n)
        model = wrapped.to_standard_module()
        for p in model.parameters():
            p.grad = None
    meta = privacy_metadata(engine, 1e-5, optimizer=opt, data_loader=loader)
    dpzoo.save(unwrap(wrapped), tmp_path / "o", privacy=meta)
    assert _per_mechanism(prior_spending(dpzoo.load(tmp_path / "o"))) == {(0.8, 0.25): 2, (1.5, 0.25): 3}


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_two_branches_of_an_opacus_run_both_count(opacus_model, how):
    from dpzoo.engines.opacus import make_private

    opacus, clf = opacus_model
    engine = opacus.PrivacyEngine(accountant="rdp")
    branches = []
    for phase in range(3):  # a warm start, then two branches, each with a copy of the engine's accountant
        module = clf if phase == 0 else copy.deepcopy(clf)
        if phase:
            accountant = engine.accountant
            engine_b = opacus.PrivacyEngine(accountant="rdp")
            engine_b.accountant = (
                copy.deepcopy(accountant) if how == "deepcopy" else pickle.loads(pickle.dumps(accountant))
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wrapped, opt, loader = make_private(engine if phase == 0 else engine_b, module=module,
                                                optimizer=torch.optim.SGD([p for p in module.parameters()
                                                                           if p.requires_grad], lr=0.1),
                                                data_loader=DataLoader(DATA, batch_size=16), noise_multiplier=1.0,
                                                max_grad_norm=1.0)  # fmt: skip
        _steps(wrapped, opt, loader, 3 if phase == 0 else 2)
        wrapped.remove_hooks()
        branches.append(module)
    assert _count(prior_spending(_Two(branches[1].backbone, branches[2].backbone))) >= 3 + 2 + 2


def test_an_adapter_opacus_trained_on_a_dp_trained_base_keeps_both_runs_when_merged():
    opacus = pytest.importorskip("opacus")
    from dpzoo.engines.opacus import make_private
    from dpzoo.integrations.peft import dp_lora

    card = dpzoo.model_card("gpt2")
    model = dpzoo.load("gpt2", **card.test_overrides)
    ids = torch.randint(0, card.example_input["vocab_size"], (64, 8), generator=GEN)
    engine = dpzoo.PrivacyEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                 data_loader=DataLoader(TensorDataset(ids, ids), batch_size=16),
                                                 noise_multiplier=0.8, max_grad_norm=1.0, self_check=False,
                                                 target_delta=1e-5)  # fmt: skip
    _lm_steps(model, opt, loader, 3)
    engine.detach()
    lora = dp_lora(model, r=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped, opt, loader = make_private(opacus.PrivacyEngine(accountant="rdp"), module=lora, optimizer=torch.optim.SGD(
            [p for p in lora.parameters() if p.requires_grad], lr=0.5), data_loader=DataLoader(TensorDataset(ids, ids),
            batch_size=16), noise_multiplier=3.0, max_grad_norm=1.0)  # fmt: skip
    _lm_steps(wrapped, opt, loader, 2)
    merged = lora.merge_and_unload()
    assert _per_mechanism(prior_spending(merged)) == {(0.8, 0.25): 3, (3.0, 0.25): 2}


def _lm_steps(model, opt, loader, n):
    while n > 0:
        for x, y in loader:
            if n == 0:
                break
            model(input_ids=x, labels=y).loss.backward()
            opt.step()
            opt.zero_grad()
            n -= 1


def test_dpzoo_saves_config_json_keeps_the_spending_a_disjoint_run_kept(tmp_path):
    import shutil

    card = dpzoo.model_card("gpt2")
    model = dpzoo.load("gpt2", **card.test_overrides)
    ids = torch.randint(0, card.example_input["vocab_size"], (64, 8), generator=GEN)
    for sigma, n in ((0.8, 3), (2.0, 2)):
        engine = dpzoo.PrivacyEngine()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(),
                                                     lr=0.1), data_loader=DataLoader(TensorDataset(ids, ids),
                                                     batch_size=16), noise_multiplier=sigma, max_grad_norm=1.0,
                                                     self_check=False, target_delta=1e-5)  # fmt: skip
        _lm_steps(model, opt, loader, n)
        if sigma == 0.8:
            engine.detach()
            model.dpzoo_privacy = {}  # the second run's data is disjoint from the first's
    dpzoo.save(model, tmp_path / "b")
    engine.detach()
    (tmp_path / "hub").mkdir()  # what a Hub download brings: config.json and the weights
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tmp_path / "b" / name, tmp_path / "hub" / name)
    copy_ = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hub")
    assert _per_mechanism(prior_spending(copy_)) == {(0.8, 0.25): 3, (2.0, 0.25): 2}
