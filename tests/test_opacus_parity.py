"""Coming from Opacus: ``make_private_with_epsilon`` and Opacus' ``make_private`` spellings on
dpzoo's engine, ``dpzoo.privacy.BatchMemoryManager`` (one noise draw and one accounted step per
logical batch, the update of the unsplit batch, checked against brute force), and ``dpzoo.save``
of a model Opacus trained, with Opacus' ε in its metadata."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from grad_reference import per_sample_grads
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.errors import AccountingError, PrivacyUsageError, SaveError
from dpzoo.privacy import BatchMemoryManager
from dpzoo.privacy.opacus_parity import OPACUS_ARGUMENTS

opacus = pytest.importorskip("opacus", reason="opacus is in the `test` extra: pip install -e '.[test]'")
from dp_reference import seeded_noise  # noqa: E402
from opacus.accountants.utils import get_noise_multiplier as opacus_noise_multiplier  # noqa: E402

from dpzoo.engines.opacus import make_private as dpzoo_opacus_make_private  # noqa: E402
from dpzoo.integrations.opacus import count_batches, privacy_metadata, unwrap  # noqa: E402

# Opacus' own warnings: its PrivacyEngine without secure_mode, torch's note on the first layer's
# full backward hook, Opacus' GDP accountant's caveat, and Opacus' RDP noting that a few steps at ε = 2 are best bounded at its largest order.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Secure RNG turned off:UserWarning"),
    pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning"),
    pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha:UserWarning"),
    pytest.mark.filterwarnings("ignore:GDP accounting is experimental:UserWarning"),  # dpzoo refuses it
]

F64 = torch.float64
R, SIGMA, SEED = 0.5, 0.7, 3


def _mlp(seed=0, d=5, c=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, 8), nn.Tanh(), nn.Linear(8, c)).double()


def _ds(n=24, d=5, c=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d, generator=g, dtype=F64), torch.randint(0, c, (n,), generator=g))


def _opacus_kwargs(model, ds, batch_size=8, **extra):
    """make_private_with_epsilon's arguments exactly as Opacus 1.6 spells them."""
    kw = dict(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(ds, batch_size=batch_size),
        target_epsilon=2.0,
        target_delta=1e-5,
        epochs=2,
        max_grad_norm=1.0,
        batch_first=True,
        loss_reduction="mean",
        poisson_sampling=True,
        clipping="flat",
        noise_generator=None,
        grad_sample_mode="hooks",
        wrap_model=True,
    )
    kw.update(extra)
    return kw


# -- 1. make_private_with_epsilon and Opacus' spellings ------------------------------------------------


@pytest.mark.parametrize("method", ["make_private", "make_private_with_epsilon"])
def test_every_opacus_argument_is_accepted_by_name(method):
    opacus_names = set(inspect.signature(getattr(opacus.PrivacyEngine, method)).parameters) - {"self", "kwargs"}
    dpzoo_names = set(inspect.signature(getattr(dpzoo.PrivacyEngine, method)).parameters) | set(OPACUS_ARGUMENTS)
    assert opacus_names <= dpzoo_names, sorted(opacus_names - dpzoo_names)


def test_make_private_with_epsilon_matches_opacus_calibration_and_spends_at_most_the_target():
    ds = _ds(n=32)
    ours = dpzoo.PrivacyEngine(accountant="opacus-rdp")  # Opacus' RDP analysis, to compare σ like for like
    model, opt, loader = ours.make_private_with_epsilon(**_opacus_kwargs(_mlp(), ds))
    assert ours.mode == "instantiate" and opt.clipping == "abadi"  # grad_sample_mode="hooks", clipping="flat"
    assert ours.sample_rate == 8 / 32  # = Opacus' 1 / len(data_loader): batch_size divides the dataset
    # what Opacus' make_private_with_epsilon computes for the same call
    sigma = opacus_noise_multiplier(
        target_epsilon=2.0, target_delta=1e-5, sample_rate=1 / 4, epochs=2, accountant="rdp"
    )
    assert ours.noise_multiplier == pytest.approx(sigma, rel=0.02)  # both: ε within 0.01 below the target
    for _ in range(2):  # the epochs it was calibrated for: ε at most the target, and not far below it
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert ours.steps == 2 * len(loader) == 8
    assert 1.9 <= ours.get_epsilon(1e-5) <= 2.0


