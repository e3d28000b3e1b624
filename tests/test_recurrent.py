"""dpzoo's DP-ready GRU/LSTM compute exactly what torch's do, and their per-sample norms
(a hidden projection called at every time step) match brute force."""

import pytest
import torch
from grad_reference import assert_close, reference
from torch import nn

from dpzoo.errors import InvalidArgumentError
from dpzoo.grad_norms import attach_norm_hooks
from dpzoo.nn import DPGRU, DPLSTM


@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_same_outputs_and_gradients_as_torch(kind):
    torch.manual_seed(0)
    ref = (nn.GRU if kind == "gru" else nn.LSTM)(4, 6, batch_first=True).double()
    dp = (DPGRU if kind == "gru" else DPLSTM).from_torch(ref).double()
    x = torch.randn(3, 7, 4, dtype=torch.float64, requires_grad=True)
    y_ref, y_dp = ref(x)[0], dp(x)[0]
    assert torch.allclose(y_ref, y_dp, atol=1e-12)
    g_ref = torch.autograd.grad(y_ref.square().sum(), ref.weight_hh_l0)[0]
    g_dp = torch.autograd.grad(y_dp.square().sum(), dp.hh.weight)[0]
    assert torch.allclose(g_ref, g_dp, atol=1e-12)


def test_from_torch_rejects_what_it_cannot_copy():
    with pytest.raises(InvalidArgumentError, match="copies a torch GRU"):
        DPGRU.from_torch(nn.LSTM(4, 6))
    with pytest.raises(InvalidArgumentError, match="copies a torch LSTM"):
        DPLSTM.from_torch(nn.GRU(4, 6))
    # stacked layers are copied now (they used to be refused)
    torch.manual_seed(0)
    ref = nn.GRU(4, 6, num_layers=2, batch_first=True).double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    torch.testing.assert_close(DPGRU.from_torch(ref)(x)[0], ref(x)[0], atol=1e-12, rtol=0)


class Seq(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.rnn = (DPGRU if kind == "gru" else DPLSTM)(3, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


@pytest.mark.parametrize("mode", ["auto", "ghost", "instantiate"])
@pytest.mark.parametrize("kind", ["gru", "lstm"])
def test_per_sample_norms_of_recurrent_layers(kind, mode):
    torch.manual_seed(1)
    model = Seq(kind).double()
    x = torch.randn(4, 6, 3, dtype=torch.float64)

    def loss_fn(m, x):
        return m(x).square().sum()

    scale = torch.rand(4, dtype=torch.float64) + 0.1
    total, per_param, clipped = reference(model, loss_fn, {"x": x}, 4, scale)
    hooks = attach_norm_hooks(model, mode=mode)
    hooks.backward(loss_fn(model, x))
    assert_close(hooks.per_sample_norms(), total, 1e-6, "norms")
    cs = hooks.clipped_sum(scale)
    for n in clipped:
        assert_close(cs[n], clipped[n], 1e-6, n)
    hooks.detach()
