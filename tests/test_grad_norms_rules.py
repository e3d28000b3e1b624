"""Every per-sample rule against brute force (a loop of per-sample backward passes), on random
shapes, on the ghost and the instantiate paths, in float64 (≤ 1e-6) and float32 (≤ 1e-4)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F
from grad_reference import assert_close, reference
from torch import nn

import dpzoo
from dpzoo.grad_norms import attach_norm_hooks, float_guard

TOL = {torch.float64: 1e-6, torch.float32: 1e-4}
MODES = ["ghost", "instantiate", "auto"]


class Head(nn.Module):
    """Wraps a layer; the loss is a fixed random functional of its output, per sample."""

    def __init__(self, layer, pre=None):
        super().__init__()
        self.layer, self.pre = layer, pre

    def forward(self, x):
        return self.layer(self.pre(x) if self.pre is not None else x)


def _loss(model, x, target):
    out = model(x)
    return ((out - target) ** 2).sum() + out.sum()


def _case_linear(rng):
    d_in, d_out, t = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 6)
    shape = rng.choice([(d_in,), (t, d_in), (2, t, d_in)])
    return nn.Linear(d_in, d_out, bias=rng.random() < 0.8), shape


def _case_conv(rng):
    nd = rng.choice([1, 2, 3])
    groups = rng.choice([1, 2])
    cin, cout = groups * rng.randint(1, 3), groups * rng.randint(1, 3)
    k = rng.randint(1, 3)
    stride, dil = rng.randint(1, 2), rng.randint(1, 2)
    mode = rng.choice(["zeros", "zeros", "reflect", "circular"])
    pad = rng.choice([0, 1, "same"]) if stride == 1 else rng.choice([0, 1])
    size = {1: 9, 2: 7, 3: 5}[nd]
    conv = [nn.Conv1d, nn.Conv2d, nn.Conv3d][nd - 1](
        cin,
        cout,
        k,
        stride=stride,
        padding=pad,
        dilation=dil,
        groups=groups,
        bias=rng.random() < 0.8,
        padding_mode=mode,
    )
    return conv, (cin,) + (size,) * nd


CASES = {
    **{f"linear-{i}": (lambda i=i: _case_linear(random.Random(i))) for i in range(4)},
    **{f"conv-{i}": (lambda i=i: _case_conv(random.Random(100 + i))) for i in range(8)},
    "conv2d-depthwise": lambda: (nn.Conv2d(4, 4, 3, padding=1, groups=4), (4, 6, 6)),
    "conv2d-stride2-dilation2": lambda: (nn.Conv2d(3, 5, 3, stride=2, padding=2, dilation=2), (3, 9, 8)),
    # padded on one side more than the other ("same" with an even kernel): F.pad, not the convolution's own
    "conv2d-same-even-kernel": lambda: (nn.Conv2d(3, 4, (2, 4), padding="same"), (3, 6, 7)),
    "conv2d-reflect": lambda: (nn.Conv2d(4, 4, 3, padding=(1, 2), padding_mode="reflect", groups=2), (4, 6, 7)),
    "conv1d-circular": lambda: (nn.Conv1d(2, 3, 3, padding=1, padding_mode="circular"), (2, 8)),
    "layernorm": lambda: (nn.LayerNorm(6), (3, 6)),
    "layernorm-2d-shape": lambda: (nn.LayerNorm((3, 4)), (2, 3, 4)),
    "groupnorm": lambda: (nn.GroupNorm(2, 6), (6, 3, 3)),
    "rmsnorm-dpzoo": lambda: (dpzoo.nn.RMSNorm(5, 1e-6), (4, 5)),
    "rmsnorm-torch": lambda: (nn.RMSNorm(5, eps=1e-6), (4, 5)),
}


def _build(case, dtype):
    torch.manual_seed(0)
    layer, shape = CASES[case]()
    layer = layer.to(dtype)
    with torch.no_grad():  # non-trivial affine parameters
        for n, p in layer.named_parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return Head(layer), shape


def _assert_norms(actual, expected, tol, what):
    """A float32 ghost norm is an upper bound, its rounding bound added (grad_norms/rounding.py):
    never below the exact norm, above it by at most LOOSE/2 (float64: the bound is ~1e-13)."""
    if actual.dtype == torch.float32:
        assert (actual.double() >= expected.double() * (1 - tol)).all(), f"{what}: below the exact norm"
        assert_close(actual, expected, tol + float_guard.LOOSE / 2, what)
    else:
        assert_close(actual, expected, tol, what)


def _check(model, inputs, b, dtype, mode, use_hooks_backward=True, loss_fn=_loss):
    g = torch.Generator().manual_seed(7)
    scale = torch.rand(b, generator=g, dtype=dtype) + 0.1
    total, per_param, clipped = reference(model, loss_fn, inputs, b, scale)
    hooks = attach_norm_hooks(model, mode=mode)
    try:
        loss = sum(loss_fn(model, **{k: v[i : i + 1] for k, v in inputs.items()}) for i in range(0))  # noqa
        loss = loss_fn(model, **inputs)
        if use_hooks_backward:
            hooks.backward(loss)
        else:
            loss.backward()
        tol = TOL[dtype]
        _assert_norms(hooks.per_sample_norms(), total, tol, "per_sample_norms")
        got = hooks.per_param_norms()
        assert set(got) == set(per_param)
        for n in per_param:
            _assert_norms(got[n], per_param[n], tol, f"norm of {n}")
        cs = hooks.clipped_sum(scale)
        for n in clipped:
            assert cs[n].shape == clipped[n].shape
            assert_close(cs[n], clipped[n], tol, f"clipped sum of {n}")
    finally:
        hooks.detach()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_rule_matches_brute_force(case, mode, dtype):
    model, shape = _build(case, dtype)
    b = 3
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, *shape, generator=g, dtype=dtype)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    _check(model, {"x": x, "target": target}, b, dtype, mode)


@pytest.mark.parametrize("mode", MODES)
def test_loss_backward_path_equals_ghost_differentiation(mode):
    model, shape = _build("conv-3", torch.float64)
    x = torch.randn(4, *shape, dtype=torch.float64)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    _check(model, {"x": x, "target": target}, 4, torch.float64, mode, use_hooks_backward=False)


class EmbedModel(nn.Module):
    def __init__(self, vocab=11, dim=4, padding_idx=None, tied=False, twice=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=padding_idx)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.out.weight = self.emb.weight  # Phantom Clipping case
        self.twice = twice

    def forward(self, ids):
        h = torch.tanh(self.mix(self.emb(ids)))
        if self.twice:  # a module called twice in one forward pass
            h = torch.tanh(self.mix(h))
        return self.out(h)


def _lm_loss(model, ids, target):
    logits = model(ids)
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", ["plain", "padding_idx", "tied", "tied+twice", "twice"])
def test_embedding_tied_and_reused_modules(variant, mode, dtype):
    torch.manual_seed(3)
    model = EmbedModel(
        padding_idx=0 if variant == "padding_idx" else None, tied="tied" in variant, twice="twice" in variant
    ).to(dtype)
    b, t = 4, 6
    ids = torch.randint(0, 11, (b, t))
    ids[0, :2] = 0  # repeated tokens and, for padding_idx, padding
    ids[1, 3] = ids[1, 4]
    target = torch.randint(0, 11, (b, t))
    _check(model, {"ids": ids, "target": target}, b, dtype, mode, loss_fn=_lm_loss)


def test_phantom_clipping_memory_is_o_bl2_not_o_bv2():
    """The tied embedding's cross term never forms a (B, V, d) or (V, V) tensor."""
    from dpzoo.grad_norms import reps as R

    b, t, v, d = 2, 5, 5000, 3
    ids = torch.randint(0, v, (b, t))
    emb = R.OneHot(ids, torch.randn(b, t, d), v)
    out = R.Factored(torch.randn(b, 1, t, v), torch.randn(b, 1, t, d), (v, d))
    called = []
    orig = R.instantiate
    R.instantiate = lambda rep: called.append(rep) or orig(rep)
    try:
        val = R.inner(emb, out)
        ghost = R.sq_norm(emb)
    finally:
        R.instantiate = orig
    assert called == []  # no per-sample gradient instantiated
    dense = orig(emb) * 1.0
    expected = (dense * orig(out)).flatten(1).sum(1)
    assert_close(val, expected, 1e-5, "cross term")
    assert_close(ghost, dense.flatten(1).pow(2).sum(1), 1e-5, "embedding ghost norm")


