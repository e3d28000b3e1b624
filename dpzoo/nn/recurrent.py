"""GRU and LSTM built from ``nn.Linear``, so per-sample gradients are exact and cheap.

``torch.nn.GRU`` / ``LSTM`` keep their weights in one fused kernel that no per-sample rule
can see into (Opacus replaces them with its own ``DPGRU``/``DPLSTM`` for the same reason).
Here the input projection is one ``nn.Linear`` call over all time steps and the hidden
projection one ``nn.Linear`` called at each step; dpzoo's hooks sum the per-step per-sample
gradients exactly. Same equations and gate order as torch's (batch_first, one layer), so
torch's weights load directly (:meth:`DPGRU.from_torch`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InvalidArgumentError

__all__ = ["DPGRU", "DPLSTM"]


def _from_torch(cls, rnn: nn.RNNBase):
    """A dpzoo cell with ``rnn``'s weights (one layer, unidirectional, batch_first, biases)."""
    if rnn.num_layers != 1 or rnn.bidirectional or not rnn.batch_first or not rnn.bias or getattr(rnn, "proj_size", 0):
        raise InvalidArgumentError(
            f"{cls.__name__}.from_torch copies one layer, unidirectional, batch_first, with "
            f"biases, not {rnn!r}; build it with num_layers=1, bidirectional=False, "
            "batch_first=True, bias=True and no proj_size."
        )
    m = cls(rnn.input_size, rnn.hidden_size)
    with torch.no_grad():
        m.ih.weight.copy_(rnn.weight_ih_l0)
        m.ih.bias.copy_(rnn.bias_ih_l0)
        m.hh.weight.copy_(rnn.weight_hh_l0)
        m.hh.bias.copy_(rnn.bias_hh_l0)
    return m


class DPGRU(nn.Module):
    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.hidden_size = hidden_size
        self.ih = nn.Linear(input_size, 3 * hidden_size)  # W_ir|W_iz|W_in, b_ir|b_iz|b_in
        self.hh = nn.Linear(hidden_size, 3 * hidden_size)  # W_hr|W_hz|W_hn, b_hr|b_hz|b_hn

    def forward(self, x: torch.Tensor, h: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, _ = x.shape
        gi = self.ih(x)
        h = x.new_zeros(b, self.hidden_size) if h is None else h
        outs = []
        for step in range(t):
            i_r, i_z, i_n = gi[:, step].chunk(3, -1)
            h_r, h_z, h_n = self.hh(h).chunk(3, -1)
            r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
            n = torch.tanh(i_n + r * h_n)
            h = (1 - z) * n + z * h
            outs.append(h)
        return torch.stack(outs, 1), h

    @classmethod
    def from_torch(cls, gru: nn.GRU) -> "DPGRU":
        return _from_torch(cls, gru)


class DPLSTM(nn.Module):
    def __init__(self, input_size: int, hidden_size: int):
        super().__init__()
        self.hidden_size = hidden_size
        self.ih = nn.Linear(input_size, 4 * hidden_size)  # gates i|f|g|o, as torch
        self.hh = nn.Linear(hidden_size, 4 * hidden_size)

    def forward(self, x: torch.Tensor, state=None):
        b, t, _ = x.shape
        gi = self.ih(x)
        if state is None:
            h, c = x.new_zeros(b, self.hidden_size), x.new_zeros(b, self.hidden_size)
        else:
            h, c = state
        outs = []
        for step in range(t):
            i, f, g, o = (gi[:, step] + self.hh(h)).chunk(4, -1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            outs.append(h)
        return torch.stack(outs, 1), (h, c)

    @classmethod
    def from_torch(cls, lstm: nn.LSTM) -> "DPLSTM":
        return _from_torch(cls, lstm)
