"""DP under torch.distributed (2 CPU processes, gloo): every rank passes the one dataset (with or
without a DistributedSampler), dpzoo gives each rank a disjoint shard and Poisson-samples it at
the global rate q, clips locally, sums across ranks and adds the noise once. The update equals
the single-process update on the same data, seed and noise; each sample is counted once."""

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
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import dpzoo

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with gloo is not available in this build",
)


def _model():
    torch.manual_seed(0)
    return dpzoo.load("resnet18-gn-bias", num_classes=3, layers=[1, 1, 1, 1], width=4).double().train()


def _data(n=8):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, 16, 16, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def _one_step(loader, reduction):
    """One DP step through the public API; q = 1 here, so the batch is the whole (shard of the) data."""
    model = _model()
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpzoo.errors.ReproducibleNoiseWarning)
        model, opt, dl = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=0.8,
            max_grad_norm=0.5,
            loss_reduction=reduction,
            noise_seed=42,
        )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rows = 0
    for x, y in dl:
        F.cross_entropy(model(x), y, reduction=reduction).backward()
        opt.step()
        rows += x.shape[0]
    update = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    return update, engine.expected_batch_size, engine.sample_rate, rows


def _run(fn, world, tmp_path, *args):
    port = _free_port()
    mp.spawn(_worker, args=(world, port, str(tmp_path), fn, args), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _worker(rank, world, port, out_dir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        # both ranks done before either tears gloo down (a rank leaving mid-teardown aborted the
        # other with "terminate called without an active exception"); bounded, so a failed rank cannot hang it
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


VARIANTS = [(reduction, sampler) for reduction in ("sum", "mean") for sampler in (True, False)]


def _full_data_steps(rank, world):
    """One step per (reduction, with a DistributedSampler or the full dataset), in one spawn."""
    x, y = _data()
    ds = TensorDataset(x, y)
    out = {}
    for reduction, sampler in VARIANTS:
        kw = {"sampler": DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True)} if sampler else {}
        update, ebs, q, rows = _one_step(DataLoader(ds, batch_size=len(x) // world, **kw), reduction)
        out[reduction, sampler] = {"update": update, "ebs": ebs, "q": q, "rows": rows}
    return out


def test_two_process_update_equals_single_process(tmp_path):
    """Per-rank batch 4, 2 ranks, 8 samples: q = 1, so each sample is in exactly one rank's batch.
    (Before: each rank Poisson-sampled the whole dataset, every sample entered the sum twice.)
    Both loss reductions, with a DistributedSampler and with the full dataset on every rank."""
    both = _run(_full_data_steps, 2, tmp_path)
    x, y = _data()
    for reduction, sampler in VARIANTS:
        ranks = [r[reduction, sampler] for r in both]
        single, ebs, q, rows = _one_step(DataLoader(TensorDataset(x, y), batch_size=len(x)), reduction)
        assert ranks[0]["ebs"] == ranks[1]["ebs"] == ebs == 8
        assert ranks[0]["q"] == ranks[1]["q"] == q == 1.0
        assert ranks[0]["rows"] + ranks[1]["rows"] == rows == 8  # each sample once, globally
        for n in single:
            assert torch.allclose(ranks[0]["update"][n], single[n], rtol=1e-9, atol=1e-12), (reduction, sampler, n)
            assert torch.equal(ranks[0]["update"][n], ranks[1]["update"][n]), (reduction, sampler, n)


def _membership(rank, world, n, batch, epochs):
    x = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    ds = TensorDataset(x)
    model = torch.nn.Linear(1, 1).double()
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt, dl = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(ds, batch_size=batch, sampler=DistributedSampler(ds, num_replicas=world, rank=rank)),
        noise_multiplier=1.0,
        self_check=False,
    )
    counts = torch.zeros(n)
    for _ in range(epochs):
        for (xb,) in dl:
            counts[xb.long().flatten()] += 1
            model(xb).mean().backward()
            opt.step()
    return {"counts": counts, "q": engine.sample_rate, "steps": engine.steps, "eps": engine.get_epsilon(1e-5)}


def test_each_sample_is_sampled_by_one_rank_at_the_global_rate(tmp_path):
    """Uneven shards (9 samples, 2 ranks): every index comes from exactly one rank, at rate q."""
    n, batch, epochs = 9, 2, 300
    ranks = _run(_membership, 2, tmp_path, n, batch, epochs)
    q = ranks[0]["q"]
    assert q == ranks[1]["q"] == pytest.approx(2 * batch / n)
    assert ranks[0]["steps"] == ranks[1]["steps"] and ranks[0]["eps"] == ranks[1]["eps"]
    c0, c1 = ranks[0]["counts"], ranks[1]["counts"]
    assert torch.all((c0 == 0) | (c1 == 0)) and torch.all(c0 + c1 > 0)  # disjoint shards covering the data
    steps = ranks[0]["steps"]
    freq = (c0 + c1) / steps
    assert torch.all((freq - q).abs() < 4 * (q * (1 - q) / steps) ** 0.5), freq


def _pre_sharded(rank, world):
    x, y = _data()
    shard = slice(rank * 4, rank * 4 + 4)  # the old contract: each rank passes its own shard
    try:
        _one_step(DataLoader(TensorDataset(x[shard], y[shard]), batch_size=2), "sum")
    except dpzoo.DPZooError as e:
        return {"error": str(e)}
    return {"error": None}


def test_different_datasets_on_ranks_are_refused(tmp_path):
    ranks = _run(_pre_sharded, 2, tmp_path)
    assert all(r["error"] and "same full dataset on every rank" in r["error"] for r in ranks)


def _batch_per_rank(rank, world):
    x, y = _data()
    try:  # rank 0 samples at batch 4, rank 1 at 2: each would compute its own q and ε
        _one_step(DataLoader(TensorDataset(x, y), batch_size=4 if rank == 0 else 2), "sum")
    except dpzoo.DPZooError as e:
        return {"error": str(e)}
    return {"error": None}


def test_different_batch_sizes_on_ranks_are_refused(tmp_path):
    """A refactor of make_private compared the ranks' settings before the batch size was read
    (found by an independent review): the batch size must be among the settings compared."""
    ranks = _run(_batch_per_rank, 2, tmp_path)
    assert all(r["error"] and "different settings on different ranks (batch_size)" in r["error"] for r in ranks)


def _layouts(rank, world):
    from dpzoo.privacy.distributed import noised_all_reduce

    p = torch.zeros(3, 4, dtype=torch.float64)
    values = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    # one rank's clipped sum is a transposed view (the ghost path's einsum), the other's a fresh tensor
    summed = values.t().contiguous().t() if rank == 0 else values.clone()
    assert summed.is_contiguous() == (rank == 1)
    return {"g": noised_all_reduce(p, summed, 0.0)}


def test_ranks_holding_clipped_sums_in_different_layouts_add_the_same_coordinates(tmp_path):
    """Ranks may take different paths for one layer (the planner's memory budget depends on each
    rank's batch and free memory): the all-reduce must add coordinates, not storage positions."""
    ranks = _run(_layouts, 2, tmp_path)
    want = 2 * torch.arange(12, dtype=torch.float64).reshape(3, 4)
    for r in ranks:
        assert torch.equal(r["g"], want)


def _user_level_step(rank, world, sampling, users_per_rank):
    """One user-level DP step: 8 users of 3 examples, q = 1; per rank its users (ULS, k = 3: all of
    them, so no rank's random choice matters) or its share of the 2 kept per user (ELS)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (24,), generator=g)
    batch = users_per_rank if sampling == "users" else 16 // world
    engine = dpzoo.PrivacyEngine(accountant="pld")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt, dl = engine.make_private(
            module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y), batch_size=batch),
            noise_multiplier=0.8, max_grad_norm=0.3, loss_reduction="sum", noise_seed=42, sample_seed=7,
            privacy_unit="user", user_ids=[i % 8 for i in range(24)], max_examples_per_user=3 if sampling == "users" else 2,
            user_sampling=sampling,
        )  # fmt: skip
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = next(iter(dl))
    F.cross_entropy(model(x), y, reduction="sum").backward()
    opt.step()
    update = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    rows = [int(r) for r in x[:, 0].mul(1e6).round()]  # which examples this rank took
    return {"update": update, "q": engine.sample_rate, "rows": rows, "history": engine.accountant.history}


def _both_user_level_steps(rank, world, users_per_rank):
    return {s: _user_level_step(rank, world, s, users_per_rank) for s in ("users", "examples")}


def test_user_level_two_process_update_equals_single_process(tmp_path):
    """Each user's examples on one rank (ULS), the kept examples split between ranks (ELS, the same
    kept set on both): the global update is the single-process one, each example counted once.
    Both schemes in one spawn (a spawn costs ~10 s)."""
    both = _run(_both_user_level_steps, 2, tmp_path, 4)
    for sampling in ("users", "examples"):
        ranks = [r[sampling] for r in both]
        single = _user_level_step(0, 1, sampling, 8)
        assert ranks[0]["q"] == ranks[1]["q"] == single["q"] == 1.0
        assert sorted(ranks[0]["rows"] + ranks[1]["rows"]) == sorted(single["rows"])
        assert ranks[0]["history"] == single["history"]
        for n in single["update"]:
            assert torch.allclose(ranks[0]["update"][n], single["update"][n], rtol=1e-9, atol=1e-12), (sampling, n)
            assert torch.equal(ranks[0]["update"][n], ranks[1]["update"][n]), (sampling, n)