def test_make_private_with_epsilon_composes_after_earlier_spending():
    """Opacus ignores what the accountant already spent (it warns); dpzoo calibrates after it."""
    fresh, spent = dpzoo.PrivacyEngine(), dpzoo.PrivacyEngine(dpzoo.privacy.Accountant("rdp", [[4.0, 0.25, 4]]))
    fresh.make_private_with_epsilon(**_opacus_kwargs(_mlp(), _ds(n=32)))
    spent.make_private_with_epsilon(**_opacus_kwargs(_mlp(), _ds(n=32)))
    assert spent.noise_multiplier > fresh.noise_multiplier
    spent.accountant.step(spent.noise_multiplier, spent.sample_rate, 8)  # the 2 epochs it calibrated for
    assert spent.accountant.get_epsilon(1e-5) <= 2.0


def test_ghost_mode_returns_four_values_and_trains_with_bk():
    model = _mlp()
    crit = nn.CrossEntropyLoss()
    engine = dpzoo.PrivacyEngine()
    out = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=crit,
        data_loader=DataLoader(_ds(), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        grad_sample_mode="ghost",
        clipping="flat",
    )
    assert len(out) == 4 and out[2] is crit and out[0] is model  # dpzoo needs no loss wrapper, no model wrapper
    model, opt, crit, loader = out
    assert engine.mode == "bk" and opt.clipping == "abadi"
    x, y = next(iter(loader))
    crit(model(x), y).backward()
    opt.step()
    assert engine.steps == 1


def test_ghost_mode_with_epsilon_gets_opacus_default_criterion():
    model, opt, crit, loader = dpzoo.PrivacyEngine().make_private_with_epsilon(
        **_opacus_kwargs(_mlp(), _ds(n=32), criterion=None, grad_sample_mode="ghost")
    )
    assert isinstance(crit, nn.CrossEntropyLoss)


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"poisson_sampling": False}, "poisson_sampling=False is refused"),
        ({"clipping": "per_layer"}, "clipping='per_layer' is refused"),
        ({"clipping": "adaptive"}, "clipping='adaptive' is refused"),
        ({"max_grad_norm": [1.0, 1.0]}, "per-layer clipping"),
        ({"grad_sample_mode": "functorch"}, "grad_sample_mode='functorch' is refused"),
        ({"grad_sample_mode": "ew"}, "grad_sample_mode='ew' is refused"),
        ({"grad_sample_mode": "ghost", "mode": "instantiate"}, "contradicts mode='instantiate'"),
        ({"batch_first": False}, "batch_first=False is refused"),
        ({"noise_generator": torch.Generator().manual_seed(0)}, "noise_generator is refused.*noise_seed"),
        ({"wrap_model": False}, "wrap_model=False is refused"),
        ({"target_unclipped_quantile": 0.5}, "target_unclipped_quantile that dpzoo does not know"),
        ({"noise_multiplier": 1.0}, "calibrates the noise"),
    ],
)
def test_opacus_arguments_dpzoo_cannot_honour_are_refused(extra, match):
    model = _mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = dpzoo.PrivacyEngine()
    with pytest.raises(PrivacyUsageError, match=match):
        engine.make_private_with_epsilon(**_opacus_kwargs(model, _ds(n=32), **extra))
    assert engine.module is None and engine.hooks is None  # nothing was attached
    assert all(p.requires_grad and torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_accepted_no_op_arguments_change_nothing():
    """rand_on_empty (dpzoo never yields an empty batch) and epsilon_tolerance (dpzoo's σ has ε <= target)."""
    a, b = dpzoo.PrivacyEngine(), dpzoo.PrivacyEngine()
    a.make_private_with_epsilon(**_opacus_kwargs(_mlp(), _ds(n=32)))
    b.make_private_with_epsilon(**_opacus_kwargs(_mlp(), _ds(n=32), epsilon_tolerance=0.5, rand_on_empty=True))
    assert a.noise_multiplier == b.noise_multiplier


# -- 2. BatchMemoryManager -----------------------------------------------------------------------------


def _private(model, ds, batch_size, **kw):
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        data_loader=DataLoader(ds, batch_size=batch_size),
        max_grad_norm=R,
        noise_multiplier=SIGMA,
        noise_seed=SEED,
        sample_seed=0,
        **kw,
    )
    return engine, model, opt, loader


