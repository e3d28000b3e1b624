"""torch.compile: a DP step of a compiled model (compiled before or after make_private, with dpzoo's
hooks in place) is the eager DP step, on zoo models and in several modes; a graph compiled without
the hooks is never run in their place."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from grad_reference import assert_close, zoo_model_and_inputs
from torch.utils.data import DataLoader, TensorDataset

import dpzoo

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _dp_steps(model, data, loss_fn, mode, steps=2, compile_backend=None):
    """Two DP steps on seeded Poisson batches; the parameters after them and the engine.
    ``compile_backend``: compile the model after make_private, with that backend."""
    engine = dpzoo.PrivacyEngine()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpzoo.ReproducibleNoiseWarning)
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=DataLoader(data, batch_size=3),
            noise_multiplier=0.5,
            max_grad_norm=0.1,
            mode=mode,
            loss_reduction="sum",
            noise_seed=3,
            sample_seed=4,
        )
    if compile_backend is not None:
        model = torch.compile(model, backend=compile_backend)
    it = iter(loader)
    for _ in range(steps):
        batch = next(it)
        if len(batch[0]):
            loss_fn(model, *batch).backward()
        opt.step()
        opt.zero_grad()
    return {n.replace("_orig_mod.", ""): p.detach().clone() for n, p in model.named_parameters()}, engine


@pytest.mark.parametrize(
    "name, mode, backend",
    [
        ("gpt2", "bitfit", "aot_eager"),
        ("resnet18-gn-bias", "bk", "aot_eager"),
    ],
)
def test_compiled_dp_step_equals_the_eager_step(name, mode, backend):
    """``aot_eager``: dynamo's graphs and AOT autograd's backward without code generation: the
    tracing dpzoo's hooks meet, at a fraction of inductor's compile time (inductor: below)."""
    torch._dynamo.reset()
    model, inputs, loss_fn = zoo_model_and_inputs(name, b=8, seed=0)  # a summed loss
    model = model.float().train()
    for m in model.modules():  # compiled dropout draws other masks than eager dropout
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    data = TensorDataset(*(v.float() if v.is_floating_point() else v for v in inputs.values()))
    eager, eager_engine = _dp_steps(copy.deepcopy(model), data, loss_fn, mode)
    compiled, compiled_engine = _dp_steps(torch.compile(copy.deepcopy(model), backend=backend), data, loss_fn, mode)
    assert compiled_engine.steps == eager_engine.steps >= 2  # an empty Poisson batch is a step too
    assert compiled_engine.self_check_result.startswith("passed")
    assert set(compiled) == set(eager)
    moved = False
    for n in eager:
        assert_close(compiled[n], eager[n], 1e-4, n, floor=1e-3)
        moved |= not torch.equal(eager[n], model.state_dict()[n])
    assert moved


def test_inductor_compiled_dp_step_equals_the_eager_step():
    """The default compiler (inductor, generated kernels) on a small sequence model."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8)
    ).train()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(24, 5, 8, generator=g), torch.randn(24, 5, 8, generator=g))

    def loss_fn(m, x, y):
        return (m(x) - y).pow(2).sum()

    for mode in ("auto", "bitfit"):
        eager, eager_engine = _dp_steps(copy.deepcopy(model), data, loss_fn, mode)
        compiled, engine = _dp_steps(torch.compile(copy.deepcopy(model)), data, loss_fn, mode)
        assert engine.steps == eager_engine.steps >= 2 and engine.self_check_result.startswith("passed")
        for n in eager:
            assert_close(compiled[n], eager[n], 1e-5, n, floor=1e-3)


@pytest.mark.parametrize("compile_after_make_private", [False, True])
def test_graphs_compiled_without_the_hooks_are_not_reused(compile_after_make_private):
    """dynamo skips guards on module hooks by default, so a graph traced from a non-private instance
    of the same class could run a DP model without dpzoo's hooks. dpzoo turns hook guards on (and
    drops stale graphs when it hooks a compiled model): either order gives the eager DP step."""
    torch._dynamo.reset()
    model, inputs, loss_fn = zoo_model_and_inputs("gpt2", b=8, seed=0)
    model = model.float().train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    data = TensorDataset(*inputs.values())
    eager, _ = _dp_steps(copy.deepcopy(model), data, loss_fn, "auto")
    public = torch.compile(copy.deepcopy(model), backend="aot_eager")
    loss_fn(public, inputs["ids"]).backward()  # a graph without hooks, in dynamo's cache
    if compile_after_make_private:
        compiled, engine = _dp_steps(copy.deepcopy(model), data, loss_fn, "auto", compile_backend="aot_eager")
    else:
        compiled, engine = _dp_steps(torch.compile(copy.deepcopy(model), backend="aot_eager"), data, loss_fn, "auto")
    assert engine.self_check_result.startswith("passed")
    for n in eager:
        assert_close(compiled[n], eager[n], 1e-4, n, floor=1e-3)
    loss_fn(public, inputs["ids"]).backward()  # and the non-private model still runs its own graph