class Loose(nn.Module):
    """A module owning tensors directly, like timm's VisionTransformer (cls_token, pos_embed)."""

    def __init__(self, d=4, n=3):
        super().__init__()
        self.cls_token = nn.Parameter(torch.randn(1, 1, d))
        self.pos_embed = nn.Parameter(torch.randn(1, n + 1, d))
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.proj(torch.tanh(x))


def test_loose_parameters_need_a_declared_owner():
    with pytest.raises(dpzoo.UnsupportedModuleError, match="cls_token, pos_embed.*register_loose_tensors"):
        attach_norm_hooks(Loose())


@pytest.mark.parametrize("mode", MODES)
def test_loose_parameters(mode):
    from dpzoo.grad_norms import LOOSE_TENSORS, register_loose_tensors

    register_loose_tensors(Loose, ("cls_token", "pos_embed"))
    request_cleanup = lambda: LOOSE_TENSORS.pop(Loose, None)  # noqa: E731
    torch.manual_seed(4)
    model = Loose().double()
    x = torch.randn(3, 3, 4, dtype=torch.float64)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    try:
        _check(model, {"x": x, "target": target}, 3, torch.float64, mode)
    finally:
        request_cleanup()


def test_hf_conv1d_and_timm_layers():
    from timm.layers import LayerScale
    from timm.layers.conv2d_same import Conv2dSame
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(5)
    for layer, shape in [
        (Conv1D(6, 4), (3, 4)),
        (LayerScale(4, init_values=0.5), (3, 4)),
        (Conv2dSame(3, 4, 3, stride=2), (3, 8, 7)),
    ]:
        model = Head(layer).double()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.3)
        x = torch.randn(3, *shape, dtype=torch.float64)
        with torch.no_grad():
            target = torch.randn_like(model(x))
        for mode in MODES:
            _check(model, {"x": x, "target": target}, 3, torch.float64, mode)