def _train_epoch(model, opt, batches):
    """Steps after every batch, as Opacus' BatchMemoryManager loop does; returns the batches'
    sizes and the parameters after each step that was taken."""
    sizes, after = [], []
    for x, y in batches:
        sizes.append(len(x))
        F.cross_entropy(model(x), y).backward()  # each physical batch with its own mean
        taken = opt.steps
        opt.step()
        if opt.steps > taken:
            after.append({n: p.detach().clone() for n, p in model.named_parameters()})
        opt.zero_grad()
    return sizes, after


def test_batch_memory_manager_gives_the_unsplit_update_with_one_step_per_logical_batch():
    ds = _ds(n=24)
    engine, model, opt, loader = _private(_mlp(), ds, batch_size=12)
    full_sizes, full = _train_epoch(model, opt, loader)

    engine2, model2, opt2, loader2 = _private(_mlp(), ds, batch_size=12)  # same seeds: same batches, same noise
    with BatchMemoryManager(data_loader=loader2, max_physical_batch_size=5, optimizer=opt2) as mem_loader:
        sizes, split = _train_epoch(model2, opt2, mem_loader)

    assert max(sizes) <= 5 and len(sizes) > len(full_sizes) and sum(sizes) == sum(full_sizes)
    assert engine2.steps == engine.steps == len(loader) == 2  # one accounted step per logical batch
    assert engine2.accountant.history == [[SIGMA, 0.5, 2]]
    assert len(split) == len(full) == 2
    for a, b in zip(split, full):
        for n in a:
            torch.testing.assert_close(a[n], b[n], rtol=1e-9, atol=1e-12)
    assert loader2.max_physical_batch_size is None  # the original loader is left as it was


def _dp_reference(model, x, y, expected_batch):
    """DP-SGD's first step by brute force: single-sample backward passes, min(1, R/||g_i||),
    N(0, σ²R²) drawn per parameter in order from a generator seeded SEED, divided by q·N."""
    grads = per_sample_grads(model, lambda m, x, y: F.cross_entropy(m(x), y, reduction="sum"), {"x": x, "y": y}, len(x))
    names = [n for n, _ in model.named_parameters()]
    norms = torch.stack([torch.sqrt(sum(g[n].pow(2).sum() for n in names)) for g in grads])
    c = torch.clamp(R / norms, max=1.0)
    gen = torch.Generator().manual_seed(SEED)
    params = dict(model.named_parameters())
    out = {}
    for n, noise in zip(names, seeded_noise([(params[n].shape, F64) for n in names], SIGMA * R, gen)):
        out[n] = -(sum(c[i] * grads[i][n] for i in range(len(x))) + noise) / expected_batch
    return out


def test_batch_memory_manager_first_step_matches_brute_force():
    ds = _ds(n=24)
    ref = _mlp()
    engine, model, opt, loader = _private(_mlp(), ds, batch_size=12)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    xs, ys = [], []
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=4, optimizer=opt) as mem_loader:
        for x, y in mem_loader:
            xs.append(x)
            ys.append(y)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if engine.steps == 1:
                break
    assert len(xs) > 1 and all(len(x) <= 4 for x in xs)
    expected = _dp_reference(ref, torch.cat(xs), torch.cat(ys), expected_batch=12.0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach() - before[n], expected[n], rtol=1e-5, atol=1e-9)


def test_batch_memory_manager_keeps_a_smaller_bound_and_estimates_length_like_opacus():
    engine, model, opt, loader = _private(_mlp(), _ds(n=24), batch_size=12, max_physical_batch_size=3)
    with BatchMemoryManager(data_loader=loader, max_physical_batch_size=5, optimizer=opt) as mem_loader:
        assert mem_loader.max_physical_batch_size == 3
        assert len(mem_loader) == math.ceil(2 * 12 / 3)
        sizes, _ = _train_epoch(model, opt, mem_loader)
    assert max(sizes) <= 3 and loader.max_physical_batch_size == 3


