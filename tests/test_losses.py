"""dpzoo.losses' per-token cross-entropy against PyTorch's own, values and gradients."""

import pytest
import torch
import torch.nn.functional as F

from dpzoo.losses import SequenceCrossEntropy, token_cross_entropy


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("shape", [(1, 1, 2), (3, 5, 7), (4, 2, 33)])
def test_token_cross_entropy_is_pytorchs(shape, label_smoothing):
    gen = torch.Generator().manual_seed(sum(shape))
    b, t, v = shape
    logits = torch.randn(*shape, dtype=torch.float64, generator=gen, requires_grad=True)
    target = torch.randint(0, v, (b, t), generator=gen)
    target[torch.rand(b, t, generator=gen) < 0.3] = -100
    ours = token_cross_entropy(logits, target, label_smoothing=label_smoothing)
    theirs = F.cross_entropy(logits.transpose(1, 2), target, reduction="none", label_smoothing=label_smoothing)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    weights = torch.rand(b, t, dtype=torch.float64, generator=gen)
    (g_ours,) = torch.autograd.grad((ours * weights).sum(), logits)
    (g_theirs,) = torch.autograd.grad((theirs * weights).sum(), logits)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-12, atol=1e-12)
    assert (ours[target == -100] == 0).all()


def test_sequence_loss_keeps_the_sequence_as_one_sample():
    gen = torch.Generator().manual_seed(0)
    logits, target = torch.randn(3, 4, 6, generator=gen), torch.randint(1, 6, (3, 4), generator=gen)
    target[1, 2:] = 0
    loss = SequenceCrossEntropy(reduction="none", token_reduction="mean", ignore_index=0)(logits, target)
    per_token = F.cross_entropy(logits.transpose(1, 2), target, reduction="none", ignore_index=0)
    torch.testing.assert_close(loss, per_token.sum(1) / (target != 0).sum(1))
