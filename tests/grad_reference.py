"""Brute-force references for per-sample gradients: a loop of per-sample backward passes."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import dpzoo
from dpzoo.grad_norms import attach_norm_hooks


def per_sample_grads(model: nn.Module, loss_fn, inputs: dict, batch_size: int) -> list[dict[str, torch.Tensor]]:
    """[{param name: ∂L_i/∂θ}] for i in range(B), by B separate backward passes.

    ``inputs`` maps argument names to batch-first tensors; ``loss_fn(model, **inputs_i)``
    returns sample i's loss. Names are those of ``model.named_parameters()`` (tied
    tensors once, under their first name).
    """
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = []
    for i in range(batch_size):
        for p in params.values():
            p.grad = None
        sample = {k: v[i : i + 1] for k, v in inputs.items()}
        loss_fn(model, **sample).backward()
        out.append(
            {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in params.items()}
        )
    for p in params.values():
        p.grad = None
    return out


def reference(model, loss_fn, inputs, batch_size, scale):
    grads = per_sample_grads(model, loss_fn, inputs, batch_size)
    names = list(grads[0])
    per_param = {n: torch.stack([g[n].flatten().norm() for g in grads]) for n in names}
    total = torch.stack([torch.sqrt(sum(g[n].pow(2).sum() for n in names)) for g in grads])
    clipped = {n: sum(scale[i] * grads[i][n] for i in range(batch_size)) for n in names}
    return total, per_param, clipped


def assert_close(actual, expected, rtol, what="", floor=1e-12):
    """max |actual - expected| <= rtol · max(max |expected|, floor).

    ``floor``: the scale below which differences do not matter, e.g. the total per-sample norm
    when comparing one parameter's norm whose true value is 0 (only rounding noise)."""
    actual, expected = actual.detach().to(torch.float64), expected.detach().to(torch.float64)
    scale = expected.abs().max().clamp_min(float(floor))
    err = (actual - expected).abs().max() / scale
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.0e}"


def zoo_model_and_inputs(name, b=3, seed=0):
    """A zoo entry in its small test configuration (float64, eval), a batch of ``b`` example inputs
    from its card and a summed loss ``loss_fn(model, **inputs)``."""
    torch.manual_seed(seed)
    card = dpzoo.model_card(name)
    model = dpzoo.load(name, **card.test_overrides).double().eval()  # eval: no dropout
    spec = card.example_input
    g = torch.Generator().manual_seed(seed + 1)
    if spec["kind"] in ("image", "features"):
        x = torch.randn(b, *spec["shape"], generator=g, dtype=torch.float64)
        y = torch.randint(0, card.test_overrides["num_classes"], (b,), generator=g)

        def loss_fn(m, x, y):
            return F.cross_entropy(m(x), y, reduction="sum")

        return model, {"x": x, "y": y}, loss_fn
    ids = torch.randint(0, spec["vocab_size"], (b, spec["seq_len"]), generator=g)
    if spec["kind"] == "seq2seq":  # the target sequence through the decoder, teacher-forced by the model

        def loss_fn(m, ids, labels):
            logits = m(input_ids=ids, labels=labels).logits
            return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")

        labels = torch.randint(2, spec["vocab_size"], (b, spec["target_len"]), generator=g)
        return model, {"ids": ids, "labels": labels}, loss_fn
    if card.task == "sequential-recommendation":  # next item at every position, padding (0) ignored

        def loss_fn(m, ids):
            logits = m(ids)[:, :-1]
            return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum", ignore_index=0)

        return model, {"ids": ids}, loss_fn
    if card.task == "causal-lm":

        def loss_fn(m, ids):
            logits = m(input_ids=ids).logits[:, :-1]
            return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")

        return model, {"ids": ids}, loss_fn
    y = torch.randint(0, card.test_overrides["num_classes"], (b,), generator=g)

    def loss_fn(m, ids, y):
        return F.cross_entropy(m(input_ids=ids).logits, y, reduction="sum")

    return model, {"ids": ids, "y": y}, loss_fn


def check_against_brute_force(model, inputs, loss_fn, mode, tol=1e-6):
    """Per-sample norms (total and per parameter) and a randomly weighted clipped sum from dpzoo's
    hooks in ``mode``, each against a loop of per-sample backward passes; returns the hooks."""
    b = next(iter(inputs.values())).shape[0]
    scale = torch.rand(b, dtype=torch.float64, generator=torch.Generator().manual_seed(9)) + 0.1
    total, per_param, clipped = reference(model, loss_fn, inputs, b, scale)
    hooks = attach_norm_hooks(model, mode=mode)
    try:
        hooks.backward(loss_fn(model, **inputs))
        assert_close(hooks.per_sample_norms(), total, tol, "per_sample_norms")
        got = hooks.per_param_norms()
        assert set(got) == set(per_param)
        for n in per_param:  # relative to the total norm: some true per-parameter norms are 0
            assert_close(got[n], per_param[n], tol, n, floor=total.abs().max() * 1e-3)
        cs = hooks.clipped_sum(scale)
        biggest = max(c.abs().max() for c in clipped.values())
        for n in clipped:
            assert_close(cs[n], clipped[n], tol, f"clipped {n}", floor=biggest * 1e-3)
        return hooks
    finally:
        hooks.detach()


def random_factored(shapes, batch: int, dtype: torch.dtype, seed: int = 0) -> list:
    """Factored uses of one group with random factors, one per (T, r, c) of ``shapes``."""
    from dpzoo.grad_norms import reps as R

    gen = torch.Generator().manual_seed(seed)
    return [
        R.Factored(torch.randn(batch, 1, t, r, generator=gen).to(dtype), torch.randn(batch, 1, t, c, generator=gen).to(dtype), (r, c))
        for t, r, c in shapes
    ]  # fmt: skip


def grad64(rep) -> torch.Tensor:
    """A factored use of one group's per-sample gradients in float64, by einsum (B, r, c)."""
    return torch.einsum("btr,btc->brc", rep.left[:, 0].double(), rep.right[:, 0].double())


def count_host_reads(monkeypatch) -> list:
    """The host reads (bool, item, tolist of a tensor) made from now on, by name."""
    reads: list = []
    for name in ("__bool__", "item", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _r=real, _n=name: reads.append(_n) or _r(t, *a))
    return reads