def test_groupnorm_act_pulls_gradient_through_activation():
    from timm.layers.norm_act import GroupNormAct

    torch.manual_seed(6)
    model = Head(GroupNormAct(4, num_groups=2, act_layer=nn.ReLU, inplace=False)).double()
    x = torch.randn(3, 4, 3, 3, dtype=torch.float64)
    with torch.no_grad():
        target = torch.randn_like(model(x))
    _check(model, {"x": x, "target": target}, 3, torch.float64, "auto")


@pytest.mark.parametrize("case", [c for c in sorted(CASES) if c.startswith("conv")])
def test_per_sample_gradients_by_grouped_convolution_match_brute_force(case, monkeypatch):
    """On a CPU a convolution's instantiated per-sample gradients come from one convolution with
    the batch folded into its groups (no patches) from GROUPED_MIN_POSITIONS output positions on;
    forced here for every convolution case (1-3 d, groups, stride, dilation, padding modes)."""
    from dpzoo.grad_norms.rules import conv

    calls = []
    real = conv.by_grouped_convolution
    monkeypatch.setattr(conv, "GROUPED_MIN_POSITIONS", 0)
    monkeypatch.setattr(conv, "by_grouped_convolution", lambda *a: calls.append(1) or real(*a))
    model, shape = _build(case, torch.float32)
    b = 3
    x = torch.randn(b, *shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        target = torch.randn_like(model(x))
    _check(model, {"x": x, "target": target}, b, torch.float32, "instantiate")
    assert calls  # the route ran


def _patches_by_loop(x, module, positions=None):
    """Each output position's window, read element by element from the zero-padded input:
    (B, G, T, C/G · ∏k) with the features in the weight's (C/G, *kernel) order."""
    nd, g = x.dim() - 2, module.groups
    kernel, stride, dilation = module.weight.shape[2:], module.stride, module.dilation
    pad = [p for i in reversed(range(nd)) for p in (module.padding[i],) * 2]
    xp = torch.nn.functional.pad(x, pad)
    outs = [(xp.shape[2 + i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1 for i in range(nd)]
    if positions is not None:
        outs = [min(o, n) for o, n in zip(outs, positions)]
    rows = []
    for pos in itertools.product(*[range(o) for o in outs]):
        window = []
        for c in range(x.shape[1]):
            for k in itertools.product(*[range(n) for n in kernel]):
                idx = tuple(pos[i] * stride[i] + k[i] * dilation[i] for i in range(nd))
                window.append(xp[(slice(None), c) + idx])
        rows.append(torch.stack(window, 1))  # (B, C·∏k)
    out = torch.stack(rows, 1)  # (B, T, C·∏k), C-major
    b, t = out.shape[:2]
    return out.reshape(b, t, g, -1).transpose(1, 2)


@pytest.mark.parametrize(
    "nd,channels,groups,kernel,stride,dilation,padding,size,positions",
    [
        (2, 4, 1, 3, 1, 1, 1, 5, None),
        (2, 6, 3, 3, 2, 1, 1, 7, None),
        (2, 4, 2, (2, 3), (1, 2), (2, 1), (1, 0), 6, None),
        (2, 3, 1, 1, 1, 1, 0, 4, None),
        (2, 4, 1, 3, 1, 1, 1, 1, None),
        (2, 4, 1, 3, 1, 1, 1, 5, (3, 4)),
        (1, 4, 2, 3, 2, 2, 2, 9, None),
        (3, 4, 4, 2, 1, 1, 1, 3, None),
    ],
)
@pytest.mark.parametrize("route", ["cpu", "launching"])
def test_convolution_patches_equal_the_windows_read_one_by_one(
    nd, channels, groups, kernel, stride, dilation, padding, size, positions, route, monkeypatch
):
    """The patches the conv rule unfolds (on a CPU gathered channels-last, then transposed per row;
    on a device that launches kernels gathered in the weight's order) hold exactly each window of
    the padded input, in the weight's feature order, per group."""
    from dpzoo.grad_norms import half
    from dpzoo.grad_norms.rules.conv import unfold_patches

    if route == "launching":  # as the cost trace runs a GPU's operators on a CPU
        monkeypatch.setattr(half, "LAUNCH_DEVICES", {"cuda", "cpu"})

    conv = getattr(nn, f"Conv{nd}d")(channels, 2 * groups, kernel, stride, padding, dilation, groups)
    x = torch.randn(2, channels, *([size] * nd), generator=torch.Generator().manual_seed(nd + channels))
    pad = [p for i in reversed(range(nd)) for p in (conv.padding[i],) * 2]
    got = unfold_patches(x, conv, pad, "constant", positions)
    assert torch.equal(got, _patches_by_loop(x, conv, positions))


@pytest.mark.parametrize("mode", ["instantiate", "ghost"])
def test_a_convolution_whose_attributes_no_longer_fit_its_input_is_refused(mode):
    """Padding removed after the forward: a 3×3 kernel no longer fits the 1×1 input along either
    dimension. Refused with dpzoo's error when the step is assembled (each dimension's count of
    windows is -1; their product matched the output's single position: found by a review)."""
    from dpzoo.errors import UnsupportedModuleError

    model = nn.Conv2d(2, 3, 3, padding=1)
    hooks = attach_norm_hooks(model, mode=mode)
    try:
        y = model(torch.randn(2, 2, 1, 1))
        model.padding = (0, 0)
        with pytest.raises(UnsupportedModuleError, match="0 output positions per sample"):
            hooks.backward(y.sum())
            hooks.per_param_norms()
    finally:
        hooks.detach()


@pytest.mark.parametrize("mode", ["instantiate", "ghost"])
def test_a_convolution_input_edited_in_place_after_the_step_is_assembled_is_refused(mode):
    """The patches (ghost) and the grouped route (instantiation) read the layer's input when the
    norms are taken, after the step was assembled: an in-place edit in between is refused, not
    used (found by an independent review: the norms read the edited values, 100x)."""
    from dpzoo.errors import UnsupportedModuleError

    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=0))
    x = torch.randn(2, 3, 6, 6)
    hooks = attach_norm_hooks(model, mode=mode)
    try:
        hooks.backward(model(x).sum())
        hooks.plan()
        x.mul_(100.0)
        with pytest.raises(UnsupportedModuleError, match="modified in place after the step was assembled"):
            hooks.per_param_norms()
    finally:
        hooks.detach()
