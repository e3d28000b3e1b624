"""What an operation does to the samples of a DP step: the names of torch's operations grouped by
how they treat the sample dimension, and where the samples are in a result (transposes, slices,
single rows). Read by :mod:`.row_rules`, which decides what is refused.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["across", "result_dim", "dims_of", "touches", "window_of", "sliced", "picked_row", "absolute_row",
           "leaves"]  # fmt: skip

ADDITIVE = {"add", "__add__", "__radd__", "__iadd__", "add_", "sub", "__sub__", "__rsub__", "__isub__", "sub_",
            "neg", "__neg__", "sum", "nansum", "stack", "cat"}  # fmt: skip
SCALING = {"mul", "__mul__", "__rmul__", "__imul__", "mul_", "div", "__truediv__", "__itruediv__", "div_",
           "true_divide", "divide"}  # fmt: skip
DIVIDE = {"div", "__truediv__", "__itruediv__", "div_", "true_divide", "divide"}
VIEWS = {"float", "double", "half", "bfloat16", "long", "int", "short", "bool", "byte", "char", "cpu", "cuda",
         "type", "to", "type_as", "broadcast_to", "broadcast_tensors", "clone", "contiguous", "detach", "squeeze",
         "unsqueeze", "view", "reshape", "flatten", "unflatten", "view_as", "reshape_as", "expand", "expand_as",
         "requires_grad_", "retain_grad", "real", "__getitem__"}  # fmt: skip
ELEMENTWISE = {
    "abs", "neg", "exp", "exp2", "log", "log2", "log10", "log1p", "expm1", "sqrt", "rsqrt", "square", "sin", "cos",
    "tan", "tanh", "sigmoid", "relu", "relu_", "gelu", "silu", "mish", "softplus", "elu", "selu", "celu",
    "leaky_relu", "logsigmoid", "hardtanh", "hardswish", "hardsigmoid", "softsign", "clamp", "clamp_min",
    "clamp_max", "clip", "sign", "reciprocal", "erf", "erfc", "nan_to_num", "masked_fill", "masked_fill_", "where",
    "pow", "__pow__", "__rpow__", "__rtruediv__", "maximum", "minimum", "fmax", "fmin", "lerp", "addcmul",
    "addcdiv", "atan2", "hypot", "logaddexp", "logaddexp2", "xlogy", "fmod", "remainder", "dropout", "floor",
    "ceil", "round", "trunc", "frac", "__abs__", "fill_", "zero_", "copy_", "one_hot", "__setitem__", "pad",
}  # fmt: skip
LINEAR_OVER_DIM = {"sum", "nansum", "mean"}  # nanmean divides by a count of the batch: nonlinear
NONLINEAR_OVER_DIM = {
    "nanmean", "softmax", "log_softmax", "logsumexp", "norm", "vector_norm", "linalg_vector_norm", "max", "min", "amax",
    "amin", "aminmax", "std", "var", "std_mean", "var_mean", "prod", "cumsum", "cumprod", "cummax", "cummin",
    "logcumsumexp", "sort", "argsort", "topk", "kthvalue", "median", "nanmedian", "mode", "quantile",
    "nanquantile", "normalize", "diff", "glu", "argmax", "argmin", "count_nonzero", "all", "any",
}  # fmt: skip
SPLITS = {"unbind", "chunk", "split", "tensor_split", "narrow", "select", "index_select", "gather",
          "take_along_dim"}  # fmt: skip
ROW_ORDER = {"roll", "flip", "fliplr", "flipud"}
MOVES = {"t", "T", "mT", "transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis"}
BATCH_FIRST = {"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
               "max_pool1d", "max_pool2d", "max_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d",
               "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_max_pool1d", "adaptive_max_pool2d",
               "interpolate", "upsample", "pixel_shuffle", "unfold", "fold", "linear", "embedding",
               "scaled_dot_product_attention", "dropout1d", "dropout2d"}  # fmt: skip
TRANSFORMS = {
    **{f"fft_{k}": (-1,) for k in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft")},
    **{f"fft_{k}2": (-2, -1) for k in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft")},
    **{f"fft_{k}n": "all" for k in ("fft", "ifft", "rfft", "irfft", "hfft", "ihfft")},
    "fft_fftshift": "all",
    "fft_ifftshift": "all",
}
ALONG = {"triu", "tril", "diagonal", "diag_embed", "repeat_interleave", "cosine_similarity", "pairwise_distance",
         "vecdot", "cross"}  # fmt: skip
INDEXED_WRITES = {"scatter", "scatter_add", "scatter_reduce", "index_add", "index_copy", "index_fill"}
LIKE = {"zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like", "randint_like"}
MEAN_LOSSES = {"cross_entropy", "nll_loss"}
LOSSES = MEAN_LOSSES | {
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
    "kl_div", "poisson_nll_loss", "gaussian_nll_loss", "soft_margin_loss", "multilabel_soft_margin_loss",
    "multi_margin_loss", "multilabel_margin_loss", "hinge_embedding_loss", "ctc_loss", "margin_ranking_loss",
    "cosine_embedding_loss", "triplet_margin_loss", "triplet_margin_with_distance_loss",
}  # fmt: skip
MIXERS = {"cov", "corrcoef", "pdist", "svd", "svdvals", "det", "slogdet", "logdet", "inverse", "inv", "pinverse",
          "pinv", "qr", "eig", "eigh", "eigvals", "eigvalsh", "cholesky", "matrix_exp", "matrix_norm", "trace",
          "take", "histc", "unique", "cartesian_prod", "combinations", "apply", "lstsq", "solve"}  # fmt: skip
PRODUCTS = {"matmul", "mm", "__matmul__", "__rmatmul__", "bmm", "baddbmm", "einsum", "linear", "bilinear",
            "addmm", "addbmm", "addmv", "mv", "dot", "vdot", "inner", "outer", "tensordot", "kron", "cdist",
            "chain_matmul", "multi_dot"}  # fmt: skip


# -- what an operation does to the sample dimension --------------------------------------------


def across(name: str, args, kwargs, lead, out) -> str | None:
    """How the operation treats the sample dimension of ``lead``: None (not at all), "pool" (a sum
    or mean over it), "mix" (anything else across it), "row" (picks one sample), "select" (a
    boolean mask), "subset" / "reorder" (some rows, or all in another order)."""
    dim, ndim = lead.rows.sample_dim, lead.dim()
    if name not in VIEWS | ELEMENTWISE | ADDITIVE | SCALING:  # copy_, fill_, zero_, requires_grad_ are listed
        name = out_of_place(name)
    if name in MIXERS:
        return "mix"
    if name == "__getitem__":
        return index_kind(args, dim)
    if name in ("select", "unbind", "narrow") and touches(dims_of(name, args, kwargs), dim, ndim):
        return {"select": "row", "unbind": "split", "narrow": "window"}[name]
    if name == "where" and len(args) == 1 and not kwargs:  # torch.where(cond): positions, as nonzero
        return "mix"
    if name == "pad":
        return "mix" if padded(args, kwargs, dim, ndim) else None
    if name == "cat":  # instance-major rows: row i and row B + i are the same sample
        given = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        return "mix" if touches((given,) if isinstance(given, int) else "all", dim, ndim) else None
    if name in MOVES or name in VIEWS or name in ELEMENTWISE or name in LIKE or name in ADDITIVE - {"sum", "nansum"}:
        return None
    if name in LOSSES:  # without gradient (with gradient the rules read losses first)
        return None if kwargs.get("reduction") == "none" else "pool"
    dims = dims_of(name, args, kwargs)
    over = touches(dims, dim, ndim)
    if name in LINEAR_OVER_DIM:
        return "pool" if over else None
    if name in NONLINEAR_OVER_DIM or name == "softmin":
        return "mix" if over else None
    if name in ROW_ORDER:
        return "reorder" if over else None
    if name in SPLITS:
        return ("split" if name in ("chunk", "split", "tensor_split") else "reorder") if over else None
    if name in PRODUCTS:
        return product_kind(name, args, lead)
    if name in ALONG:  # per sample unless along the samples' dimension
        return "mix" if touches(along_dims(name, args, kwargs), dim, ndim) else None
    if name in INDEXED_WRITES:  # into the batch's rows along another dimension (one-hot by scatter_)
        given = kwargs.get("dim", args[1] if len(args) > 1 else None)
        ok = args and args[0] is lead and isinstance(given, int) and not touches((given,), dim, ndim)
        return None if ok else "mix"
    if name in TRANSFORMS:  # torch.fft: along `dim` (third positional), else its defaults
        dims = kwargs.get("dim", args[2] if len(args) > 2 and "shift" not in name else None)
        dims = args[1] if dims is None and "shift" in name and len(args) > 1 else dims
        dims = TRANSFORMS[name] if dims is None else (dims,) if isinstance(dims, int) else tuple(dims)
        return "mix" if touches(dims, dim, ndim) else None
    if name in BATCH_FIRST:
        return None if dim == 0 and args and args[0] is lead else "mix"  # not the batch as a table or filters
    return norm_kind(name, args, kwargs, dim, ndim)


def norm_kind(name: str, args, kwargs, dim: int, ndim: int) -> str | None:
    """Normalisations: which dimensions their statistics run over. Any other operation no list
    names is per-sample only when torch tags it pointwise (one element from the same element of
    its inputs); else it is taken to mix samples (default-deny: an unknown operation's ``dim``
    cannot be trusted to mean what it means for a reduction, e.g. ``renorm``'s)."""
    if name in ("layer_norm", "rms_norm"):
        shape = kwargs.get("normalized_shape", args[1] if len(args) > 1 else ())
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return "mix" if dim >= ndim - len(shape) else None
    if name == "group_norm":
        return None if dim == 0 else "mix"
    if name == "instance_norm":
        return "mix" if dim >= 2 else None
    if name == "batch_norm":
        training = kwargs.get("training", args[5] if len(args) > 5 else False)
        return "mix" if training and dim != 1 else None
    if name == "local_response_norm":
        return "mix" if dim == 1 else None
    if not pointwise(name):
        import os

        if os.environ.get("DPZOO_LOG_UNKNOWN"):
            with open(os.environ["DPZOO_LOG_UNKNOWN"], "a") as f:
                f.write(f"{name} {dim} {ndim}\n")
    return None if pointwise(name) else "mix"


def out_of_place(name: str) -> str:
    """``cumsum_`` -> ``cumsum``: an in-place operation treats the samples as its out-of-place form."""
    if name.endswith("_") and not name.endswith("__") and len(name) > 1:
        return name[:-1]
    return name


DUNDER_ATEN = {"invert": "bitwise_not", "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor",
               "rand": "bitwise_and", "ror": "bitwise_or", "rxor": "bitwise_xor", "iand": "bitwise_and",
               "ior": "bitwise_or", "ixor": "bitwise_xor", "floordiv": "floor_divide", "rfloordiv": "floor_divide",
               "mod": "remainder", "rmod": "remainder", "lshift": "bitwise_left_shift",
               "rshift": "bitwise_right_shift"}  # fmt: skip


@functools.lru_cache(maxsize=None)
def pointwise(name: str) -> bool:
    """Whether torch tags the ATen operation of this name pointwise (``torch.Tag.pointwise``)."""
    dunder = name.startswith("__") and name.endswith("__")
    bare = DUNDER_ATEN.get(name.strip("_"), name.strip("_"))
    reflected = bare[1:] if dunder and bare.startswith(("r", "i")) else None  # __radd__, __iadd__ (not isin)
    for candidate in (bare, reflected, "special_" + bare):
        if not candidate:
            continue
        try:
            packet = getattr(torch.ops.aten, candidate)
            overloads = [getattr(packet, o) for o in packet.overloads()]
        except (AttributeError, RuntimeError):
            continue
        if any(torch.Tag.pointwise in o.tags for o in overloads):  # scalar-only overloads carry no tags
            return True
    return False


def product_kind(name: str, args, lead) -> str | None:
    """A product with one tracked factor mixes samples when it contracts their dimension."""
    dim, ndim = lead.rows.sample_dim, lead.dim()
    if name == "einsum":
        operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
        inputs, _, result = args[0].replace(" ", "").partition("->")
        for spec, t in zip(inputs.split(","), operands):
            if t is lead:
                return "mix" if "." in spec or not result or spec[dim] not in result else None
        return "mix"
    position = next((i for i, a in enumerate(args) if a is lead), 0)
    if name in ("linear", "bilinear") or position == 0 or (name in ("addmm", "baddbmm", "addbmm") and position == 1):
        return "mix" if dim == ndim - 1 or name in ("outer", "kron", "tensordot", "inner", "dot", "vdot") else None
    return "mix" if dim == max(ndim - 2, 0) or name in ("outer", "kron", "tensordot") else None


def index_kind(args, dim: int | None) -> str | None:
    """``x[index]`` along the sample dimension (which must lead for a plain index to reach it)."""
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    if dim != 0 or not items:
        return None if dim == 0 or not items else "mix"
    first = items[0]
    if first is Ellipsis:  # x[..., i]: the items after it index the last dimensions
        trailing = sum(1 for i in items[1:] if i is not None)
        ndim = args[0].dim() if isinstance(args[0], torch.Tensor) else trailing + 1
        return None if trailing < ndim else "mix"
    if isinstance(first, bool) or first is None:
        return None
    if isinstance(first, int):
        return "row"
    if isinstance(first, slice):
        return None if first == slice(None) else ("window" if first.step in (None, 1) else "reorder")
    if isinstance(first, torch.Tensor) and first.dtype == torch.bool:
        return "select"
    return "reorder"


def picked_row(name: str, args, kwargs) -> int | None:
    """The sample ``x[i]`` or ``x.select(dim, i)`` picks."""
    if name == "select":
        index = kwargs.get("index", args[2] if len(args) > 2 else None)
        return index if isinstance(index, int) else None
    index = args[1] if len(args) > 1 else None
    first = index[0] if isinstance(index, tuple) and index else index
    return first if isinstance(first, int) else None


def result_dim(name: str, args, kwargs, lead, out: torch.Tensor) -> int | None:
    """Where the samples are in ``out``: moved by a transpose, kept when the result still has
    the same extent there, else unknown (None)."""
    dim = lead.rows.sample_dim
    if name in MOVES:
        try:
            perm = permutation(name, args, kwargs, lead.dim())
        except (TypeError, ValueError, IndexError):
            return None
        return perm.index(dim) if dim in perm else None
    size = lead.shape[dim]
    if name == "stack":  # a new dimension at `dim`: the samples move behind it when it is not after them
        at = kwargs.get("dim", args[1] if len(args) > 1 else 0) % (lead.dim() + 1)
        return dim + 1 if at <= dim else dim
    if name in ("unsqueeze",) and isinstance(args[1] if len(args) > 1 else kwargs.get("dim"), int):
        at = args[1] if len(args) > 1 else kwargs["dim"]
        return dim + 1 if at % (lead.dim() + 1) <= dim else dim
    if dim < out.dim() and out.shape[dim] == size:
        return dim
    if dim == 0 and out.dim() > 0 and out.shape[0] % lead.rows.samples == 0 and size % lead.rows.samples == 0:
        return 0  # flattened (B, T, ...) -> (B·T, ...): each sample's rows stay together
    return None


def permutation(name: str, args, kwargs, ndim: int) -> list[int]:
    """The dimensions a move applies: result dimension i is input dimension ``perm[i]``."""
    perm = list(range(ndim))
    if name in ("t", "T"):
        return perm[::-1]
    if name == "mT":
        perm[-2], perm[-1] = perm[-1], perm[-2]
        return perm
    if name in ("transpose", "swapaxes", "swapdims"):
        a, b = kwargs.get("dim0", args[1]) % ndim, kwargs.get("dim1", args[2]) % ndim
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    if name == "permute":
        dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
        return [d % ndim for d in dims]
    src, dst = kwargs.get("source", args[1]), kwargs.get("destination", args[2])  # movedim, moveaxis
    return torch.arange(ndim).movedim(src, dst).tolist()


DIM_AT = {"topk": 2, "kthvalue": 2, "quantile": 2, "nanquantile": 2, "norm": 2, "normalize": 2, "roll": 2,
          "diff": 2, "cosine_similarity": 2, "chunk": 2, "split": 2, "tensor_split": 2, "take_along_dim": 2,
          "vector_norm": 2, "linalg_vector_norm": 2}  # fmt: skip
LAST_BY_DEFAULT = {"sort", "argsort", "topk", "kthvalue", "diff", "glu"}
FIRST_BY_DEFAULT = {"unbind", "chunk", "split", "tensor_split", "flipud"}


def dims_of(name: str, args, kwargs):
    """The dimensions an operation works along: a tuple, or "all" when it takes none."""
    if name == "fliplr":
        return (1,)
    d = kwargs.get("dim", kwargs.get("dims"))
    if d is None:
        at = DIM_AT.get(name, 1)
        d = args[at] if len(args) > at else None
    if isinstance(d, torch.Tensor):  # torch.max(a, b) and the like: elementwise
        return ()
    if isinstance(d, int) and not isinstance(d, bool):
        return (d,)
    if isinstance(d, (tuple, list)) and all(isinstance(x, int) for x in d):
        return tuple(d)
    if name in LAST_BY_DEFAULT:
        return (-1,)
    if name in FIRST_BY_DEFAULT:
        return (0,)
    if name in ("normalize", "cosine_similarity"):
        return (1,)
    if name in ("softmax", "log_softmax", "softmin"):
        return "implicit"  # torch's legacy rule: dimension 0 for 0-, 1- and 3-d inputs, else 1
    return "all"


def along_dims(name: str, args, kwargs):
    """The dimensions an ``ALONG`` operation works along, with its defaults."""
    if name in ("triu", "tril"):
        return (-2, -1)
    if name == "diagonal":
        return (
            kwargs.get("dim1", args[2] if len(args) > 2 else 0),
            kwargs.get("dim2", args[3] if len(args) > 3 else 1),
        )
    if name == "diag_embed":
        return (-1,)
    if name == "repeat_interleave":
        given = kwargs.get("dim", args[2] if len(args) > 2 else None)
        return "all" if given is None else (given,)  # no dim: the flattened tensor
    given = kwargs.get("dim", args[2] if len(args) > 2 else None)
    default = {"cosine_similarity": 1, "pairwise_distance": -1, "vecdot": -1, "cross": -1}[name]
    return (default if given is None else given,)


def padded(args, kwargs, dim: int, ndim: int) -> bool:
    """Whether ``F.pad`` pads (or, negative, crops) the samples' dimension: a shift of the rows."""
    pad = kwargs.get("pad", args[1] if len(args) > 1 else ())
    k = ndim - 1 - dim  # pad pairs run from the last dimension back
    return len(pad) > 2 * k + 1 and (pad[2 * k] != 0 or pad[2 * k + 1] != 0)


def touches(dims, sample_dim: int | None, ndim: int) -> bool:
    if sample_dim is None or dims == "all":
        return True
    if dims == "implicit":
        dims = (0,) if ndim in (0, 1, 3) else (1,)
    return any(d % max(ndim, 1) == sample_dim for d in dims)


def leaves(args, kwargs) -> list:
    """The arguments and those inside lists and tuples (torch functions take tensors there)."""
    found: list = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            found.extend(a)
        else:
            found.append(a)
    return found


def window_of(t) -> tuple:
    """The rows of the batch ``t`` holds, as absolute [start, stop)."""
    return t.rows.window or (0, t.rows.samples)


def sliced(name: str, args, kwargs, lead) -> tuple | None:
    """The window of ``lead[a:b]`` / ``lead.narrow(0, start, length)``, in the batch's rows."""
    start0, stop0 = window_of(lead)
    if name == "narrow":
        start = kwargs.get("start", args[2] if len(args) > 2 else 0)
        length = kwargs.get("length", args[3] if len(args) > 3 else 0)
    else:
        index = args[1]
        first = index[0] if isinstance(index, tuple) else index
        start, stop, _ = first.indices(lead.shape[0])
        length = stop - start
    return (start0 + start, start0 + start + max(length, 0))


def absolute_row(lead, i: int | None) -> int | None:
    """Row ``i`` of ``lead`` as a row of the batch."""
    if i is None:
        return None
    start, stop = window_of(lead)
    return start + i % max(stop - start, 1)