def test_batch_memory_manager_refuses_mismatched_or_foreign_objects():
    _, _, opt1, loader1 = _private(_mlp(), _ds(), batch_size=8)
    _, _, opt2, loader2 = _private(_mlp(), _ds(), batch_size=8)
    with pytest.raises(PrivacyUsageError, match="different make_private calls"):
        BatchMemoryManager(data_loader=loader1, max_physical_batch_size=2, optimizer=opt2)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(PrivacyUsageError, match="positive integer"):
            BatchMemoryManager(data_loader=loader1, max_physical_batch_size=bad, optimizer=opt1)
    model = _mlp()
    _, their_opt, their_loader = opacus.PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(_ds(), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    with pytest.raises(PrivacyUsageError, match="opacus.utils.batch_memory_manager"):
        BatchMemoryManager(data_loader=their_loader, max_physical_batch_size=2, optimizer=their_opt)
    with pytest.raises(PrivacyUsageError, match="opacus.utils.batch_memory_manager"):
        BatchMemoryManager(data_loader=loader1, max_physical_batch_size=2, optimizer=their_opt)


def test_opacus_batch_memory_manager_on_dpzoo_objects_fails_without_a_step():
    """Opacus' own manager bypasses dpzoo's step signal: it must fail, never train with a wrong ε."""
    from opacus.utils.batch_memory_manager import BatchMemoryManager as OpacusBMM

    engine, model, opt, loader = _private(_mlp(), _ds(), batch_size=8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(PrivacyUsageError, match="dpzoo.privacy.BatchMemoryManager"):
        with OpacusBMM(data_loader=loader, max_physical_batch_size=2, optimizer=opt) as mem_loader:
            for x, y in mem_loader:
                F.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    assert engine.steps == 0 and engine.accountant.history == []
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# -- 3. dpzoo.save of a model Opacus trained ---------------------------------------------------------


def _zoo():
    torch.manual_seed(0)
    return dpzoo.load("resnet18-gn-bias", num_classes=3, layers=[1, 1, 1, 1], width=8).train()


def _opacus_train(model, steps=1, accountant="rdp"):
    ds = TensorDataset(torch.randn(16, 3, 8, 8), torch.randint(0, 3, (16,)))
    engine = opacus.PrivacyEngine(accountant=accountant)
    model, opt, loader = dpzoo_opacus_make_private(
        engine,
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(ds, batch_size=8),
        noise_multiplier=1.3,
        max_grad_norm=0.8,
    )
    for i, (x, y) in enumerate(loader):
        if i == steps:
            break
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return engine, model, opt, loader


def test_save_of_an_opacus_trained_zoo_model_round_trips_with_opacus_epsilon(tmp_path):
    zoo = _zoo()
    engine, model, opt, loader = _opacus_train(zoo)
    assert type(model).__name__ == "GradSampleModule" and unwrap(model) is zoo
    eps = engine.get_epsilon(1e-5)
    dpzoo.save(model, tmp_path / "m", privacy=privacy_metadata(engine, 1e-5, optimizer=opt, data_loader=loader))

    meta = dpzoo.privacy_metadata(tmp_path / "m")
    assert meta["epsilon"] == eps > 0
    assert meta["delta"] == 1e-5 and meta["accountant"] == "opacus-rdp"
    assert meta["steps"] == 1 and meta["sample_rate"] == 1 / len(loader)
    assert meta["noise_multiplier"] == opt.noise_multiplier == 1.3 and meta["max_grad_norm"] == 0.8
    assert "secure_mode=False" in meta["noise"]
    loaded = dpzoo.load(tmp_path / "m")
    assert type(loaded) is type(zoo)
    saved = zoo.state_dict()
    assert loaded.state_dict().keys() == saved.keys()
    assert all(torch.equal(loaded.state_dict()[k], saved[k]) for k in saved)

    # Opacus' hooks are still on: training goes on after saving
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert engine.accountant.history == [(1.3, 1 / len(loader), 2)]

    # dpzoo's engine continues the Opacus run's accounting from the saved metadata
    again = dpzoo.PrivacyEngine(accountant="opacus-rdp")
    loaded.train()
    again.make_private(
        module=loaded,
        optimizer=torch.optim.SGD(loaded.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(torch.randn(16, 3, 8, 8), torch.randint(0, 3, (16,))), batch_size=8),
        noise_multiplier=1.3,
        max_grad_norm=0.8,
    )
    assert again.get_epsilon(1e-5) == pytest.approx(eps, rel=1e-9)


def _resume_opacus(model, checkpoint, steps):
    engine = opacus.PrivacyEngine(accountant="rdp")
    ds = TensorDataset(torch.randn(16, 3, 8, 8), torch.randint(0, 3, (16,)))
    wrapped, opt, loader = dpzoo_opacus_make_private(engine, module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                     data_loader=DataLoader(ds, batch_size=8), noise_multiplier=1.3,
                                                     max_grad_norm=0.8)  # fmt: skip
    engine.load_checkpoint(path=checkpoint, module=wrapped, optimizer=opt)
    for _, (x, y) in zip(range(steps), loader):
        F.cross_entropy(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()
    return engine, opt, loader


def test_a_run_resumed_from_an_opacus_checkpoint_counts_the_checkpoints_batches_and_run_once(tmp_path):
    """Opacus' load_checkpoint restores the history but not the batches dpzoo counted (the resumed
    run was refused), nor the run it continues (its saved model's record counted twice)."""
    engine, model, opt, loader = _opacus_train(_zoo(), steps=2)
    engine.save_checkpoint(path=tmp_path / "ck.pt", module=model, optimizer=opt)
    dpzoo.save(model, tmp_path / "m", privacy=privacy_metadata(engine, 1e-5, optimizer=opt, data_loader=loader))

    resumed, opt2, loader2 = _resume_opacus(dpzoo.load(tmp_path / "m").train(), tmp_path / "ck.pt", 2)
    meta = privacy_metadata(resumed, 1e-5, optimizer=opt2, data_loader=loader2)
    assert meta["steps"] == 4 == sum(n for _, _, n in resumed.accountant.history)
    assert meta["epsilon"] == pytest.approx(resumed.get_epsilon(1e-5), rel=1e-9)  # the saved run's 2 steps once
    assert meta["epsilon"] > engine.get_epsilon(1e-5)


def test_a_checkpoint_loaded_into_an_engine_that_trained_starts_another_run(tmp_path):
    """The fifteenth audit: the engine kept its run id, so its model saved before the load and the
    one saved after counted the engine's own steps before and after the load as one run's (the max)."""
    first, model, opt, loader = _opacus_train(_zoo(), steps=2)
    first.save_checkpoint(path=tmp_path / "ck.pt", module=model, optimizer=opt)
    engine, model, opt, loader = _opacus_train(_zoo(), steps=2)
    before = privacy_metadata(engine, 1e-5, optimizer=opt, data_loader=loader)
    dpzoo.save(model, tmp_path / "b1", privacy=before)
    engine.load_checkpoint(path=tmp_path / "ck.pt", module=model, optimizer=opt)
    for _, (x, y) in zip(range(2), loader):
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    meta = privacy_metadata(engine, 1e-5, optimizer=opt, data_loader=loader)
    dpzoo.save(model, tmp_path / "b2", privacy=meta)
    both = nn.ModuleList([dpzoo.load(tmp_path / "b1"), dpzoo.load(tmp_path / "b2")])
    from dpzoo.privacy.budget import spent_inside

    assert sum(n for _, _, n in spent_inside(both)) == before["steps"] + meta["steps"] == 2 + 4


def test_a_checkpoint_carries_what_its_model_spent_before_opacus(tmp_path):
    """The sixteenth audit: a fresh model resumed from the checkpoint of an Opacus run on a
    dpzoo-trained model lost the dpzoo run (in the record and in a later dpzoo run)."""
    zoo = _zoo()
    engine = dpzoo.PrivacyEngine()
    ds = TensorDataset(torch.randn(16, 3, 8, 8), torch.randint(0, 3, (16,)))
    model, opt, loader = engine.make_private(module=zoo, optimizer=torch.optim.SGD(zoo.parameters(), lr=0.1),
                                             data_loader=DataLoader(ds, batch_size=8), noise_multiplier=2.0,
                                             max_grad_norm=1.0)  # fmt: skip
    for _, (x, y) in zip(range(2), loader):
        if len(y):
            F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    engine.detach()
    first, wrapped, opt, loader = _opacus_train(zoo, steps=1)
    first.save_checkpoint(path=tmp_path / "ck.pt", module=wrapped, optimizer=opt)
    fresh = _zoo()
    resumed, opt2, loader2 = _resume_opacus(fresh, tmp_path / "ck.pt", 1)
    history = privacy_metadata(resumed, 1e-5, optimizer=opt2, data_loader=loader2)["history"]
    assert [2.0, 0.5, 2] in history and sum(n for _, _, n in history) == 2 + 2
    from dpzoo.privacy.budget import spent_inside

    assert sum(n for _, _, n in spent_inside(fresh)) == 2 + 2  # what a later dpzoo run on it composes


def test_a_resume_from_a_checkpoint_dpzoo_did_not_count_is_refused(tmp_path):
    model = _zoo()
    engine = opacus.PrivacyEngine(accountant="rdp")
    ds = TensorDataset(torch.randn(16, 3, 8, 8), torch.randint(0, 3, (16,)))
    wrapped, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(ds, batch_size=8),
        noise_multiplier=1.3,
        max_grad_norm=0.8,
    )  # fmt: skip  (Opacus' own: nothing counts)
    x, y = next(iter(loader))
    F.cross_entropy(wrapped(x), y).backward()
    opt.step()
    engine.save_checkpoint(path=tmp_path / "ck.pt", module=wrapped, optimizer=opt)
    resumed, opt2, loader2 = _resume_opacus(_zoo(), tmp_path / "ck.pt", 1)
    with pytest.raises(PrivacyUsageError, match="load_checkpoint after"):
        privacy_metadata(resumed, 1e-5, optimizer=opt2, data_loader=loader2)


def test_a_counting_accountant_pickles_in_a_process_that_has_not_made_its_class(tmp_path):
    import pickle
    import subprocess
    import sys

    engine, *_ = _opacus_train(_zoo(), steps=1)
    (tmp_path / "a.pkl").write_bytes(pickle.dumps(engine.accountant))
    code = f"import pickle; a = pickle.load(open({str(tmp_path / 'a.pkl')!r}, 'rb')); print(len(a.history), a.state_dict()['dpzoo_drawn'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["1", str(engine.accountant.dpzoo_drawn)] and engine.accountant.dpzoo_drawn >= 1


def test_saving_an_opacus_wrapped_model_without_privacy_is_refused(tmp_path):
    zoo = _zoo()
    engine, model, opt, loader = _opacus_train(zoo, steps=0)
    with pytest.raises(SaveError, match="privacy_metadata"):
        dpzoo.save(model, tmp_path / "m")
    assert not (tmp_path / "m").exists()
    dpzoo.save(unwrap(model), tmp_path / "m")  # deliberately without metadata
    assert dpzoo.privacy_metadata(tmp_path / "m") is None
    with pytest.raises(SaveError, match="took no step"):
        privacy_metadata(engine, 1e-5, data_loader=loader)


def test_unwrap_ghost_and_non_opacus_models():
    model = _mlp()
    wrapped, *_ = opacus.PrivacyEngine().make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        criterion=nn.CrossEntropyLoss(),
        data_loader=DataLoader(_ds(), batch_size=8),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        grad_sample_mode="ghost",
    )
    assert type(wrapped).__name__ == "GradSampleModuleFastGradientClipping" and unwrap(wrapped) is model
    plain = _mlp()
    assert unwrap(plain) is plain


def _engine_with_history(accountant, *entries):
    engine = opacus.PrivacyEngine(accountant=accountant)
    for sigma, q, n in entries:
        for _ in range(n):
            engine.accountant.step(noise_multiplier=sigma, sample_rate=q)
    return engine


def _poisson(drawn: int = 10):
    """A counting Poisson loader over 10 samples (q = 0.1) that drew ``drawn`` batches."""
    loader = count_batches(
        opacus.data_loader.DPDataLoader.from_data_loader(DataLoader(TensorDataset(torch.zeros(10, 1)), batch_size=1))
    )
    while drawn > 0:
        for _ in zip(range(drawn), loader):
            drawn -= 1
    return loader


POISSON = _poisson()


def test_privacy_metadata_refuses_a_run_without_poisson_sampling():
    """Opacus' accountant reports the Poisson-subsampled ε whatever the loader did: with
    poisson_sampling=False (fixed shuffled batches) that ε is false, so no record is made."""
    zoo = _zoo()
    engine = opacus.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=zoo,
        optimizer=torch.optim.SGD(zoo.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(torch.randn(16, 3, 8, 8), torch.randint(0, 3, (16,))), batch_size=8),
        noise_multiplier=1.3,
        max_grad_norm=0.8,
        poisson_sampling=False,
    )
    x, y = next(iter(loader))
    F.cross_entropy(model(x), y).backward()
    opt.step()
    assert engine.get_epsilon(1e-5) > 0  # Opacus reports an ε regardless
    with pytest.raises(PrivacyUsageError, match="does not draw Poisson batches"):
        privacy_metadata(engine, 1e-5, optimizer=opt, data_loader=loader)
    with pytest.raises(PrivacyUsageError, match="needs data_loader="):
        privacy_metadata(engine, 1e-5, optimizer=opt)
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    with BatchMemoryManager(data_loader=POISSON, max_physical_batch_size=1, optimizer=opt) as split:
        assert privacy_metadata(engine, 1e-5, data_loader=split)["steps"] == 1  # Poisson inside the splitter


