"""Model surgery (``dpzoo.surgery``) on arbitrary ``nn.Module``s, not zoo entries.

Covers BatchNorm -> GroupNorm, group-count choice, BiTFiT-Add biases (incl. RMSNorm
replacement), in-place op removal / detection, tied parameters, ``check_dp_ready`` and
``dpzoo.summary``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dpzoo
from dpzoo import PatchError, check_dp_ready, find_inplace_ops, find_tied_parameters, make_dp_ready
from dpzoo.nn import DPBasicBlock, DPBottleneck, RMSNorm
from dpzoo.surgery import add_missing_biases, choose_num_groups, convert_batchnorm, disable_inplace

timm = pytest.importorskip("timm")
from timm.layers import BatchNormAct2d  # noqa: E402
from timm.models.resnet import BasicBlock, Bottleneck  # noqa: E402

# --------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randomize_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Give every parameter (and BN running stat) random values, so copies can be checked."""
    g = _gen(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype))
        for m in module.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
                m.running_mean.copy_(torch.randn(m.num_features, generator=g))
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    return module


def _ref_group_norm(x, groups, weight, bias, eps):
    """Independent float64 GroupNorm: per sample, per group of channels, biased variance."""
    n, c = x.shape[:2]
    xs = x.double().reshape(n, groups, -1)
    mean = xs.mean(-1, keepdim=True)
    var = xs.var(-1, unbiased=False, keepdim=True)
    y = ((xs - mean) / torch.sqrt(var + eps)).reshape(x.shape)
    if weight is not None:
        shape = (1, c) + (1,) * (x.dim() - 2)
        y = y * weight.double().reshape(shape) + bias.double().reshape(shape)
    return y


def _bn_modules(model):
    return [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


BN_CASES = [
    pytest.param(nn.BatchNorm1d, (4, 8), id="bn1d-NC"),
    pytest.param(nn.BatchNorm1d, (4, 8, 5), id="bn1d-NCL"),
    pytest.param(nn.BatchNorm2d, (4, 8, 3, 3), id="bn2d"),
    pytest.param(nn.BatchNorm3d, (4, 8, 2, 3, 3), id="bn3d"),
    pytest.param(nn.SyncBatchNorm, (4, 8, 3, 3), id="syncbn"),
]


# --------------------------------------------------------------------------- 1. BatchNorm -> GroupNorm


@pytest.mark.parametrize("bn_cls, shape", BN_CASES)
def test_batchnorm_becomes_groupnorm_with_copied_affine(bn_cls, shape):
    bn = bn_cls(8, eps=1e-3, dtype=torch.float64)
    _randomize_(bn, seed=1)
    gamma, beta = bn.weight.detach().clone(), bn.bias.detach().clone()
    model = nn.Sequential(nn.Identity(), bn)

    model, report = convert_batchnorm(model)
    gn = model[1]
    assert type(gn) is nn.GroupNorm
    assert _bn_modules(model) == []
    assert report.converted == {"1": (8, gn.num_groups)}
    assert gn.num_channels == 8 and gn.num_groups == choose_num_groups(8) == 4
    assert gn.eps == 1e-3
    assert gn.affine
    assert gn.weight.dtype == torch.float64
    assert torch.equal(gn.weight, gamma) and torch.equal(gn.bias, beta)
    assert not torch.equal(gamma, torch.ones_like(gamma))  # the copy is not a fresh init

    x = torch.randn(shape, dtype=torch.float64, generator=_gen(2))
    out = model(x)
    torch.testing.assert_close(out, _ref_group_norm(x, 4, gamma, beta, 1e-3), rtol=0, atol=1e-12)


@pytest.mark.parametrize("bn_cls, shape", BN_CASES)
def test_converted_batchnorm_is_per_sample_independent_in_train_mode(bn_cls, shape):
    bn = _randomize_(bn_cls(8), seed=3)
    model = nn.Sequential(bn).train()
    make_dp_ready(model)
    assert model.training and model[0].training

    x = torch.randn(shape, generator=_gen(4))
    x2 = x.clone()
    x2[1:] = torch.randn(x2[1:].shape, generator=_gen(5)) * 3 + 1  # change every other sample
    out, out2 = model(x), model(x2)
    assert torch.equal(out[0], out2[0])
    assert not torch.allclose(out[1:], out2[1:])


def test_batchnorm_itself_mixes_samples_in_train_mode():
    """Sanity check of the independence test above: it would fail on the unpatched BN."""
    bn = nn.BatchNorm2d(8).train()
    x = torch.randn(4, 8, 3, 3, generator=_gen(4))
    x2 = x.clone()
    x2[1:] = x2[1:] * 3 + 1
    assert not torch.allclose(bn(x)[0], bn(x2)[0])


def test_whole_cnn_is_per_sample_independent_after_make_dp_ready():
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 16, 3, stride=2, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 6),
        nn.BatchNorm1d(6),
    ).train()
    _randomize_(model, seed=6)
    make_dp_ready(model)
    x = torch.randn(5, 3, 8, 8, generator=_gen(7))
    x2 = x.clone()
    x2[1:] = torch.randn(x2[1:].shape, generator=_gen(8))
    torch.testing.assert_close(model(x)[0], model(x2)[0], rtol=0, atol=0)


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 6, 1), nn.BatchNorm2d(6))
        self.norms = nn.ModuleList([nn.BatchNorm2d(6), nn.Identity()])
        self.heads = nn.ModuleDict({"a": nn.BatchNorm1d(12)})

    def forward(self, x):
        x = self.norms[0](self.body(x))
        return self.heads["a"](x.mean((2, 3)).repeat(1, 2))


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem_bn = nn.BatchNorm2d(3)
        self.inner = _Inner()
        self.deeper = nn.Sequential(nn.Sequential(_Inner()))

    def forward(self, x):
        return self.inner(self.stem_bn(x)) + self.deeper(x)


