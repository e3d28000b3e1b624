"""Per-sample gradient representations and their exact inner products.

A layer's per-sample gradient is handed over in the cheapest exact form:

* :class:`Dense`: the per-sample gradients themselves, ``(B, *param.shape)`` (biases,
  normalisation weights, loose tensors: small);
* :class:`Factored`: ``g_i = Σ_t L_{i,t} ⊗ R_{i,t}`` for generalised linear layers
  (Linear, Conv via unfolding, HF Conv1D), kept as the two factors the forward and
  backward passes already produce: the activation and the output gradient (BK paper,
  Fig. 1). Groups of a grouped convolution are a block dimension ``G``;
* :class:`OneHot`: an embedding lookup, ``g_i = onehot(x_i)ᵀ R_i`` with token ids ``x_i``.

The squared norm ``‖g_i‖²`` of a factored gradient is either the ghost norm
``⟨L_i L_iᵀ, R_i R_iᵀ⟩`` (BK paper, eq. 2; cost ∝ T²) or the instantiated gradient's
squared sum (cost ∝ p·d). :class:`~.param_grad.ParamGrad` takes the planner's choice per use
(:mod:`dpzoo.grad_norms.cost`); the bare :func:`sq_norm` falls back to the BK rule (ghost iff
``2T² < p·d``, BK paper §3.2) unless forced.

A parameter used several times (a tied embedding, a module called twice) has
``g_i = Σ_u g_{u,i}``, so ``‖g_i‖² = Σ_u Σ_v ⟨g_{u,i}, g_{v,i}⟩``. Every pair of
representations has an exact inner product that never forms the B×V×d gradient of a
vocabulary-sized matrix: for an embedding use ``u`` and an output-projection use ``v``
it is ``Σ_{t,s} L_v[s, x_t] ⟨R_{u,t}, R_{v,s}⟩`` (DPFormer paper, Claim 4.1 and eq. B.6:
Phantom Clipping), at O(B·T_u·T_v) extra memory.

:class:`~dpzoo.grad_norms.param_grad.ParamGrad` gathers every use of one parameter in a step
and derives its norm, clipped sum and cross terms from these functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError
from .half import (
    HALF,
    exact_matmuls,
    flagged_scaled_product,
    launches_kernels,
    lost_bits,
    on_tensor_cores,
    product,
    round_toward_zero,
    upcast,
)
from .rounding import GRAM_CHUNK, dense_sq_norm, sum_per_sample

__all__ = [
    "Dense",
    "Factored",
    "LazyFactored",
    "right_like",
    "OneHot",
    "Rep",
    "inner",
    "sq_norm",
    "clipped_sum",
    "flagged_clipped_sum",
    "without_samples",
    "prefers_ghost",
    "instantiate",
    "RowSparse",
    "row_sparse",
]


@dataclass
class Dense:
    grad: torch.Tensor  # (B, *shape)

    @property
    def batch_size(self) -> int:
        return self.grad.shape[0]


@dataclass
class Factored:
    """``g_i = to_param(Σ_t L[i,:,t,:]ᵀ R[i,:,t,:])`` with L: (B, G, T, r), R: (B, G, T, c)."""

    left: torch.Tensor
    right: torch.Tensor
    shape: tuple[int, ...]  # the parameter's shape, numel = G·r·c

    @property
    def batch_size(self) -> int:
        return self.left.shape[0]

    def to_param(self, grc: torch.Tensor) -> torch.Tensor:
        """(…, G, r, c) → (…, *shape). Every layout dpzoo uses is a plain reshape."""
        return grc.reshape(*grc.shape[:-3], *self.shape)

    def from_param(self, dense: torch.Tensor) -> torch.Tensor:
        """(B, *shape) → (B, G, r, c)."""
        g, r, c = self.left.shape[1], self.left.shape[3], right_like(self).shape[3]
        return dense.reshape(dense.shape[0], g, r, c)


class LazyFactored(Factored):
    """A :class:`Factored` use whose right factor is formed on first read, with a direct route to
    its per-sample gradients that never forms it: a convolution's patches are k× its input
    (ResNet-18 at 32²: 0.5 GB a step), and on the instantiation path a grouped convolution
    computes the per-sample gradients from the input itself (:mod:`.rules.conv`). ``right_like``
    (a meta tensor of the factor's shape and dtype) answers the planner without unfolding;
    ``per_sample`` is ``None`` where no such route applies."""

    def __init__(self, left, make_right, right_like: torch.Tensor, shape, per_sample=None):
        self.left, self.shape, self.right_like = left, shape, right_like
        self._make_right, self.per_sample = make_right, per_sample
        self._right: torch.Tensor | None = None

    @property  # type: ignore[override]  # Factored's field, formed on first read
    def right(self) -> torch.Tensor:
        if self._right is None:
            self._right = self._make_right()
        assert self._right is not None
        return self._right

    @right.setter
    def right(self, value: torch.Tensor) -> None:
        self._right = value


def right_like(rep: Factored) -> torch.Tensor:
    """The right factor, or for a lazy one not yet formed a meta tensor of its shape and dtype."""
    return rep.right_like if isinstance(rep, LazyFactored) and rep._right is None else rep.right


@dataclass
class OneHot:
    """An embedding's per-sample gradient: rows ``index[i, t]`` of a (V, c) matrix get ``right[i, t]``."""

    index: torch.Tensor  # (B, T) long
    right: torch.Tensor  # (B, T, c), zero where the lookup has no gradient (padding_idx)
    num_rows: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_rows, self.right.shape[-1])

    @property
    def batch_size(self) -> int:
        return self.index.shape[0]


