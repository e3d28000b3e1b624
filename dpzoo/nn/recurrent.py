"""RNN, GRU and LSTM built from ``nn.Linear``, so per-sample gradients are exact and cheap.

``torch.nn.RNN`` / ``GRU`` / ``LSTM`` keep their weights in one fused kernel that no per-sample
rule can see into (Opacus replaces them with its own ``DPRNN``/``DPGRU``/``DPLSTM`` for the same
reason). Here each layer and direction has an input projection ``ih`` (one ``nn.Linear`` call over
all time steps) and a hidden projection ``hh`` (one call per step; LSTM with ``proj_size``: ``hr``
too); dpzoo's hooks sum the per-step per-sample gradients exactly. Same arguments, equations, gate
order, initialisation and outputs as torch's: stacked layers, bidirectional, ``batch_first``
(default True here), dropout between layers, ``proj_size``, unbatched inputs, ``PackedSequence``
(variable lengths, by masking), initial states of shape (layers · directions, B, H). Sequence-first
inputs are transposed once, on entry, so every ``nn.Linear`` sees the batch in dim 0.

Submodules are named after torch's parameters: layer 0 forward ``ih``/``hh``, then ``ih_l1``,
``ih_l0_reverse``, ... (``weight_ih_l1`` → ``ih_l1.weight``). :meth:`from_torch` copies a torch
module and ``load_state_dict`` accepts torch's keys.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from ..errors import InvalidArgumentError

__all__ = ["DPRNN", "DPGRU", "DPLSTM", "torch_rnn_state_dict_to_dp"]


def _suffix(layer: int, reverse: bool) -> str:
    return "" if layer == 0 and not reverse else f"_l{layer}" + ("_reverse" if reverse else "")


def torch_rnn_state_dict_to_dp(state_dict: dict, prefix: str = "") -> dict:
    """Rename torch RNN keys under ``prefix`` (``weight_ih_l0``, ``bias_hh_l1_reverse``,
    ``weight_hr_l0``) to dpzoo's (``ih.weight``, ``hh_l1_reverse.bias``, ``hr.weight``), in place."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        local = key[len(prefix) :]
        kind, _, rest = local.partition("_")
        if kind not in ("weight", "bias") or not rest.startswith(("ih_l", "hh_l", "hr_l")):
            continue
        which, tail = rest[:2], rest[4:]  # "ih", "0" or "0_reverse"
        layer, _, rev = tail.partition("_")
        if not layer.isdigit() or rev not in ("", "reverse"):
            continue
        state_dict[f"{prefix}{which}{_suffix(int(layer), rev == 'reverse')}.{kind}"] = state_dict.pop(key)
    return state_dict