def test_nested_batchnorms_in_custom_modules_are_all_converted():
    model = _randomize_(_Outer(), seed=9)
    before = {
        n: (m.weight.detach().clone(), m.bias.detach().clone(), m.num_features)
        for n, m in model.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    }
    assert len(before) == 7
    out = make_dp_ready(model)
    assert out is model
    assert _bn_modules(model) == []
    report = model.dpzoo_patch_report
    assert set(report.groupnorm) == set(before)
    for name, (w, b, c) in before.items():
        gn = model.get_submodule(name)
        assert isinstance(gn, nn.GroupNorm)
        assert report.groupnorm[name] == (c, gn.num_groups)
        assert torch.equal(gn.weight, w) and torch.equal(gn.bias, b)
    assert model(torch.randn(2, 3, 4, 4)).shape == (2, 12)


def test_model_that_is_a_batchnorm_is_replaced():
    bn = _randomize_(nn.BatchNorm2d(16, eps=1e-4), seed=10)
    new, report = convert_batchnorm(bn)
    assert type(new) is nn.GroupNorm and new is not bn
    assert report.converted == {"": (16, 8)}
    assert torch.equal(new.weight, bn.weight) and torch.equal(new.bias, bn.bias)
    assert new.eps == 1e-4

    bn2 = _randomize_(nn.BatchNorm1d(6), seed=11)
    patched = make_dp_ready(bn2)
    assert type(patched) is nn.GroupNorm and patched.num_groups == 3
    assert patched.dpzoo_patch_report.groupnorm == {"": (6, 3)}
    assert isinstance(bn2, nn.BatchNorm1d)  # the caller's object is not mutated into something else