def test_privacy_metadata_refuses_steps_on_batches_the_poisson_loader_did_not_draw():
    """Opacus' sampler keeps no count: a loop over the original shuffled loader after make_private
    took Opacus' Poisson ε for non-Poisson batches. The loader dpzoo's make_private returns counts
    the batches it draws (BatchMemoryManager's logical batches included), and a plain Opacus loader,
    which cannot tell, is refused."""
    data = TensorDataset(torch.randn(32, 3, 8, 8), torch.randint(0, 3, (32,)))
    original = DataLoader(data, batch_size=8, shuffle=True)

    def run(make, batches_from, steps=3):
        zoo = _zoo()
        engine = opacus.PrivacyEngine()
        model, opt, loader = make(
            engine,
            module=zoo,
            optimizer=torch.optim.SGD(zoo.parameters(), lr=0.1),
            data_loader=original,
            noise_multiplier=1.3,
            max_grad_norm=0.8,
        )
        for _, (x, y) in zip(range(steps), batches_from(loader)):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return engine, opt, loader

    engine, opt, loader = run(dpzoo_opacus_make_private, lambda dp_loader: original)
    with pytest.raises(PrivacyUsageError, match="took 3 steps but its Poisson loader drew 0 batches"):
        privacy_metadata(engine, 1e-5, optimizer=opt, data_loader=loader)
    engine, opt, loader = run(dpzoo_opacus_make_private, lambda dp_loader: dp_loader)
    assert privacy_metadata(engine, 1e-5, optimizer=opt, data_loader=loader)["steps"] == 3
    assert isinstance(loader.batch_sampler, opacus.utils.uniform_sampler.UniformWithReplacementSampler)

    def plain(engine, **kwargs):
        return engine.make_private(**kwargs)

    engine, opt, loader = run(plain, lambda dp_loader: dp_loader)
    with pytest.raises(PrivacyUsageError, match="does not count the batches.*count_batches"):
        privacy_metadata(engine, 1e-5, optimizer=opt, data_loader=loader)
    with pytest.raises(PrivacyUsageError, match="count_batches needs Opacus' Poisson loader"):
        count_batches(original)

    # BatchMemoryManager: physical batches of 2, one logical batch per step
    zoo = _zoo()
    engine = opacus.PrivacyEngine()
    model, opt, loader = dpzoo_opacus_make_private(
        engine,
        module=zoo,
        optimizer=torch.optim.SGD(zoo.parameters(), lr=0.1),
        data_loader=original,
        noise_multiplier=1.3,
        max_grad_norm=0.8,
    )
    from opacus.utils.batch_memory_manager import BatchMemoryManager as OpacusBMM

    with OpacusBMM(data_loader=loader, max_physical_batch_size=2, optimizer=opt) as split:
        for x, y in split:
            if len(y):
                F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        meta = privacy_metadata(engine, 1e-5, data_loader=split)
    assert meta["steps"] == loader.batch_sampler.dpzoo_drawn == len(loader)


