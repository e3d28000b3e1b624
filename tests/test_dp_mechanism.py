"""The released mechanism measured from outside: what one DP step adds per sample and per coordinate.

References share no code with dpzoo's clipping, noise or accounting (tests/dp_reference.py):

- sensitivity probes: add or remove one sample with σ = 0 and measure how far the released sum
  moves; each probe first asserts that its clip binds (some per-sample norm above R), so it can fail;
- the secret (production) noise: its per-coordinate std against σR, its mean, and its independence
  across steps, in one process and on two gloo ranks (FSDP2: tests/test_fsdp.py);
- the user-level path of ``dpzoo train`` on sequence data (automatic clipping, the recipe's default):
  the noisy gradient handed to Adam against single-user backward passes.
"""

from __future__ import annotations

import datetime
import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from dp_reference import AUTO_S_GAMMA, clip_weights, seeded_noise, total_norms
from grad_reference import per_sample_grads
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.errors import ReproducibleNoiseWarning

F64 = torch.float64


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _items(n=6, scale=3.0, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g, dtype=F64) * scale, torch.randint(0, 3, (n,), generator=g)


def _loss_i(m, x, y):
    return F.cross_entropy(m(x), y, reduction="sum")


def _released(x, y, R, clipping, reduction):
    """The clipped sum one engine step releases on (x, y) with σ = 0 and q = 1 (SGD, lr = 1)."""
    model = _mlp()
    before = [p.detach().clone() for p in model.parameters()]
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReproducibleNoiseWarning)
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=DataLoader(TensorDataset(x, y), batch_size=len(x)),
            noise_multiplier=0.0,
            max_grad_norm=R,
            clipping=clipping,
            loss_reduction=reduction,
            sample_seed=0,
        )
    xb, yb = next(iter(loader))
    assert len(xb) == len(x)  # q = 1: the whole dataset
    F.cross_entropy(model(xb), yb, reduction=reduction).backward()
    opt.step()
    scale = engine.expected_batch_size if reduction == "mean" else 1.0
    return torch.cat([((b - p.detach()) * scale).flatten() for p, b in zip(model.parameters(), before)])


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("clipping", ["abadi", "automatic"])
def test_one_sample_moves_the_released_sum_by_its_clipped_norm_at_most_R(clipping, reduction):
    """S(D) − S(D ∖ {j}) is sample j's clipped gradient: its norm is min(‖g_j‖, R) (Abadi) or
    R‖g_j‖/(‖g_j‖ + γ) (automatic), never above R, for every j."""
    R = 0.5
    x, y = _items()
    grads = per_sample_grads(_mlp(), _loss_i, {"x": x, "y": y}, len(x))
    norms = total_norms(grads, list(grads[0]))
    assert (norms > R).sum() >= 2 and norms.max() > 3 * R  # the clip binds: the probe can fail
    full = _released(x, y, R, clipping, reduction)
    for j in range(len(x)):
        keep = [i for i in range(len(x)) if i != j]
        moved = (full - _released(x[keep], y[keep], R, clipping, reduction)).norm().item()
        want = (norms[j] * clip_weights(norms[j : j + 1], R, clipping)[0]).item()
        assert moved == pytest.approx(want, rel=1e-9), f"sample {j}: moved {moved:.6f}, clipped norm {want:.6f}"
        assert moved <= R * (1 + 1e-12)
    if clipping == "automatic":  # close to R for large gradients, as AUTO-S intends
        assert max(n * R / (n + AUTO_S_GAMMA) for n in norms.tolist()) > 0.99 * R


# -- secret noise ---------------------------------------------------------------------------------


def _noise_steps(model, n_steps, sigma, R, reduction="sum", steps_data=64):
    """Updates of ``n_steps`` steps whose clipped sum is exactly 0 (a loss that is 0 · output):
    each is −lr · noise [/ expected batch size], with secret noise (no noise_seed). Poisson batches
    of expected size steps_data / 4 per rank: an empty one, which the engine would take as a
    noise-only step without yielding it, has probability below 1e-7."""
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    data = TensorDataset(torch.randn(steps_data, model[0].in_features, dtype=F64))
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(data, batch_size=steps_data // 4),
        noise_multiplier=sigma,
        max_grad_norm=R,
        loss_reduction=reduction,
        self_check=False,  # a zero loss has nothing to check
    )
    out: list = []
    while len(out) < n_steps:  # as many epochs as it takes (one step per epoch at q = 1)
        for (xb,) in loader:
            before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
            y_hat = model(xb)
            (0.0 * (y_hat.sum() if reduction == "sum" else y_hat.mean())).backward()
            opt.step()
            opt.zero_grad()
            after = torch.cat([p.detach().flatten() for p in model.parameters()])
            out.append((before - after) * (engine.expected_batch_size if reduction == "mean" else 1.0))
            if len(out) == n_steps:
                break
    return out


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_secret_noise_has_std_sigma_R_and_is_fresh_each_step(reduction):
    """Production noise (no seed) on 10,100 coordinates: std σR within 4% (the estimate's own
    relative error is 0.7%), mean 0, and the draws of two steps uncorrelated and not equal."""
    sigma, R = 1.3, 0.4
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 100)).double()
    first, second = _noise_steps(model, 2, sigma, R, reduction)
    n = first.numel()
    for noise in (first, second):
        assert noise.std().item() == pytest.approx(sigma * R, rel=0.04)
        assert abs(noise.mean().item()) < 5 * sigma * R / n**0.5
    corr = torch.corrcoef(torch.stack([first, second]))[0, 1].item()
    assert abs(corr) < 5 / n**0.5 and not torch.equal(first, second)


