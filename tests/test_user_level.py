"""User-level clipping: a user's examples are one privacy unit, their summed gradient is clipped.

Every per-user norm and clipped sum is compared with a brute-force loop in float64: for each
user, one backward pass of the sum of that user's examples' losses."""

from __future__ import annotations

import pytest
import torch
from grad_reference import assert_close, zoo_model_and_inputs

from dpzoo.errors import DPZooError
from dpzoo.grad_norms import attach_norm_hooks
from dpzoo.grad_norms import reps as R
from dpzoo.grad_norms.units import group_rep, unit_layout

# rows 0..6 belong to users of 1, 2 and 3 examples, not in order
GROUPS = torch.tensor([2, 0, 1, 2, 0, 2, 3])


def per_user_reference(model, loss_fn, inputs: dict, groups: torch.Tensor, scale: torch.Tensor):
    """(per-user total norms, {name: Σ_u scale_u g_u}) by one backward pass per user."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads = []
    for u in range(int(groups.max()) + 1):
        rows = (groups == u).nonzero().flatten()
        loss = loss_fn(model, **{k: v[rows] for k, v in inputs.items()})
        got = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        grads.append({n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params.items(), got)})
    total = torch.stack([torch.sqrt(sum(g.square().sum() for g in gu.values())) for gu in grads])
    clipped = {n: sum(scale[u] * grads[u][n] for u in range(len(grads))) for n in params}
    return total, clipped


def check_per_user(model, inputs, loss_fn, mode, groups=GROUPS, tol=1e-6):
    scale = torch.rand(int(groups.max()) + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) + 0.1
    total, clipped = per_user_reference(model, loss_fn, inputs, groups, scale)
    hooks = attach_norm_hooks(model, mode=mode)
    try:
        hooks.backward(loss_fn(model, **inputs))
        hooks.group_rows(groups)
        assert_close(hooks.per_sample_norms(), total, tol, "per-user norms")
        got = hooks.clipped_sum(scale)
        biggest = max(c.abs().max() for c in clipped.values())
        for n in clipped:
            assert_close(got[n], clipped[n], tol, f"clipped {n}", floor=biggest * 1e-3)
    finally:
        hooks.detach()


def _rows(name, b=7):
    model, inputs, loss_fn = zoo_model_and_inputs(name, b=b)
    return model, inputs, loss_fn


@pytest.mark.parametrize("mode", ["auto", "ghost", "instantiate"])
@pytest.mark.parametrize("name", ["gpt2", "llama-tiny-bias", "resnet18-gn-bias", "dpformer"])
def test_per_user_norms_and_sums_match_a_per_user_loop(name, mode):
    """GPT-2 and DPFormer tie their embeddings (the cross terms of Phantom Clipping per user)."""
    check_per_user(*_rows(name), mode)


@pytest.mark.parametrize("name", ["gpt2", "resnet18-gn-bias"])
def test_per_user_bias_only_norms_match_a_per_user_loop(name):
    model, inputs, loss_fn = _rows(name)
    for n, p in model.named_parameters():
        p.requires_grad_(n.endswith("bias"))
    check_per_user(model, inputs, loss_fn, "auto")


def test_per_user_lora_norms_match_a_per_user_loop():
    from dpzoo.integrations.peft import dp_lora

    model, inputs, loss_fn = _rows("gpt2")
    lora = dp_lora(model, r=4, alpha=8, init_lora_weights=False).double().eval()
    check_per_user(lora, inputs, loss_fn, "auto")


def test_one_user_per_row_is_per_example_clipping():
    model, inputs, loss_fn = _rows("llama-tiny-bias")
    check_per_user(model, inputs, loss_fn, "auto", groups=torch.tensor([3, 1, 0, 2, 6, 5, 4]))


def test_a_user_whose_examples_cancel_has_norm_zero():
    """g_U = g_1 + g_2 with g_2 = −g_1: the unit's norm is 0, not ‖g_1‖ + ‖g_2‖ (on the ghost path
    the float guard's floor, (2⁻⁸ · U)², U = Σ_t ‖L_t‖‖R_t‖ over the user's positions)."""
    left = torch.randn(2, 1, 3, 5, dtype=torch.float64)
    right = torch.randn(2, 1, 3, 4, dtype=torch.float64)
    left[1], right[1] = left[0], -right[0]
    rep = group_rep(R.Factored(left, right, (5, 4)), unit_layout(torch.tensor([0, 0])))
    one = R.ParamGrad([R.Factored(left[:1], right[:1], (5, 4))], ghost=False).sq_norm().item()
    assert R.ParamGrad([rep], ghost=False).sq_norm().item() < 1e-25 * one
    u = (left.norm(dim=-1) * right.norm(dim=-1)).sum().item()
    assert R.ParamGrad([rep], ghost=True).sq_norm().item() <= (1 + 1e-9) * (u / 256) ** 2 < 0.01 * one


@pytest.mark.parametrize(
    "groups, why",
    [
        (torch.tensor([0, 2, 2]), "every id used"),
        (torch.tensor([-1, 0, 0]), "every id used"),
        (torch.tensor([0.0, 1.0, 1.0]), "integer"),
        (torch.tensor([[0, 1, 1]]), "1-D"),
    ],
)
def test_malformed_groups_are_refused(groups, why):
    with pytest.raises(DPZooError, match=why):
        unit_layout(groups)


def test_groups_after_the_norms_are_refused_and_a_wrong_length_too():
    model, inputs, loss_fn = _rows("gpt2", b=3)
    hooks = attach_norm_hooks(model)
    try:
        hooks.backward(loss_fn(model, **inputs))
        hooks.group_rows(torch.tensor([0, 1, 0, 1]))
        with pytest.raises(DPZooError, match="4 rows but the step's gradients have 3"):
            hooks.per_sample_norms()
        hooks.clear()
        hooks.backward(loss_fn(model, **inputs))
        hooks.per_sample_norms()
        with pytest.raises(DPZooError, match="before the first norm"):
            hooks.group_rows(torch.tensor([0, 1, 0]))
    finally:
        hooks.detach()