Rep = Dense | Factored | OneHot


def _acc_rep(rep):
    """Dense and lookup values in float32 if half; factored ones stay half when both factors are
    of one half dtype (:func:`.half.product` multiplies them exactly), else both upcast."""
    if isinstance(rep, Dense):
        return Dense(upcast(rep.grad))
    if isinstance(rep, Factored):
        if rep.left.dtype == rep.right.dtype and rep.left.dtype in HALF:
            return rep
        return Factored(upcast(rep.left), upcast(rep.right), rep.shape)
    return OneHot(rep.index, upcast(rep.right), rep.num_rows)


def prefers_ghost(rep: Rep) -> bool:
    """BK paper §3.2: ghost norm iff 2T² < p·d (per group for grouped convolutions)."""
    if isinstance(rep, Factored):
        t = rep.left.shape[2]
        return 2 * t * t < rep.left.shape[3] * rep.right.shape[3]
    if isinstance(rep, OneHot):
        t = rep.index.shape[1]
        return 2 * t * t < rep.num_rows * rep.right.shape[-1]
    return False


@dataclass
class RowSparse:
    """Per-sample gradients of an embedding with only the looked-up rows: sample ``sample[k]``
    has row ``row[k]`` equal to ``values[k]``; (sample, row) pairs are unique (coalesced)."""

    sample: torch.Tensor  # (K,) long
    row: torch.Tensor  # (K,) long
    values: torch.Tensor  # (K, c)
    batch_size: int
    num_rows: int