def _ddp_noise(rank, world, sigma, R):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 60)).double()
    return _noise_steps(model, 2, sigma, R, steps_data=128)


def _worker(rank, world, port, out_dir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, *args), os.path.join(out_dir, f"rank{rank}.pt"))
        # both ranks done before either tears gloo down (a rank leaving mid-teardown aborted the
        # other with "terminate called without an active exception"); bounded, so a failed rank cannot hang it
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_secret_noise_on_two_ranks_is_added_once_and_fresh_each_step(tmp_path):
    """Two gloo ranks: the update every rank applies has noise of std σR (added once per coordinate,
    not √2·σR), is the same on both ranks, and is fresh at the next step."""
    sigma, R = 0.9, 0.6
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, str(tmp_path), _ddp_noise, (sigma, R)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for step in range(2):
        assert torch.equal(ranks[0][step], ranks[1][step])  # one noise draw, all-reduced
        assert ranks[0][step].std().item() == pytest.approx(sigma * R, rel=0.05)
    corr = torch.corrcoef(torch.stack(ranks[0]))[0, 1].item()
    assert abs(corr) < 5 / ranks[0][0].numel() ** 0.5


# -- dpzoo train's user-level path (sequence models, automatic clipping) ---------------------------


def test_seqrec_training_step_is_user_level_dp_sgd_with_automatic_clipping(monkeypatch):
    """train_seqrec at q = 1 (every user in the batch), automatic clipping (its default), seeded
    noise: the gradient Adam receives is (Σ_u R g_u / (‖g_u‖ + γ) + N(0, σ²R²)) / N, with g_u from
    one backward pass per user of that user's whole-sequence loss."""
    import dpzoo.seqrec.train as train
    from dpzoo.losses import SequenceCrossEntropy

    built, engines, seen = [], [], {}
    real_load, real_private = train.load, dpzoo.PrivacyEngine.make_private

    def load(*a, **kw):
        built.append((a, kw, real_load(*a, **kw)))
        return built[-1][2]

    def make_private(self, *a, **kw):
        engines.append(self)
        return real_private(self, *a, **kw)

    def before_adam(optimizer, args, kwargs):
        if not seen:
            seen.update(
                {
                    id(p): (p.detach().clone(), p.grad.detach().clone())
                    for g in optimizer.param_groups
                    for p in g["params"]
                }
            )

    monkeypatch.setattr(train, "load", load)
    monkeypatch.setattr(dpzoo.PrivacyEngine, "make_private", make_private)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = register_optimizer_step_pre_hook(before_adam)
    R = 0.7
    ds = train.get_dataset("synthetic", 0)
    x, y = ds.to_padded(8, "train")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReproducibleNoiseWarning)
            train.train_seqrec(
                "transformer-seqrec",
                epochs=1,
                batch_size=len(x),
                max_len=8,
                max_grad_norm=R,
                overrides={"d_model": 8, "num_heads": 1},
                item_prior="none",
                max_physical_batch_size=None,
                eval_every=1,
                noise_seed=5,
                sample_seed=6,
                log=lambda m: None,
            )
    finally:
        handle.remove()
    (args, kwargs, model), engine = built[0], engines[0]
    assert engine.sample_rate == 1.0 and engine.clipping == "automatic"
    reference = real_load(*args, **kwargs)
    names = [n for n, _ in model.named_parameters()]
    with torch.no_grad():
        for (n, p), (_, q) in zip(reference.named_parameters(), model.named_parameters()):
            p.copy_(seen[id(q)][0])  # θ at the step
    crit = SequenceCrossEntropy(ignore_index=0, token_reduction="mean", reduction="sum")
    grads = per_sample_grads(reference.train(), lambda m, x, y: crit(m(x), y), {"x": x, "y": y}, len(x))
    norms = total_norms(grads, names)
    c = clip_weights(norms, R, "automatic")
    assert not torch.allclose(c, torch.ones_like(c), rtol=0.05)  # the clip changes the sum: the test can fail
    gen = torch.Generator().manual_seed(5)
    sigma = engine.noise_multiplier
    noises = seeded_noise([p for _, p in model.named_parameters()], sigma * R, gen)
    for (n, p), noise in zip(model.named_parameters(), noises):
        signal = sum(c[i] * grads[i][n] for i in range(len(x)))
        got = seen[id(p)][1] * len(x)
        torch.testing.assert_close(got - noise, signal, rtol=1e-3, atol=1e-4 * R, msg=n)