class _DPRecurrent(nn.Module):
    gates = 1
    mode = "RNN"

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = True,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if num_layers < 1 or hidden_size < 1 or not 0 <= dropout <= 1 or not 0 <= proj_size < hidden_size:
            raise InvalidArgumentError(
                f"{type(self).__name__}: need num_layers >= 1, hidden_size >= 1, 0 <= dropout <= 1 and "
                f"0 <= proj_size < hidden_size; got {num_layers}, {hidden_size}, {dropout}, {proj_size}."
            )
        f = {"device": device, "dtype": dtype}
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.dropout = bias, batch_first, float(dropout)
        self.bidirectional, self.proj_size = bidirectional, proj_size
        out = proj_size or hidden_size
        self.num_directions = 2 if bidirectional else 1
        for layer in range(num_layers):
            for rev in (False, True)[: self.num_directions]:
                s = _suffix(layer, rev)
                width = input_size if layer == 0 else out * self.num_directions
                setattr(self, "ih" + s, nn.Linear(width, self.gates * hidden_size, bias=bias, **f))
                setattr(self, "hh" + s, nn.Linear(out, self.gates * hidden_size, bias=bias, **f))
                if proj_size:
                    setattr(self, "hr" + s, nn.Linear(hidden_size, proj_size, bias=False, **f))
        self.reset_parameters()
        self.register_load_state_dict_pre_hook(self._torch_keys)

    @staticmethod
    def _torch_keys(module, state_dict, prefix, *args) -> None:
        torch_rnn_state_dict_to_dp(state_dict, prefix)

    def reset_parameters(self) -> None:
        """torch's initialisation: every weight and bias ~ U(−1/√H, 1/√H)."""
        bound = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def _cell(self, gi, h, c, s: str):
        raise NotImplementedError  # pragma: no cover - defined by each cell

    def _direction(self, x, layer: int, reverse: bool, h, c, lengths):
        s = _suffix(layer, reverse)
        gi = getattr(self, "ih" + s)(x)  # (B, T, G·H): every step at once
        t_len = x.shape[1]
        outs: list = [None] * t_len
        for t in range(t_len - 1, -1, -1) if reverse else range(t_len):
            h_new, c_new = self._cell(gi[:, t], h, c, s)
            if lengths is None:
                h, c = h_new, c_new
                outs[t] = h
                continue
            valid = (t < lengths).unsqueeze(1)  # past a sample's end: state kept, output 0
            h = torch.where(valid, h_new, h)
            c = torch.where(valid, c_new, c) if c is not None else None
            outs[t] = torch.where(valid, h_new, torch.zeros_like(h_new))
        return torch.stack(outs, 1), h, c

    def _initial(self, hx, b: int, batched: bool, x: torch.Tensor, width: int, what: str):
        n = self.num_layers * self.num_directions
        if hx is None:
            return x.new_zeros(n, b, width)
        want = (n, b, width) if batched else (n, width)
        if tuple(hx.shape) != want:
            raise InvalidArgumentError(
                f"{type(self).__name__}: the initial {what} must have shape {want} (layers · directions, "
                f"{'batch, ' if batched else ''}features) as in torch, got {tuple(hx.shape)}."
            )
        return hx if batched else hx.unsqueeze(1)

    def forward(self, input, hx=None):
        packed = isinstance(input, PackedSequence)
        lengths = None
        if packed:
            x, lengths = pad_packed_sequence(input, batch_first=True)  # the caller's sample order
            lengths = lengths.to(x.device)
            batched = True
        elif input.dim() not in (2, 3):
            raise InvalidArgumentError(
                f"{type(self).__name__} takes (B, T, F), (T, B, F) or unbatched (T, F) inputs, got {tuple(input.shape)}."
            )
        else:
            batched = input.dim() == 3
            x = input.unsqueeze(0) if not batched else input if self.batch_first else input.transpose(0, 1)
        b = x.shape[0]
        h0, c0 = hx if self.mode == "LSTM" and hx is not None else (hx, None)
        h0 = self._initial(h0, b, batched, x, self.proj_size or self.hidden_size, "hidden state")
        c0 = self._initial(c0, b, batched, x, self.hidden_size, "cell state") if self.mode == "LSTM" else None
        hs, cs = [], []
        for layer in range(self.num_layers):
            outs = []
            for d in range(self.num_directions):
                i = layer * self.num_directions + d
                out, h, c = self._direction(x, layer, d == 1, h0[i], c0[i] if c0 is not None else None, lengths)
                outs.append(out)
                hs.append(h)
                cs.append(c)
            x = torch.cat(outs, -1) if len(outs) > 1 else outs[0]
            if self.dropout and self.training and layer < self.num_layers - 1:
                x = F.dropout(x, self.dropout, training=True)
        h_n = torch.stack(hs)
        c_n = torch.stack(cs) if self.mode == "LSTM" else None
        if not batched:
            h_n, c_n = h_n.squeeze(1), (c_n.squeeze(1) if c_n is not None else None)
        if packed:
            output = _repack(x, input)
        elif not batched:
            output = x.squeeze(0)
        else:
            output = x if self.batch_first else x.transpose(0, 1)
        return output, ((h_n, c_n) if self.mode == "LSTM" else h_n)

    @classmethod
    def from_torch(cls, rnn: nn.RNNBase):
        """A dpzoo module computing what the torch module ``rnn`` computes: its options, weights,
        device, dtype, ``requires_grad`` flags and mode (``batch_first`` as ``rnn`` has it)."""
        if not isinstance(rnn, nn.RNNBase) or rnn.mode != cls._torch_mode(rnn):
            raise InvalidArgumentError(f"{cls.__name__}.from_torch copies a torch {cls.mode}, not {rnn!r}.")
        like = rnn.weight_ih_l0
        new = cls(
            rnn.input_size,
            rnn.hidden_size,
            **cls._options(rnn),
            num_layers=rnn.num_layers,
            bias=rnn.bias,
            batch_first=rnn.batch_first,
            dropout=rnn.dropout,
            bidirectional=rnn.bidirectional,
            device=like.device,
            dtype=like.dtype,
        )
        state = torch_rnn_state_dict_to_dp(dict(rnn.state_dict()))
        new.load_state_dict(state)
        flags = torch_rnn_state_dict_to_dp({k: p.requires_grad for k, p in rnn.named_parameters()})
        for name, p in new.named_parameters():
            p.requires_grad_(flags[name])
        return new.train(rnn.training)

    @classmethod
    def _torch_mode(cls, rnn) -> str:
        return cls.mode

    @classmethod
    def _options(cls, rnn) -> dict:
        return {}

    def extra_repr(self) -> str:
        s = f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, batch_first={self.batch_first}"
        if self.bidirectional:
            s += ", bidirectional=True"
        return s + (f", proj_size={self.proj_size}" if self.proj_size else "")