def test_privacy_metadata_reads_opacus_prv_and_a_noise_schedule():
    prv = _engine_with_history("prv", (1.0, 0.1, 5))
    meta = privacy_metadata(prv, 1e-5, data_loader=POISSON)
    assert meta["accountant"] == "prv" and meta["epsilon"] == prv.get_epsilon(1e-5) and meta["steps"] == 5
    scheduled = _engine_with_history("rdp", (1.0, 0.1, 3), (1.5, 0.1, 2))
    meta = privacy_metadata(scheduled, 1e-5, data_loader=POISSON)
    assert meta["steps"] == 5 and meta["sample_rate"] == 0.1 and meta["epsilon"] == scheduled.get_epsilon(1e-5)
    assert "noise_multiplier" not in meta  # no single σ: nothing that a later engine would compose wrongly


def test_privacy_metadata_refuses_what_would_be_false():
    with pytest.raises(AccountingError, match="not an upper bound"):
        privacy_metadata(_engine_with_history("gdp", (1.0, 0.1, 5)), 1e-5, data_loader=POISSON)
    with pytest.raises(SaveError, match="2 sample rates"):
        privacy_metadata(_engine_with_history("rdp", (1.0, 0.1, 3), (1.0, 0.2, 2)), 1e-5, data_loader=POISSON)
    with pytest.raises(AccountingError, match=r"at least 1/N = 1/10"):  # POISSON holds 10 samples
        privacy_metadata(_engine_with_history("rdp", (1.0, 0.1, 3)), 0.1, data_loader=POISSON)
    for delta in (0, 1, -1e-5, None):
        with pytest.raises(AccountingError, match="delta must be in"):
            privacy_metadata(_engine_with_history("rdp", (1.0, 0.1, 3)), delta, data_loader=POISSON)
    with pytest.raises(PrivacyUsageError, match="Opacus' PrivacyEngine"):
        privacy_metadata(dpzoo.PrivacyEngine(), 1e-5, data_loader=POISSON)
    with pytest.raises(PrivacyUsageError, match="Opacus DPOptimizer"):
        privacy_metadata(
            _engine_with_history("rdp", (1.0, 0.1, 3)),
            1e-5,
            optimizer=torch.optim.SGD([nn.Parameter(torch.zeros(1))]),
            data_loader=POISSON,
        )