def row_sparse(rep: "OneHot") -> RowSparse:
    """Coalesce an embedding's per-sample gradient: O(B·T·c) instead of B × the table."""
    b, t = rep.index.shape
    key = (torch.arange(b, device=rep.index.device).unsqueeze(1) * rep.num_rows + rep.index).flatten()
    uniq, inverse = torch.unique(key, return_inverse=True)
    values = rep.right.new_zeros(len(uniq), rep.right.shape[-1])
    values.index_add_(0, inverse, rep.right.reshape(b * t, -1))
    return RowSparse(uniq // rep.num_rows, uniq % rep.num_rows, values, b, rep.num_rows)


def instantiate(rep: Rep) -> torch.Tensor:
    """The per-sample gradients, (B, *shape)."""
    if isinstance(rep, Dense):
        return rep.grad
    if isinstance(rep, LazyFactored) and rep.per_sample is not None:
        return rep.per_sample()
    if isinstance(rep, Factored):
        return rep.to_param(product(rep.left.transpose(-1, -2), rep.right))
    out = rep.right.new_zeros(rep.batch_size, rep.num_rows, rep.right.shape[-1])
    return out.scatter_add_(1, rep.index.unsqueeze(-1).expand_as(rep.right), rep.right)


def _gram(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """⟨a_t, b_s⟩ over the last dim, (…, T, k) × (…, S, k) → (…, T, S), accumulated in chunks of
    GRAM_CHUNK features: its rounding bound then grows with 256 + k/256, not k (:mod:`.rounding`)."""
    k = a.shape[-1]
    if a.shape[-2] == b.shape[-2] == 1 and k > GRAM_CHUNK and not on_tensor_cores(a, b):
        return _dot_by_chunks(upcast(a), upcast(b))
    # on a GPU, every chunk in one batched product when the chunks' Grams take no more memory than
    # the input (S ≤ GRAM_CHUNK): ~8 operators instead of ~8 a chunk (GPT-2's 2304 features: 9 chunks)
    if k >= 2 * GRAM_CHUNK and b.shape[-2] <= GRAM_CHUNK and launches_kernels(a):
        return _gram_batched(a, b)
    out = product(a[..., :GRAM_CHUNK], b[..., :GRAM_CHUNK].transpose(-1, -2))
    for i in range(GRAM_CHUNK, k, GRAM_CHUNK):
        out = out.add_(product(a[..., i : i + GRAM_CHUNK], b[..., i : i + GRAM_CHUNK].transpose(-1, -2)))
    return out


def _gram_batched(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """:func:`_gram` with the whole chunks as one batch of products (one copy of each factor), summed
    over the chunks, then the rest: the same chains of additions (a chunk's, then across chunks)."""
    k, t, s = a.shape[-1], a.shape[-2], b.shape[-2]
    whole = k // GRAM_CHUNK * GRAM_CHUNK

    def chunks(x: torch.Tensor) -> torch.Tensor:  # (…, T, k) → (L·n, T, GRAM_CHUNK)
        x = x[..., :whole].reshape(-1, x.shape[-2], whole // GRAM_CHUNK, GRAM_CHUNK)
        return x.transpose(1, 2).reshape(-1, x.shape[1], GRAM_CHUNK)

    ca = chunks(a)
    cb = ca if b is a else chunks(b)
    out = product(ca, cb.transpose(-1, -2)).view(-1, whole // GRAM_CHUNK, t, s).sum(1).view(*a.shape[:-2], t, s)
    if whole < k:
        out = out.add_(product(a[..., whole:], b[..., whole:].transpose(-1, -2)))
    return out


def _dot_by_chunks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """:func:`_gram` of one row each, (…, 1, k) → (…, 1, 1): the products summed over chunks of
    GRAM_CHUNK features, then over the chunks (the same chains of additions as the chunked GEMMs,
    in 3 operators instead of 5 per chunk; ResNet's last stage has 4608 features at T = 1)."""
    whole = a.shape[-1] // GRAM_CHUNK * GRAM_CHUNK
    prod = a * b
    out = prod[..., :whole].unflatten(-1, (-1, GRAM_CHUNK)).sum(-1).sum(-1)
    return (out + prod[..., whole:].sum(-1)).unsqueeze(-1)


def _onehot_left_gram(index: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
    """(onehot(index) Lᵀ)[b, t, s] = L[b, s, index[b, t]] for L: (B, S, V)."""
    b, t = index.shape
    s = left.shape[1]
    return torch.gather(left.transpose(1, 2), 1, index.unsqueeze(-1).expand(b, t, s))


def inner(u: Rep, v: Rep, *, ghost: bool | None = None) -> torch.Tensor:
    """⟨g_{u,i}, g_{v,i}⟩ for every sample i: Tensor[B]. Both must describe the same tensor."""
    with exact_matmuls():
        return _inner(_acc_rep(u), _acc_rep(v), ghost)


def _inner(u: Rep, v: Rep, ghost: bool | None) -> torch.Tensor:
    if isinstance(v, Dense) and not isinstance(u, Dense):
        u, v = v, u
    if isinstance(u, Dense):
        if isinstance(v, Dense):
            return sum_per_sample(u.grad * v.grad)
        if isinstance(v, Factored):  # Σ_t L_tᵀ D R_t without forming v's gradient, (L D) first
            return sum_per_sample(product(v.left, v.from_param(u.grad)) * v.right)
        rows = torch.gather(u.grad, 1, v.index.unsqueeze(-1).expand_as(v.right))
        return sum_per_sample(rows * v.right)
    if isinstance(u, Factored) and isinstance(v, Factored):
        use_ghost = prefers_ghost(u) and prefers_ghost(v) if ghost is None else ghost
        if use_ghost:
            return sum_per_sample(_gram(u.left, v.left) * _gram(u.right, v.right))
        return sum_per_sample(instantiate(u) * instantiate(v))
    if isinstance(v, OneHot) and isinstance(u, Factored):
        u, v = v, u
    if isinstance(u, OneHot) and isinstance(v, Factored):
        # Phantom Clipping cross term (DPFormer eq. B.6), generalised to any factored use
        # of the same (V, c) matrix; needs G = 1 and rows = V.
        if v.left.shape[1] != 1 or v.left.shape[3] != u.num_rows:
            return sum_per_sample(instantiate(u) * instantiate(v))
        lsel = _onehot_left_gram(u.index, v.left[:, 0])  # (B, T_u, T_v)
        rr = _gram(u.right, v.right[:, 0])
        return sum_per_sample(lsel * rr)
    # OneHot · OneHot: Σ_{t,s} [x_t = y_s] ⟨R_t, R'_s⟩
    same = (u.index.unsqueeze(2) == v.index.unsqueeze(1)).to(u.right.dtype)
    return sum_per_sample(same * _gram(u.right, v.right))


def sq_norm(rep: Rep, *, ghost: bool | None = None) -> torch.Tensor:
    """‖g_i‖² for every sample: ghost norm or instantiation (``ghost=None``: the BK rule)."""
    with exact_matmuls():
        return _sq_norm(_acc_rep(rep), ghost)


def _sq_norm(rep: Rep, ghost: bool | None) -> torch.Tensor:
    if isinstance(rep, Dense):
        return dense_sq_norm(rep.grad)
    use_ghost = prefers_ghost(rep) if ghost is None else ghost
    if not use_ghost:
        return dense_sq_norm(instantiate(rep))
    if isinstance(rep, Factored):  # BK paper eq. 2
        return sum_per_sample(_gram(rep.left, rep.left) * _gram(rep.right, rep.right))
    return _inner(rep, rep, None)


def without_samples(rep: Rep, drop: torch.Tensor) -> Rep:
    """``rep`` with every factor 0 for the samples where ``drop``: a weighted sum gives 0 · inf = NaN."""

    def keep(t: torch.Tensor) -> torch.Tensor:
        return torch.where(drop.view(-1, *([1] * (t.dim() - 1))), t.new_zeros(()), t)

    if isinstance(rep, Dense):
        return Dense(keep(rep.grad))
    if isinstance(rep, Factored):
        return Factored(keep(rep.left), keep(rep.right), rep.shape)
    return OneHot(rep.index, keep(rep.right), rep.num_rows)


def clipped_sum(rep: Rep, scale: torch.Tensor) -> torch.Tensor:
    """Σ_i scale_i g_i, shape = the parameter's (book-keeping: BK paper Alg. 1 line 9), at float32
    precision or better whatever the user's matmul setting. bfloat16 factors: exact half products
    (:func:`.half.scaled_product`); other half values are upcast first. A factored use whose
    scaled factor would lose bits (under- or overflow) is summed in float64."""
    total, lost = flagged_clipped_sum(rep, scale)
    return _wide_clipped_sum(rep, scale) if lost is not None and bool(lost) else total


def flagged_clipped_sum(rep: Rep, scale: torch.Tensor, blocks: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(:func:`clipped_sum`'s working-precision sum, whether a scaled factor lost bits: a device
    bool, or None where none can; no host read). Where True, the sum is :func:`clipped_sum`'s
    float64 one instead (on a GPU one host read then serves every parameter of a step).
    ``blocks``: a factored ``rep`` of one group holding that many uses of one shape stacked along
    the batch (the n-th's samples at rows n·B…), each summed on its own: (blocks, *shape)."""
    if blocks > 1 and not (isinstance(rep, Factored) and rep.left.shape[1] == 1):
        raise InvalidArgumentError("blocks > 1: only a factored use of one group holds uses stacked along the batch")
    if _bfloat16_pair(rep):  # the product rounds the scale to bfloat16 itself, as _working_scale does
        total, lost = flagged_scaled_product(rep.left[:, 0], rep.right[:, 0], scale, blocks)
        return rep.to_param(total.unsqueeze(-3)), lost
    scale = _working_scale(rep, scale)
    rep = Factored(upcast(rep.left), upcast(rep.right), rep.shape) if isinstance(rep, Factored) else _acc_rep(rep)
    with exact_matmuls():
        return _flagged_sum(rep, scale, blocks)


def _bfloat16_pair(rep: Rep) -> bool:
    """A factored use of one group with both factors bfloat16: exact half products."""
    return isinstance(rep, Factored) and rep.left.shape[1] == 1 and rep.left.dtype == rep.right.dtype == torch.bfloat16


def _working_scale(rep: Rep, scale: torch.Tensor) -> torch.Tensor:
    """``scale`` rounded toward zero as the working-precision sum scales ``rep``: to bfloat16 for
    exact half products, else to the dtype of the (upcast) factor it multiplies."""
    if _bfloat16_pair(rep):
        return round_toward_zero(scale, torch.bfloat16)
    return round_toward_zero(scale, upcast(rep.right).dtype if isinstance(rep, Factored) else _dtype(_acc_rep(rep)))


def _wide_clipped_sum(rep: Rep, scale: torch.Tensor) -> torch.Tensor:
    """The float64 sum, in float32, of a factored use whose scaled factor lost bits (only float32
    and half factors can), by the same scale as the working-precision sum."""
    wide = Factored(rep.left.double(), rep.right.double(), rep.shape)
    return _flagged_sum(wide, _working_scale(rep, scale).double())[0].float()


def _flagged_sum(rep: Rep, scale: torch.Tensor, blocks: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(rep, Dense):
        return torch.tensordot(scale, rep.grad, dims=([0], [0])), None  # a GEMV: faster than einsum on CPU
    if isinstance(rep, Factored):
        # one GEMM Lᵀ(R) over the B·T rows, the scale on the narrower factor: einsum picked a
        # transposed output at T = 1 (ResNet's last stage), which every later add then strides
        b, g, t, r = rep.left.shape
        c = rep.right.shape[3]
        narrow = rep.left if r <= c or g > 1 else rep.right
        scaled = narrow * scale.view(-1, 1, 1, 1)
        lost = lost_bits(narrow, scaled, torch.finfo(torch.float32).tiny) if rep.left.dtype == torch.float32 else None
        if g > 1:
            return rep.to_param(torch.einsum("bgtr,bgtc->grc", scaled, rep.right)), lost
        left, right = (scaled, rep.right) if r <= c else (rep.left, scaled)
        if blocks > 1:  # each block's B·T rows one GEMM, as alone
            total = torch.bmm(left.reshape(blocks, -1, r).transpose(1, 2), right.reshape(blocks, -1, c))
            return rep.to_param(total.unsqueeze(1)), lost
        return rep.to_param(torch.mm(left.reshape(b * t, r).t(), right.reshape(b * t, c)).unsqueeze(0)), lost
    weighted = (rep.right * scale.view(-1, 1, 1)).flatten(0, 1)
    out = rep.right.new_zeros(rep.num_rows, rep.right.shape[-1])
    return out.index_add_(0, rep.index.flatten(), weighted), None


def _dtype(rep: Rep) -> torch.dtype:
    return rep.grad.dtype if isinstance(rep, Dense) else rep.right.dtype
