"""DP under torch.distributed (2 CPU processes, gloo): clip locally, sum across ranks, noise
once; the update equals the single-process update for the same data, seed and noise."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import dpzoo


def _model():
    torch.manual_seed(0)
    return dpzoo.load("resnet18-gn-bias", num_classes=3, layers=[1, 1, 1, 1], width=4).double().train()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 3, 16, 16, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)


def _one_step(x, y, reduction):
    model = _model()
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    model, opt, loader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                             noise_multiplier=0.8, max_grad_norm=0.5, poisson_sampling=False,
                                             loss_reduction=reduction, noise_seed=42)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    F.cross_entropy(model(x), y, reduction=reduction).backward()
    opt.step()
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}, engine.expected_batch_size


def _worker(rank, world, port, out_dir, reduction):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x, y = _data()
        shard = slice(rank * 4, rank * 4 + 4)
        update, ebs = _one_step(x[shard], y[shard], reduction)
        torch.save({"update": update, "ebs": ebs}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_two_process_update_equals_single_process(tmp_path, reduction):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path), reduction), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    x, y = _data()
    single, ebs = _one_step(x, y, reduction)
    assert ranks[0]["ebs"] == ranks[1]["ebs"] == ebs == 8
    for n in single:
        assert torch.allclose(ranks[0]["update"][n], single[n], rtol=1e-9, atol=1e-12), n
        assert torch.equal(ranks[0]["update"][n], ranks[1]["update"][n]), n