def test_a_model_opacus_trained_carries_its_spending_into_a_dpzoo_run():
    """dpzoo.engines.opacus.make_private links Opacus' accountant to the model: a dpzoo engine on
    the same model later composes Opacus' steps instead of starting a fresh budget."""
    zoo = _zoo()
    engine, model, opt, loader = _opacus_train(zoo, steps=2)
    plain = model.to_standard_module()
    plain.zero_grad(set_to_none=True)
    again = dpzoo.PrivacyEngine(accountant="opacus-rdp")
    again.make_private(
        module=plain,
        optimizer=torch.optim.SGD(plain.parameters(), lr=0.1),
        data_loader=DataLoader(TensorDataset(torch.randn(16, 3, 8, 8), torch.randint(0, 3, (16,))), batch_size=8),
        noise_multiplier=1.3,
        max_grad_norm=0.8,
    )
    assert again.accountant.history == [[1.3, 0.5, 2]]
    assert again.get_epsilon(1e-5) == pytest.approx(engine.get_epsilon(1e-5), rel=1e-9)


def test_counting_survives_ghost_clipping_pickling_and_refuses_another_engines_loader():
    import pickle

    data = _ds(32)
    engines, loaders = [], []
    for _ in range(2):
        model = _mlp()
        engine = opacus.PrivacyEngine()
        made = dpzoo_opacus_make_private(
            engine,
            module=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            criterion=nn.CrossEntropyLoss(),
            data_loader=DataLoader(data, batch_size=8),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            grad_sample_mode="ghost",
        )
        wrapped, opt, criterion, loader = made
        for _, (x, y) in zip(range(2), loader):
            criterion(wrapped(x), y).backward()
            opt.step()
            opt.zero_grad()
        engines.append(engine)
        loaders.append(loader)
    assert privacy_metadata(engines[0], 1e-5, data_loader=loaders[0])["steps"] == 2
    with pytest.raises(PrivacyUsageError, match="another Opacus engine"):
        privacy_metadata(engines[1], 1e-5, data_loader=loaders[0])
    copy = pickle.loads(pickle.dumps(loaders[0].batch_sampler))
    assert isinstance(copy, opacus.utils.uniform_sampler.UniformWithReplacementSampler) and copy.dpzoo_drawn == 2