def test_affine_false_batchnorm_gives_affine_false_groupnorm():
    model = nn.Sequential(nn.BatchNorm2d(8, affine=False, eps=1e-2))
    make_dp_ready(model)
    gn = model[0]
    assert isinstance(gn, nn.GroupNorm) and not gn.affine
    assert gn.weight is None and gn.bias is None
    assert list(model.parameters()) == []
    assert gn.eps == 1e-2
    x = torch.randn(3, 8, 2, 2, dtype=torch.float32, generator=_gen(12))
    torch.testing.assert_close(model(x).double(), _ref_group_norm(x, 4, None, None, 1e-2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eps", [1e-5, 1e-3, 0.25])
def test_eps_preserved(eps):
    model = nn.Sequential(nn.BatchNorm1d(4, eps=eps))
    convert_batchnorm(model)
    assert model[0].eps == eps


def test_train_eval_mode_and_requires_grad_preserved():
    model = nn.Sequential(nn.BatchNorm2d(4), nn.BatchNorm2d(4), nn.BatchNorm2d(4))
    model[0].eval()
    model[1].weight.requires_grad_(False)
    model[2].bias.requires_grad_(False)
    make_dp_ready(model)
    assert [m.training for m in model] == [False, True, True]
    assert [(m.weight.requires_grad, m.bias.requires_grad) for m in model] == [
        (True, True),
        (False, True),
        (True, False),
    ]

    model2 = nn.Sequential(nn.BatchNorm2d(4)).eval()
    make_dp_ready(model2)
    assert model2[0].training is False


def test_timm_batchnormact2d_keeps_its_activation():
    bna = BatchNormAct2d(8, act_layer=nn.ReLU, dtype=torch.float64)
    _randomize_(bna, seed=13)
    gamma, beta = bna.weight.detach().clone(), bna.bias.detach().clone()
    model = nn.Sequential(nn.Identity(), bna)
    make_dp_ready(model)
    gn = model[1]
    assert isinstance(gn, nn.GroupNorm)
    assert _bn_modules(model) == []
    assert torch.equal(gn.weight, gamma) and torch.equal(gn.bias, beta)

    x = torch.randn(3, 8, 4, 4, dtype=torch.float64, generator=_gen(14))
    pre = F.group_norm(x, gn.num_groups, gamma, beta, bna.eps)
    assert (pre < 0).any()  # otherwise the ReLU check below would prove nothing
    out = model(x)
    assert (out >= 0).all()
    torch.testing.assert_close(out, torch.relu(pre), rtol=0, atol=1e-12)
    # make_dp_ready also switched the fused activation's in-place flag off
    assert check_dp_ready(model) == []


# --------------------------------------------------------------------------- 2. group count


def _primes(upto):
    return [p for p in range(2, upto + 1) if all(p % d for d in range(2, int(p**0.5) + 1))]


def test_choose_num_groups_properties_for_1_to_300():
    for c in range(1, 301):
        g = choose_num_groups(c)
        assert 1 <= g <= 32, c
        assert c % g == 0, c
        if c > 1:
            assert c // g >= 2, f"C={c}: one-channel groups"
        # the largest admissible count (docstring contract)
        better = [h for h in range(g + 1, 33) if c % h == 0 and c // h >= 2]
        assert not better, (c, g, better)


def test_choose_num_groups_examples():
    assert choose_num_groups(64) == 32
    assert choose_num_groups(16) == 8
    assert choose_num_groups(32) == 16
    assert choose_num_groups(1) == 1
    assert choose_num_groups(2) == 1
    assert choose_num_groups(512) == 32
    for p in _primes(300):
        assert choose_num_groups(p) == 1, p
    with pytest.raises(PatchError):
        choose_num_groups(0)


def test_gn_groups_int_not_dividing_raises_naming_the_module():
    model = _Outer()
    with pytest.raises(PatchError, match="stem_bn"):
        convert_batchnorm(model, gn_groups=2)  # stem_bn has 3 channels
    with pytest.raises(PatchError, match="stem_bn"):
        make_dp_ready(_Outer(), gn_groups=2)


def test_gn_groups_int_that_divides_is_used():
    model = nn.Sequential(nn.BatchNorm2d(12), nn.BatchNorm1d(6))
    convert_batchnorm(model, gn_groups=3)
    assert [m.num_groups for m in model] == [3, 3]


def test_gn_groups_callable_is_used():
    calls = []

    def spec(name, channels):
        calls.append((name, channels))
        return channels  # instance-norm-like, deliberately unlike "auto"

    model = nn.Sequential(nn.BatchNorm2d(12), nn.Sequential(nn.BatchNorm1d(6)))
    make_dp_ready(model, gn_groups=spec)
    assert calls == [("0", 12), ("1.0", 6)]
    assert model[0].num_groups == 12 and model[1][0].num_groups == 6
    assert model.dpzoo_patch_report.groupnorm == {"0": (12, 12), "1.0": (6, 6)}


def test_gn_groups_callable_returning_non_divisor_raises():
    with pytest.raises(PatchError, match="bad"):
        convert_batchnorm(nn.ModuleDict({"bad": nn.BatchNorm2d(8)}), gn_groups=lambda n, c: 3)


@pytest.mark.parametrize("spec", [2.0, "eight", True, None, [4]])
def test_gn_groups_wrong_type_raises(spec):
    with pytest.raises(PatchError):
        convert_batchnorm(nn.Sequential(nn.BatchNorm2d(8)), gn_groups=spec)


# --------------------------------------------------------------------------- 3. BiTFiT-Add biases

LAYER_CASES = [
    pytest.param(lambda: nn.Linear(7, 5, bias=False), (4, 7), 5, id="linear"),
    pytest.param(lambda: nn.Conv1d(3, 4, 3, bias=False), (2, 3, 9), 4, id="conv1d"),
    pytest.param(lambda: nn.Conv2d(3, 6, 3, groups=3, bias=False), (2, 3, 6, 6), 6, id="conv2d"),
    pytest.param(lambda: nn.Conv3d(3, 4, 2, bias=False), (2, 3, 4, 4, 4), 4, id="conv3d"),
    pytest.param(
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, bias=False), (2, 4, 5, 5), 6, id="convtranspose2d"
    ),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("make, shape, out_ch", LAYER_CASES)
def test_zero_bias_added_and_outputs_bit_identical(make, shape, out_ch, dtype):
    layer = make().to(dtype)
    ref = copy.deepcopy(layer)
    model = nn.Sequential(layer)
    report = add_missing_biases(model)
    assert report.added == ["0"]
    assert isinstance(layer.bias, nn.Parameter)
    assert layer.bias.shape == (out_ch,) and layer.bias.dtype == dtype
    assert torch.count_nonzero(layer.bias) == 0
    assert layer.bias.requires_grad
    for seed in range(3):
        x = torch.randn(shape, generator=_gen(seed)).to(dtype)
        assert torch.equal(layer(x), ref(x))


def test_normal_init_std_and_seed_reproducibility():
    def make():
        return nn.Sequential(nn.Linear(3, 4000, bias=False), nn.Conv2d(3, 2000, 1, bias=False))

    a, b, c = make(), make(), make()
    add_missing_biases(a, init="normal", std=0.01, seed=7)
    add_missing_biases(b, init="normal", std=0.01, seed=7)
    add_missing_biases(c, init="normal", std=0.01, seed=8)
    for la, lb, lc in zip(a, b, c):
        assert torch.count_nonzero(la.bias) == la.bias.numel()
        assert torch.equal(la.bias, lb.bias)
        assert not torch.equal(la.bias, lc.bias)
        assert abs(la.bias.std().item() - 0.01) < 0.001
        assert abs(la.bias.mean().item()) < 0.001
    # through make_dp_ready too, and the report says "random"
    d = make_dp_ready(make(), bias_init="normal", bias_std=0.01, bias_seed=7)
    assert torch.equal(d[0].bias, a[0].bias)
    assert any("random biases" in line for line in d.dpzoo_patch_report.lines())


def test_bad_bias_init_raises():
    with pytest.raises(PatchError, match="init"):
        add_missing_biases(nn.Sequential(nn.Linear(2, 2, bias=False)), init="uniform")
    with pytest.raises(PatchError):
        add_missing_biases(nn.Sequential(nn.Linear(2, 2, bias=False)), init="normal", std=0.0)
    with pytest.raises(PatchError):
        make_dp_ready(nn.Sequential(nn.Linear(2, 2, bias=False)), bias_init="kaiming")


class _Enc(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4, bias=False)
        self.k = nn.Linear(4, 4, bias=False)


def test_exclude_patterns_are_honoured():
    model = nn.Module()
    model.enc = _Enc()
    model.mid = nn.Linear(4, 4, bias=False)
    model.head = nn.Linear(4, 2, bias=False)
    report = add_missing_biases(model, exclude=["head", "enc.*"])
    assert report.added == ["mid"]
    assert model.head.bias is None and model.enc.q.bias is None and model.enc.k.bias is None
    assert model.mid.bias is not None

    model2 = nn.Module()
    model2.enc = _Enc()
    make_dp_ready(model2, bias_exempt=["enc.k"])
    assert model2.enc.q.bias is not None and model2.enc.k.bias is None


def test_existing_biases_are_untouched():
    model = nn.Sequential(nn.Linear(3, 3), nn.Conv2d(3, 3, 1), nn.LayerNorm(3), nn.Linear(3, 3, bias=False))
    _randomize_(model, seed=15)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    report = add_missing_biases(model)
    assert report.added == ["3"]
    for n, (p, val) in before.items():
        q = dict(model.named_parameters())[n]
        assert q is p and torch.equal(q, val)


@pytest.mark.parametrize("shape", [(6,), (3, 4)])
def test_layernorm_without_bias_gets_one_with_identical_outputs(shape):
    ln = nn.LayerNorm(shape, bias=False)
    _randomize_(ln, seed=16)
    ref = copy.deepcopy(ln)
    report = add_missing_biases(nn.Sequential(ln))
    assert report.added == ["0"]
    assert ln.bias.shape == ln.weight.shape == torch.Size(shape)
    assert torch.count_nonzero(ln.bias) == 0
    x = torch.randn((2, 5) + tuple(shape), generator=_gen(17))
    assert torch.equal(ln(x), ref(x))


def test_affine_false_norms_reported_not_patched():
    norms = (
        nn.LayerNorm(4, elementwise_affine=False),
        nn.GroupNorm(2, 4, affine=False),
        nn.RMSNorm(4, elementwise_affine=False),
    )
    # a model with nothing trainable is refused (the engine would train nothing)
    assert any("no trainable parameters" in p for p in check_dp_ready(nn.Sequential(*norms)))
    model = nn.Sequential(*norms, nn.Linear(4, 2))
    report = add_missing_biases(model)
    assert report.added == []
    assert set(report.not_patched) == {"0", "1", "2"}
    assert [n for n, _ in model.named_parameters()] == ["3.weight", "3.bias"]
    assert model[0].bias is None and model[1].bias is None
    assert type(model[2]) is nn.RMSNorm
    # and these parameter-free layers are not "problems" either
    assert check_dp_ready(model) == []
    assert check_dp_ready(model, require_bias=True) == []
    patched = make_dp_ready(model)
    assert set(patched.dpzoo_patch_report.not_patched) == {"0", "1", "2"}


def test_norms_false_leaves_norm_layers_alone():
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.LayerNorm(4, bias=False), nn.RMSNorm(4))
    report = add_missing_biases(model, norms=False)
    assert report.added == ["0"]
    assert model[1].bias is None and type(model[2]) is nn.RMSNorm


def _mha_out(mha, x):
    return mha(x, x, x, need_weights=False)[0]


def test_multihead_attention_without_bias_gets_in_proj_bias():
    mha = nn.MultiheadAttention(8, 2, bias=False, batch_first=True)
    _randomize_(mha, seed=18)
    ref = copy.deepcopy(mha)
    report = add_missing_biases(nn.Sequential(mha))
    assert set(report.added) == {"0", "0.out_proj"}
    assert mha.in_proj_bias.shape == (24,) and torch.count_nonzero(mha.in_proj_bias) == 0
    assert "in_proj_bias" in dict(mha.named_parameters())
    mha.train(), ref.train()
    x = torch.randn(2, 5, 8, generator=_gen(19))
    assert torch.equal(_mha_out(mha, x), _mha_out(ref, x))
    # inference (eval + no_grad) may switch torch to its fused fast path, which only
    # exists with biases: same function, but not necessarily bit for bit
    mha.eval(), ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(_mha_out(mha, x), _mha_out(ref, x))


def test_multihead_attention_with_kdim_gets_in_proj_bias():
    mha = nn.MultiheadAttention(8, 2, bias=False, kdim=6, vdim=5, batch_first=True)
    _randomize_(mha, seed=20)
    ref = copy.deepcopy(mha)
    report = add_missing_biases(nn.Sequential(mha))
    assert "0" in report.added
    assert mha.in_proj_bias is not None and mha.in_proj_bias.shape == (24,)
    q = torch.randn(2, 3, 8, generator=_gen(21))
    k = torch.randn(2, 4, 6, generator=_gen(22))
    v = torch.randn(2, 4, 5, generator=_gen(23))
    assert torch.equal(mha(q, k, v)[0], ref(q, k, v)[0])
    # a raw MultiheadAttention has no per-sample rule: refused, with the fix named
    assert any("DPMultiheadAttention" in p for p in check_dp_ready(nn.Sequential(mha)))
    assert check_dp_ready(make_dp_ready(nn.Sequential(mha)), require_bias=True) == []


def _llama_rmsnorm(dim, eps=1e-6):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    return llama.LlamaRMSNorm(dim, eps=eps)


RMS_CASES = [
    pytest.param(lambda: _llama_rmsnorm(16, eps=1e-5), id="llama"),
    pytest.param(lambda: nn.RMSNorm(16, eps=1e-5), id="torch"),
    pytest.param(lambda: nn.RMSNorm(16), id="torch-eps-None"),
]


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make", RMS_CASES)
def test_rmsnorm_replaced_with_bias_and_identical_outputs(make, dtype):
    norm = make().to(dtype)
    _randomize_(norm, seed=24)
    ref = copy.deepcopy(norm)
    model = nn.Sequential(norm)
    report = add_missing_biases(model)
    new = model[0]
    assert type(new) is RMSNorm
    assert report.added == ["0"] and report.replaced_norms == ["0"]
    assert new.weight.dtype == dtype and new.bias.dtype == dtype
    assert torch.equal(new.weight, ref.weight)
    assert torch.count_nonzero(new.bias) == 0 and new.bias.requires_grad
    for seed in range(3):
        x = (torch.randn(2, 7, 16, generator=_gen(seed)) * 3).to(dtype)
        assert torch.equal(new(x), ref(x))


@pytest.mark.parametrize("make", RMS_CASES[:2])
def test_rmsnorm_replacement_copies_requires_grad_and_mode(make):
    norm = make()
    norm.weight.requires_grad_(False)
    norm.eval()
    model = nn.Sequential(norm)
    make_dp_ready(model)
    new = model[0]
    assert type(new) is RMSNorm
    assert not new.weight.requires_grad and not new.bias.requires_grad
    assert not new.training
    assert model.dpzoo_patch_report.norms_replaced == ["0"]


class GemmaLikeRMSNorm(nn.Module):
    """Gemma's norm: x̂ · (1 + weight); not the same function as LLaMA's."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def test_gemma_like_rmsnorm_is_replaced_in_its_own_arithmetic():
    """(1 + w) ⊙ x̂ in float32, cast back: replaced by dpzoo's RMSNorm in the "gemma" style, bit for
    bit, with a zero bias; an RMSNorm of any other arithmetic is left alone and reported."""
    norm = GemmaLikeRMSNorm(16)
    _randomize_(norm, seed=25)
    ref = copy.deepcopy(norm)
    model = nn.Sequential(nn.Linear(16, 16), norm)
    report = add_missing_biases(model)
    assert isinstance(model[1], RMSNorm) and model[1].style == "gemma" and report.replaced_norms == ["1"]
    x = torch.randn(2, 16, generator=_gen(26))
    assert torch.equal(model[1](x), ref(x)) and torch.equal(model[1].weight, ref.weight)
    assert model[1].bias is not None and model[1].bias.abs().max() == 0

    class OtherRMSNorm(GemmaLikeRMSNorm):
        def forward(self, x):
            return super().forward(x) * 2

    other = OtherRMSNorm(16)
    model = nn.Sequential(nn.Linear(16, 16), other)
    report = add_missing_biases(model)
    assert model[1] is other and "1" in report.not_patched


def _meta_model():
    m = nn.Module()
    m.conv = nn.Conv2d(3, 8, 3, bias=False)
    m.bn = nn.BatchNorm2d(8)
    m.lin = nn.Linear(8, 16, bias=False)
    m.ln = nn.LayerNorm(16, bias=False)
    m.rms = _llama_rmsnorm(16)
    m.trms = nn.RMSNorm(16)
    m.mha = nn.MultiheadAttention(16, 2, bias=False)
    m.act = nn.ReLU(inplace=True)
    return m


@pytest.mark.parametrize("patch_inside_meta_block", [False, True])
def test_meta_device_models_can_be_patched(patch_inside_meta_block):
    with torch.device("meta"):
        model = _meta_model()
        if patch_inside_meta_block:
            make_dp_ready(model)
    if not patch_inside_meta_block:
        make_dp_ready(model)
    rep = model.dpzoo_patch_report
    assert set(rep.biases_added) == {
        "conv",
        "lin",
        "ln",
        "rms",
        "trms",
        "mha.q_proj",
        "mha.k_proj",
        "mha.v_proj",
        "mha.out_proj",
    }
    assert set(rep.norms_replaced) == {"rms", "trms"}
    assert type(model.rms) is RMSNorm and model.rms.style == "llama"
    assert type(model.trms) is RMSNorm and model.trms.style == "torch"
    assert isinstance(model.bn, nn.GroupNorm)
    assert all(p.is_meta for p in model.parameters())
    assert model.conv.bias.shape == (8,) and model.mha.q_proj.bias.shape == (16,)
    assert check_dp_ready(model, require_bias=True) == []


# --------------------------------------------------------------------------- 4. in-place ops


class _AddInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        y += x
        return y


class _InplaceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)
        self.res = _AddInPlace()

    def forward(self, x):
        return self.res(self.act(self.fc(x)))


def test_find_inplace_ops_reports_module_names():
    model = _InplaceNet()
    x = torch.randn(3, 4, generator=_gen(27))
    expected = model(x).detach().clone()
    ops = find_inplace_ops(model, x)
    assert {op.module for op in ops} == {"act", "res"}
    assert any("relu" in op.op for op in ops if op.module == "act")
    assert all(op.op in ("__iadd__", "add_") for op in ops if op.module == "res")
    assert "res" in str([o for o in ops if o.module == "res"][0])
    # the probe leaves no hooks behind and does not change the model's output
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert torch.equal(model(x), expected)

    make_dp_ready(model)
    assert model.dpzoo_patch_report.inplace_switched_off == ["act"]
    assert model.act.inplace is False
    ops = find_inplace_ops(model, x)
    assert [op.module for op in ops] == ["res"]  # arbitrary user code cannot be rewritten


def test_find_inplace_ops_ignores_tensors_autograd_does_not_track():
    class Scratch(nn.Module):
        def forward(self, x):
            buf = torch.zeros_like(x)
            buf.add_(1)  # no grad: harmless under backward hooks
            return x * buf

    model = nn.Sequential(Scratch())
    assert find_inplace_ops(model, torch.randn(2, 3)) == []
    x = torch.randn(2, 3, requires_grad=True)
    assert find_inplace_ops(model, x) == []


def _bn_block_inputs():
    return torch.randn(2, 8, 6, 6, generator=_gen(28))


def _downsample(cin, cout, stride):
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))


BLOCK_CASES = [
    pytest.param(lambda: BasicBlock(8, 8), DPBasicBlock, id="basic"),
    pytest.param(lambda: BasicBlock(8, 16, stride=2, downsample=_downsample(8, 16, 2)), DPBasicBlock, id="basic-down"),
    pytest.param(lambda: Bottleneck(8, 2), DPBottleneck, id="bottleneck"),
    pytest.param(
        lambda: Bottleneck(8, 4, stride=2, downsample=_downsample(8, 16, 2)), DPBottleneck, id="bottleneck-down"
    ),
]


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("make, dp_cls", BLOCK_CASES)
def test_timm_blocks_swapped_for_bit_identical_out_of_place_blocks(make, dp_cls, train):
    block = _randomize_(make(), seed=29).train(train)
    ref = copy.deepcopy(block)
    params = dict(block.named_parameters())
    report = disable_inplace(block)
    assert type(block) is dp_cls and isinstance(block, type(ref))
    assert report.swapped_blocks == [""]
    assert all(dict(block.named_parameters())[n] is p for n, p in params.items())
    x = _bn_block_inputs()
    assert torch.equal(block(x), ref(x))
    assert find_inplace_ops(block, x) == []
    assert find_inplace_ops(ref, x) != []


@pytest.fixture
def resnet18():
    return timm.create_model("resnet18", num_classes=3)


def test_timm_resnet18_has_no_inplace_ops_after_make_dp_ready(resnet18):
    x = torch.randn(2, 3, 32, 32, generator=_gen(30))
    ref = copy.deepcopy(resnet18)
    before = find_inplace_ops(copy.deepcopy(resnet18), x)  # (a train-mode pass updates BN stats)
    assert any(op.module == "layer1.0" for op in before)  # the `x += shortcut`
    assert any(op.module.endswith("act1") for op in before)

    # only in-place fixes: same function, bit for bit
    fixed = make_dp_ready(copy.deepcopy(resnet18), groupnorm=False, add_bias=False)
    fixed.eval(), ref.eval()
    assert torch.equal(fixed(x), ref(x))
    assert len(fixed.dpzoo_patch_report.blocks_swapped) == 8

    make_dp_ready(resnet18)
    assert find_inplace_ops(resnet18, x) == []


def _hook_every_leaf(model):
    calls = []
    for m in model.modules():
        if not list(m.children()):
            m.register_full_backward_hook(lambda mod, gin, gout: calls.append(type(mod).__name__))
    return calls


def test_backward_hooks_fail_before_patch_and_work_after(resnet18):
    x = torch.randn(2, 3, 32, 32, generator=_gen(31))
    unpatched = copy.deepcopy(resnet18)
    _hook_every_leaf(unpatched)
    with pytest.raises(RuntimeError, match="(?i)inplace|view"):
        unpatched(x).sum().backward()

    make_dp_ready(resnet18)
    calls = _hook_every_leaf(resnet18)
    x.requires_grad_(True)
    resnet18(x).sum().backward()
    assert "Conv2d" in calls and "GroupNorm" in calls and "ReLU" in calls
    assert x.grad is not None
    assert all(p.grad is not None for p in resnet18.parameters())


# --------------------------------------------------------------------------- 5. tied parameters


class _TinyLM(nn.Module):
    def __init__(self, head_first=False):
        super().__init__()
        if head_first:
            self.head = nn.Linear(6, 10, bias=False)
            self.emb = nn.Embedding(10, 6)
        else:
            self.emb = nn.Embedding(10, 6)
            self.head = nn.Linear(6, 10, bias=False)
        self.body = nn.Linear(6, 6)
        self.head.weight = self.emb.weight


@pytest.mark.parametrize("head_first", [False, True])
def test_tied_embedding_found_with_canonical_name(head_first):
    model = _TinyLM(head_first)
    groups = find_tied_parameters(model)
    assert len(groups) == 1
    g = groups[0]
    assert set(g.names) == {"emb.weight", "head.weight"}
    assert g.shape == (10, 6)
    assert set(g.modules) == {"emb", "head"}
    reported = dict(model.named_parameters())
    assert g.canonical_name in reported
    assert [n for n in g.names if n != g.canonical_name][0] not in reported
    assert g.canonical_name == ("head.weight" if head_first else "emb.weight")
    assert g.to_dict() == {"names": list(g.names), "shape": [10, 6]}


def test_untied_model_has_no_tied_groups():
    model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 10))
    with torch.no_grad():
        model[1].weight.copy_(model[0].weight)  # equal values, separate tensors
    assert find_tied_parameters(model) == []


def test_module_registered_twice_reports_weight_and_bias():
    model = nn.Module()
    lin = nn.Linear(3, 2)
    model.a = lin
    model.other = nn.Linear(2, 2)
    model.b = lin
    groups = {g.names: g.shape for g in find_tied_parameters(model)}
    assert groups == {("a.weight", "b.weight"): (2, 3), ("a.bias", "b.bias"): (2,)}


def test_make_dp_ready_records_ties_and_keeps_them():
    model = _TinyLM()
    make_dp_ready(model)
    assert model.head.weight is model.emb.weight
    assert [set(g.names) for g in model.dpzoo_patch_report.tied_groups] == [{"emb.weight", "head.weight"}]
    assert any(line.startswith("tied:") for line in model.dpzoo_patch_report.lines())


# --------------------------------------------------------------------------- 6. check_dp_ready


def _plain_cnn():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(0.1, inplace=True),
        nn.Linear(8, 4, bias=False),
    )


def _named(problems):
    return {p.split(":")[0] for p in problems}


def test_check_dp_ready_on_plain_cnn():
    model = _plain_cnn()
    problems = check_dp_ready(model)
    assert _named(problems) == {"1", "2", "4", "5", "8"}
    assert sum("would mix samples" in p and "BatchNorm2d" in p for p in problems) == 2
    assert sum("inplace=True" in p for p in problems) == 3
    assert not any("no bias" in p for p in problems)  # advice, not a refusal

    with_bias = check_dp_ready(model, require_bias=True)
    assert _named(with_bias) == {"0", "1", "2", "3", "4", "5", "8", "9"}
    assert sum("no bias" in p for p in with_bias) == 3
    assert _named(check_dp_ready(model, bias_exempt=["9", "0"], require_bias=True)) == {"1", "2", "3", "4", "5", "8"}

    make_dp_ready(model)
    assert check_dp_ready(model, require_bias=True) == []
    x = torch.randn(2, 3, 8, 8, generator=_gen(32))
    assert model(x).shape == (2, 4)


def test_check_dp_ready_with_bias_exempt_after_make_dp_ready():
    model = make_dp_ready(_plain_cnn(), bias_exempt=["9"])
    assert check_dp_ready(model) == []
    assert [p.split(":")[0] for p in check_dp_ready(model, require_bias=True)] == ["9"]
    assert check_dp_ready(model, bias_exempt=["9"], require_bias=True) == []


def test_check_dp_ready_on_timm_resnet18(resnet18):
    problems = check_dp_ready(resnet18, require_bias=True)
    assert any(p.startswith("bn1:") and "BatchNorm2d" in p for p in problems)
    assert any(p.startswith("act1:") and "inplace=True" in p for p in problems)
    assert any(p.startswith("conv1:") and "no bias" in p for p in problems)
    # `x += shortcut` breaks no layer hooked with activations (auto mode)
    assert not any(p.startswith("layer1.0:") for p in problems)
    bias_only = make_dp_ready(copy.deepcopy(resnet18), fix_inplace=False)
    for n, p in bias_only.named_parameters():
        p.requires_grad_(n.endswith("bias"))
    # nor, since 2026-11-28, those hooked for their bias alone (a hook on the layer's own output
    # receives the gradient before the in-place add); the in-place activations left are refused
    after = check_dp_ready(bias_only)
    assert not any(p.startswith("layer1.0:") and "BasicBlock" in p for p in after)
    assert any(p.startswith("layer1.0.act1:") and "inplace=True" in p for p in after)
    make_dp_ready(resnet18)
    assert check_dp_ready(resnet18, require_bias=True) == []


def test_make_dp_ready_twice_changes_nothing_more():
    model = make_dp_ready(_plain_cnn())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    first = copy.deepcopy(model.dpzoo_patch_report)
    make_dp_ready(model)
    rep = model.dpzoo_patch_report
    assert rep.groupnorm == first.groupnorm and rep.biases_added == first.biases_added
    assert rep.inplace_switched_off == first.inplace_switched_off
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


# --------------------------------------------------------------------------- 7. summary


class _HandBuilt(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)  # 40
        self.proj = nn.Linear(4, 4)  # 16 + 4 bias
        self.ln = nn.LayerNorm(4)  # 4 + 4 bias
        self.bn = nn.BatchNorm1d(4)  # 4 + 4 bias (running stats are buffers)
        self.gn = nn.GroupNorm(2, 4)  # 4 + 4 bias
        self.gn2 = nn.GroupNorm(2, 4)  # 4 + 4 bias
        self.attn = nn.MultiheadAttention(4, 2)  # in_proj 48 + 12 bias, out_proj 16 + 4 bias
        self.nobias = nn.Conv1d(4, 4, 1, bias=False)  # 16
        self.head = nn.Linear(4, 10)  # weight tied to emb (not counted), 10 bias
        self.head.weight = self.emb.weight


def test_summary_on_hand_built_model():
    model = _HandBuilt()
    weights = 40 + 16 + 4 + 4 + 4 + 4 + 48 + 16 + 16
    biases = 4 + 4 + 4 + 4 + 4 + 12 + 4 + 10
    s = dpzoo.summary(model)
    assert s.total_params == weights + biases == 198
    assert s.bias_params == biases == 46
    assert s.bias_percent == pytest.approx(100 * 46 / 198)
    assert s.trainable_params == 198 and s.trainable_bias_params == 46
    assert s.norm_layers == {"LayerNorm": 1, "BatchNorm1d": 1, "GroupNorm": 2}
    assert s.layers_without_bias == 1
    assert [set(g.names) for g in s.tied_groups] == [{"emb.weight", "head.weight"}]
    assert "tied parameters" in str(s) and "emb.weight" in str(s)

    model.emb.weight.requires_grad_(False)  # also freezes head.weight: same tensor
    model.ln.requires_grad_(False)
    model.attn.in_proj_bias.requires_grad_(False)
    s = dpzoo.summary(model)
    assert s.total_params == 198 and s.bias_params == 46
    assert s.trainable_params == 198 - 40 - 8 - 12
    assert s.trainable_bias_params == 46 - 4 - 12


def test_summary_after_make_dp_ready_counts_new_biases():
    model = _plain_cnn()
    before = dpzoo.summary(model)
    assert before.bias_params == 8 + 8  # the two BNs' β (γ is a weight)
    assert before.norm_layers == {"BatchNorm2d": 2}
    make_dp_ready(model)
    after = dpzoo.summary(model)
    assert after.bias_params == before.bias_params + 8 + 8 + 4
    assert after.total_params == before.total_params + 20
    assert after.norm_layers == {"GroupNorm": 2}
    assert after.layers_without_bias == 0


def test_summary_vit_base_on_meta_matches_dp_bitfit_table1():
    with torch.device("meta"):
        model = timm.create_model("vit_base_patch16_224")
    s = dpzoo.summary(model)
    assert abs(s.total_params - 86.6e6) < 0.1e6
    assert s.bias_percent == pytest.approx(0.120, abs=0.002)
    assert s.norm_layers.get("LayerNorm") == 25
    assert s.tied_groups == []


def test_summary_gpt2_on_meta_counts_tied_embedding_once():
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
    s = dpzoo.summary(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    with_dupes = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert s.total_params == with_dupes - 50257 * 768
    assert abs(s.total_params - 124.4e6) < 0.1e6
    assert s.bias_percent == pytest.approx(0.082, abs=0.002)
    assert [set(g.names) for g in s.tied_groups] == [{"transformer.wte.weight", "lm_head.weight"}]