def _repack(x: torch.Tensor, like: PackedSequence) -> PackedSequence:
    """(B, T, F) in the caller's order → a PackedSequence laid out like ``like``."""
    if like.sorted_indices is not None:
        x = x.index_select(0, like.sorted_indices.to(x.device))
    data = torch.cat([x[:n, t] for t, n in enumerate(like.batch_sizes.tolist())], 0)
    return PackedSequence(data, like.batch_sizes, like.sorted_indices, like.unsorted_indices)


class DPRNN(_DPRecurrent):
    """``nn.RNN``: h' = act(W_ih x + b_ih + W_hh h + b_hh), act = tanh or relu."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, nonlinearity: str = "tanh", **kw):
        if nonlinearity not in ("tanh", "relu"):
            raise InvalidArgumentError(f"nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}.")
        self.nonlinearity = nonlinearity
        super().__init__(input_size, hidden_size, num_layers, **kw)

    def _cell(self, gi, h, c, s):
        pre = gi + getattr(self, "hh" + s)(h)
        return (torch.tanh(pre) if self.nonlinearity == "tanh" else torch.relu(pre)), None

    @classmethod
    def _torch_mode(cls, rnn) -> str:
        return rnn.mode if rnn.mode in ("RNN_TANH", "RNN_RELU") else "RNN"

    @classmethod
    def _options(cls, rnn) -> dict:
        return {"nonlinearity": rnn.nonlinearity}


class DPGRU(_DPRecurrent):
    """``nn.GRU``: r, z = σ(…), n = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn)), h' = (1 − z) ⊙ n + z ⊙ h."""

    gates, mode = 3, "GRU"

    def _cell(self, gi, h, c, s):
        i_r, i_z, i_n = gi.chunk(3, -1)
        h_r, h_z, h_n = getattr(self, "hh" + s)(h).chunk(3, -1)
        r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + r * h_n)
        return (1 - z) * n + z * h, None


class DPLSTM(_DPRecurrent):
    """``nn.LSTM`` (gates i|f|g|o): c' = σ(f) ⊙ c + σ(i) ⊙ tanh(g), h' = σ(o) ⊙ tanh(c')
    (projected by W_hr with ``proj_size``). Returns ``output, (h_n, c_n)``."""

    gates, mode = 4, "LSTM"

    def _cell(self, gi, h, c, s):
        i, f, g, o = (gi + getattr(self, "hh" + s)(h)).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        return (getattr(self, "hr" + s)(h) if self.proj_size else h), c

    @classmethod
    def _options(cls, rnn) -> dict:
        return {"proj_size": rnn.proj_size}