def test_opacus_over_layers_from_two_dpzoo_runs_keeps_both():
    """The seventh audit: each layer's OpacusSpending shared one Opacus run id, and only one of
    the dpzoo runs found before Opacus was kept."""
    from dpzoo.privacy.budget import spent_inside

    def dpzoo_run(sigma, steps):
        model = _mlp()
        engine = dpzoo.PrivacyEngine()
        model, opt, loader = engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                 data_loader=DataLoader(_ds(), batch_size=8), noise_multiplier=sigma,
                                                 max_grad_norm=1.0)  # fmt: skip
        for _, (x, y) in zip(range(steps), loader):
            if len(y):
                F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        engine.detach()
        return model, engine.accountant.history

    (x_model, x_history), (y_model, y_history) = dpzoo_run(1.0, 3), dpzoo_run(2.0, 2)
    both = nn.Sequential(x_model[0], nn.Tanh(), y_model[2])
    engine = opacus.PrivacyEngine()
    wrapped, opt, loader = dpzoo_opacus_make_private(engine, module=both, optimizer=torch.optim.SGD(both.parameters(), lr=0.1),
                                                     data_loader=DataLoader(_ds(), batch_size=8), noise_multiplier=0.9,
                                                     max_grad_norm=1.0)  # fmt: skip
    for _, (x, y) in zip(range(2), loader):
        F.cross_entropy(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()
    history = spent_inside(both)
    assert (
        x_history[0] in history
        and y_history[0] in history
        and [list(h) for h in engine.accountant.history][0] in history
    )
