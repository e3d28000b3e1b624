"""The GPU paths on a real GPU (issue 30): skipped without CUDA, run on every lent device machine.

On CUDA dpzoo takes the paths that launch fewer kernels (``dpzoo.grad_norms.half.LAUNCH_DEVICES``:
the batched Gram, every guard and clipped-sum check with one host read, float64 row norms, the
step's noise in one draw per dtype). The CPU suite runs them by adding "cpu" to that set; here they
run on the GPU's own kernels, in float32 with TF32 off (so float64 brute force on the CPU is the
reference to a float32 tolerance) and the whole DP step against the DP-SGD formula with the noise
drawn from a CUDA generator seeded as the engine's (one flat draw per dtype, in parameter order).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from dp_reference import clip_weights
from grad_reference import assert_close, per_sample_grads, reference, zoo_model_and_inputs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.grad_norms import attach_norm_hooks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# float32 (TF32 off) against float64: the layers' rounding is a few ulps, but a norm is rounded UP by
# its float32 error bound (docs/DESIGN.md, "Rounding"), up to ~3e-4 of it for the 1,100-wide Gram
FP32_TOL = 1e-3
BELOW_TOL = 1e-5  # never below the exact norm by more than the float32 model's own rounding


@pytest.fixture(autouse=True)
def _no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


class _WideLinear(nn.Module):
    """Inputs of 1,100 features at 20 positions: the Gram's chunks go through one batched product."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(1100, 300)
        self.head = nn.Linear(300, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.proj(x))).mean(1)


def _case(case: str):
    if case == "wide-linear":
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(3, 20, 1100, generator=g, dtype=torch.float64)
        y = torch.randint(0, 5, (3,), generator=g)
        return _WideLinear().double(), {"x": x, "y": y}, lambda m, x, y: F.cross_entropy(m(x), y, reduction="sum")
    return zoo_model_and_inputs(case, seed=0)


@pytest.mark.parametrize("mode", ["auto", "ghost", "instantiate"])
@pytest.mark.parametrize("case", ["wide-linear", "gpt2", "resnet18-gn-bias", "vit-tiny-patch16"])
def test_float32_norms_and_clipped_sums_on_cuda_are_those_of_float64_brute_force(case, mode):
    model64, inputs64, loss_fn = _case(case)
    b = next(iter(inputs64.values())).shape[0]
    scale = torch.rand(b, dtype=torch.float64, generator=torch.Generator().manual_seed(9)) + 0.1
    total, per_param, clipped = reference(model64, loss_fn, inputs64, b, scale)
    model = copy.deepcopy(model64).float().cuda()
    inputs = {k: (v.float() if v.is_floating_point() else v).cuda() for k, v in inputs64.items()}
    with attach_norm_hooks(model, mode=mode) as hooks:
        hooks.backward(loss_fn(model, **inputs))
        norms = hooks.per_sample_norms()
        assert norms.is_cuda and norms.dtype == torch.float32
        assert_close(norms.cpu(), total, FP32_TOL, "norms")
        assert (norms.cpu().double() >= total * (1 - BELOW_TOL)).all(), (norms, total)
        # each parameter's own norms, to a floor far below the total's: a small parameter's error shows
        for n, got in hooks.per_param_norms().items():
            assert_close(got.cpu(), per_param[n], FP32_TOL, n, floor=total.max() * 1e-5)
        sums = hooks.clipped_sum(scale.float().cuda())
    biggest = max(c.abs().max() for c in clipped.values())
    for n, c in clipped.items():
        assert_close(sums[n].cpu(), c, FP32_TOL, n, floor=biggest * FP32_TOL)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 600), nn.GELU(), nn.LayerNorm(600), nn.Linear(600, 4))


def _loss(model, x, y):
    return F.cross_entropy(model(x), y, reduction="sum")


def _cuda_noise(params: list[torch.Tensor], std: float, seed: int) -> list[torch.Tensor]:
    """One N(0, std²) draw of every coordinate from a CUDA generator seeded ``seed``, split in order."""
    gen = torch.Generator("cuda").manual_seed(seed)
    flat = torch.empty(sum(p.numel() for p in params), device="cuda").normal_(0.0, std, generator=gen)
    return [part.view(p.shape) for p, part in zip(params, flat.split([p.numel() for p in params]))]


@pytest.mark.parametrize("clipping", ["abadi", "automatic"])
def test_a_dp_step_on_cuda_is_the_dp_sgd_formula(clipping):
    """-lr · (Σ_i C_i g_i + noise) with g_i from a float64 model on the CPU, C_i in closed form, and
    the noise from a CUDA generator seeded as the engine's; the engine's self-check passes on CUDA."""
    model = _mlp()
    model64 = copy.deepcopy(model).double()
    model = model.cuda()
    g = torch.Generator().manual_seed(3)
    ds = TensorDataset(torch.randn(40, 10, generator=g), torch.randint(0, 4, (40,), generator=g))
    sigma, r, lr = 0.7, 0.5, 0.2
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        data_loader=DataLoader(ds, batch_size=8),
        noise_multiplier=sigma,
        max_grad_norm=r,
        loss_reduction="sum",
        clipping=clipping,
        noise_seed=5,
        sample_seed=6,
    )
    x, y = next(iter(loader))
    grads = per_sample_grads(model64, _loss, {"x": x.double(), "y": y}, len(y))
    names = [n for n, _ in model64.named_parameters()]
    norms = torch.stack([torch.sqrt(sum(gi[n].pow(2).sum() for n in names)) for gi in grads])
    c = clip_weights(norms, r, clipping)
    params = list(model.parameters())
    noise = _cuda_noise(params, sigma * r, 5)
    expected = [-lr * (sum(c[i] * grads[i][n] for i in range(len(y))).float().cuda() + z) for n, z in zip(names, noise)]
    before = [p.detach().clone() for p in params]
    _loss(model, x.cuda(), y.cuda()).backward()
    opt.step()
    assert engine.steps == 1 and engine.self_check_result.startswith("passed")
    signal = max(e.abs().max() for e in expected)
    for p, b0, e in zip(params, before, expected):
        assert_close((p.detach() - b0).cpu(), e.cpu(), FP32_TOL, floor=signal)
