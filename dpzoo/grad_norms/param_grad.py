"""One parameter's per-sample gradients in one step, every use gathered: :class:`ParamGrad`.

It owns the choices made on a parameter's uses: ghost or instantiation per use (the planner's,
the BK rule, or the hooks' forced mode), summing many uses once (a recurrent cell called every
time step) instead of O(uses²) cross terms, the cross terms themselves (:mod:`.reps`), and the
floating-point guard on ghost norms (:mod:`.float_guard`). It offers :meth:`ParamGrad.sq_norm`,
:meth:`ParamGrad.clipped_sum` and :meth:`ParamGrad.instantiate`; over a step's parameters,
:func:`total_sq_norms` (what the step clips by) and :func:`clipped_sums`, which take the small dense
parameters (biases, norm scales) together as one row and, on a GPU, the factored uses of one shape
on the ghost path as one stack along the batch (one set of operators for all of them); there a
single use on the instantiation path the planner marks ``freed`` is formed for its norm and freed
(:mod:`.formed`), its sum taken from its factors with the stacks.
"""

from __future__ import annotations

import math

import torch

from ..errors import InvalidArgumentError, UnsupportedModuleError
from . import formed as F
from . import sum_guard
from .autocast import no_autocast
from .float_guard import checked, checked_and_bounds, first_pass, guard, settle, triangle_bound
from .half import exact_matmuls, launches_kernels, shared_scale, upcast
from .reps import (
    Dense,
    Factored,
    OneHot,
    RowSparse,
    clipped_sum,
    flagged_clipped_sum,
    inner,
    instantiate,
    prefers_ghost,
    right_like,
    row_sparse,
    sq_norm,
    without_samples,
)
from .rounding import any_flag, dense_sq_norms, read_flags

__all__ = ["ParamGrad", "total_sq_norms", "clipped_sums", "stack_key", "stack_capacity", "SMALL_DENSE", "STACK_BYTES"]

# a parameter whose per-sample gradient is one dense use of at most this many entries a sample (a
# bias, a norm layer's scale) is normed together with the others like it: one norm, and on a GPU one
# host read, for all of them instead of one each (ResNet-18: 61 of its 82 parameters)
SMALL_DENSE = 1 << 14
# on a GPU the ghost norms of a step's uses of one shape are formed as one stack, their factors copied
# side by side along the batch: one set of operators for the Grams, the float guard and its bound
# instead of one set a use (~80 of the ~110 operators a ghost-path use launched: GPT-2's 12 blocks
# share 4 shapes; one use took 1.4-1.6 ms on an H200 against 0.6 ms instantiated, 2026-11-28). A
# stack copies at most this many bytes of factors (one stack is held at a time)
STACK_BYTES = 1 << 28
_UNSET = object()  # a cache not filled yet


class ParamGrad:
    """The per-sample gradients of one parameter in one step, ``g_i = Σ_u g_{u,i}`` over its
    uses ``u`` (one representation each), and how to compute with them.

    ``ghost``: None chooses ghost norm or instantiation per use, by ``choices`` (one bool per use,
    True: ghost; the planner's, :mod:`dpzoo.grad_norms.cost`) or else by the BK rule
    (:func:`prefers_ghost`); True / False force one. :meth:`sq_norm` settles the representations
    once (BK-MixOpt, BK paper §3.2): a use on the instantiation path is formed once, and the
    clipped sum reuses it (its factors are dropped); with ``freed`` (the planner's choice, on a GPU)
    :func:`total_sq_norms` instead forms a single use for its norm only and frees it, its sum then
    taken from its factors (:mod:`.formed`); dense uses are summed into one before any norm
    (no cross term, so uses that cancel give exactly 0); more than two uses, unless ghost is forced,
    are summed into one dense gradient (O(uses) instead of O(uses²) cross terms).
    """

    def __init__(self, reps: list, ghost: bool | None = None, choices: list[bool] | None = None, freed: bool = False):
        if not reps:
            raise InvalidArgumentError("a ParamGrad needs at least one representation: build it from a rule's output")
        if choices is not None and len(choices) != len(reps):
            raise InvalidArgumentError(f"choices: one per use ({len(reps)}), got {len(choices)}")
        self.reps = list(reps)
        self.ghost = ghost
        self.choices = choices
        self.freed = freed
        self._sq: torch.Tensor | None = None
        self._u: torch.Tensor | None = None  # U = Σ_t ‖L_t‖‖R_t‖ over the uses, where the norm's guard formed it
        self._settled = False
        self._rows: object = _UNSET  # :func:`_small_rows` of the settled use, taken by total_sq_norms for clipped_sums

    def _on_ghost(self, i: int, rep) -> bool:
        if self.ghost is not None:
            return self.ghost
        return self.choices[i] if self.choices is not None else prefers_ghost(rep)

    @property
    def batch_size(self) -> int:
        return self.reps[0].batch_size

    def _settle(self) -> None:
        if self._settled:  # once: the uses are reordered, so ``choices`` would no longer index them
            return
        rs = [
            Dense(instantiate(r)) if not isinstance(r, Dense) and not self._on_ghost(i, r) else r
            for i, r in enumerate(self.reps)
        ]
        dense = [r.grad for r in rs if isinstance(r, Dense)]
        if len(dense) > 1:  # summed before the norm: exact where uses cancel (‖g - g‖ = 0, not √ε·‖g‖)
            total = dense[0]
            for d in dense[1:]:
                total = total + d
            rs = [Dense(total)] + [r for r in rs if not isinstance(r, Dense)]
        if len(rs) > 2 and self.ghost is not True:
            dense = instantiate(rs[0])
            for r in rs[1:]:
                dense = dense + instantiate(r)
            rs = [Dense(dense)]
        self.reps, self._settled = rs, True

    def sq_norm(self) -> torch.Tensor:
        """‖g_i‖² for every sample (Tensor[B]), every cross term of a multi-use parameter included."""
        if self._sq is None:
            total, guarded = self._unguarded_sq_norm()
            self._sq = guard(self.reps, total) if guarded else total
        return self._sq

    def _unguarded_sq_norm(self) -> tuple[torch.Tensor, bool]:
        """(the computed ‖g_i‖², whether it needs the floating-point guard: a use on the ghost path)."""
        self._settle()
        rs = self.reps
        ghost = self.ghost is not False  # what is not Dense after settling is on the ghost path
        total = sq_norm(rs[0], ghost=ghost)
        for i in range(len(rs)):
            if i:
                total = total + sq_norm(rs[i], ghost=ghost)
            for j in range(i + 1, len(rs)):  # cross terms of a parameter used twice
                total = total + 2 * inner(rs[i], rs[j], ghost=ghost)
        # a dense norm is that of the very tensor summed: no guard
        return total.clamp_min(0), not all(isinstance(r, Dense) for r in rs)

    def triangle_bound(self) -> torch.Tensor:
        """U_i = Σ over uses and positions of ‖L_t‖‖R_t‖ ≥ ‖g_i‖ in float64 (the guard's where it formed it)."""
        self._u = u = self._u if self._u is not None else torch.stack([triangle_bound(r) for r in self.reps]).sum(0)
        return u

    def clipped_sum(self, scale: torch.Tensor, drop: torch.Tensor | None = None) -> torch.Tensor:
        """Σ_i scale_i g_i over every use (the parameter's shape); samples where ``drop`` is True
        contribute exactly 0, whatever their values (see :func:`without_samples`)."""
        reps = self.reps if drop is None else [without_samples(r, drop) for r in self.reps]
        scale = shared_scale(reps, scale)  # one factor for every use: uses that cancel must share it
        total = clipped_sum(reps[0], scale)
        for r in reps[1:]:
            total = total + clipped_sum(r, scale)
        return total

    def flagged_clipped_sum(self, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(:meth:`clipped_sum`'s sum, whether a use's scaled factor lost bits: a device bool, or
        None; no host read). Where True, :meth:`clipped_sum` is the sum to use."""
        scale = shared_scale(self.reps, scale)
        total, lost = flagged_clipped_sum(self.reps[0], scale)
        for r in self.reps[1:]:
            part, flag = flagged_clipped_sum(r, scale)
            total = total + part
            lost = flag if lost is None else lost if flag is None else lost | flag
        return total, lost

    def instantiate(self) -> torch.Tensor:
        """The per-sample gradients, (B, *shape), every use summed."""
        total = instantiate(self.reps[0])
        for r in self.reps[1:]:
            total = total + instantiate(r)
        return total

    def row_sparse(self) -> "RowSparse | None":
        """The rows each sample touched, if every use is an embedding lookup; else None."""
        rs = self.reps
        if not all(isinstance(r, OneHot) for r in rs):
            return None
        merged = (
            rs[0]
            if len(rs) == 1
            else OneHot(torch.cat([r.index for r in rs], 1), torch.cat([r.right for r in rs], 1), rs[0].num_rows)
        )
        return row_sparse(merged)


def _summed(name: str, g: ParamGrad, scale: torch.Tensor, drop: torch.Tensor | None, flagged: bool) -> tuple:
    """(``g``'s clipped sum, the flag of :meth:`ParamGrad.flagged_clipped_sum` or None); a sum that
    fails on what a layer recorded is refused, naming the parameter."""
    try:
        return g.flagged_clipped_sum(scale) if flagged else (g.clipped_sum(scale, drop), None)
    except RuntimeError as e:  # representations that do not fit together
        raise UnsupportedModuleError(
            f"The clipped sum of {name} failed on what its layer recorded ({str(e).splitlines()[0][:160]}): "
            "the module does not compute what its rule assumes."
        ) from e


def _stacked_sums(labels: list[str], members: list[ParamGrad], scale: torch.Tensor) -> tuple:
    """(the clipped sum of each of ``members``, stackable uses of one shape, from one stack, whether
    a scaled factor of any lost bits: a device bool, or None); refused as :func:`_summed` does."""
    if len(members) == 1:
        total, lost = _summed(labels[0], members[0], scale, None, True)
        return [total], lost
    stack = _stacked(members)[0]
    try:
        total, lost = flagged_clipped_sum(stack, shared_scale([stack], scale).repeat(len(members)), len(members))
    except RuntimeError as e:  # representations that do not fit together
        raise UnsupportedModuleError(
            f"The clipped sums of {', '.join(labels)} failed on what their layers recorded "
            f"({str(e).splitlines()[0][:160]}): the modules do not compute what their rules assume."
        ) from e
    return list(total.unbind(0)), lost


def _one_dense(g: ParamGrad) -> torch.Tensor | None:
    """``g``'s per-sample gradient if it is one dense use; else None."""
    return g.reps[0].grad if len(g.reps) == 1 and isinstance(g.reps[0], Dense) else None


def _small_rows(grad: torch.Tensor | None) -> torch.Tensor | None:
    """(B, n) rows of a dense gradient of at most SMALL_DENSE entries a sample, half values in
    float32 (as a norm or sum of it sees them); else None."""
    if grad is None or math.prod(grad.shape[1:]) > SMALL_DENSE:
        return None
    grad = upcast(grad)
    return grad.flatten(1) if grad.dim() > 1 else grad.unsqueeze(1)


@no_autocast()
@exact_matmuls()  # once for every product of every norm
def total_sq_norms(grads: list[ParamGrad]) -> list[torch.Tensor]:
    """Per-sample squared norms whose sum is ‖g_i‖² over every parameter of ``grads``: parameters
    that settle to one small dense use (SMALL_DENSE) normed as one concatenated row per sample and
    dtype (the squared norm of a concatenation is the sum of its parts', and :func:`dense_sq_norms`
    bounds its rounding as of any row), every dense one with one host read for all
    (:func:`dense_sq_norms`), every other as :meth:`ParamGrad.sq_norm` does, the floating-point
    guards of those on the ghost path with one host read for all on a GPU (:func:`.float_guard.first_pass`,
    :func:`.float_guard.settle`), as one stack of rows on a CPU (:func:`.float_guard.checked_and_bounds`); on a
    GPU, single factored uses of one shape normed and guarded as one stack (:data:`STACK_BYTES`):
    every sample's norm and bound are its own rows' in the stack, as they would be alone; and single
    ``freed`` uses on the instantiation path formed one at a time for their norms and freed
    (:mod:`.formed`), their guards' host read shared with the others."""
    out, dense, ghost, stackable, formed = [], [], [], [], []
    small: dict[torch.dtype, list] = {}
    for g in grads:
        grad = _one_dense(g)  # one dense use needs no settling (most of DP-BiTFiT's and BK-MixOpt's)
        if grad is None and _formable(g):  # formed, normed and freed below; its sum from its factors
            g._settled = True
            formed.append(g)
            continue
        if grad is None:
            g._settle()
            grad = _one_dense(g)
        rows = g._rows = _small_rows(grad)
        if rows is not None:
            small.setdefault(rows.dtype, []).append(rows)
        elif grad is not None:  # what sq_norm would compute, its host read shared
            dense.append(upcast(grad))
        elif g._sq is not None:
            out.append(g._sq)
        elif _stackable(g):
            stackable.append(g)
        else:
            total, guarded = g._unguarded_sq_norm()
            if guarded:  # guarded below, with one host read for all
                ghost.append((g, total))
            else:
                g._sq = total
                out.append(total)
    stacks = _stacks(stackable)
    if stacks or formed or any(launches_kernels(t) for _, t in ghost):  # a GPU: the first passes, one host read
        checks = [lambda r=g.reps, t=total: checked(r, t) for g, total in ghost]
        firsts = [first_pass(g.reps, total) for g, total in ghost]
        owners = [[g] for g, _ in ghost]
        for members in stacks:
            reps = _stacked(members)  # freed at the next stack; made again only if its guard fires
            total = sq_norm(reps[0], ghost=True).clamp_min(0)
            firsts.append(first_pass(reps, total))
            checks.append(lambda m=members, t=total: checked(_stacked(m), t))
            owners.append(members)
        for group in F.by_batch(formed):  # formed and freed one by one, bounded together
            for g, (result, flag, check, u) in zip(group, F.first_passes([g.reps[0] for g in group])):
                firsts.append((result, flag, u))
                checks.append(check)
                owners.append([g])
        results = list(zip(settle(checks, [f[:2] for f in firsts]), [f[2] for f in firsts]))
    else:  # a CPU: single uses' bounds stacked, a sample to redo guarded alone
        results = checked_and_bounds([(g.reps, total) for g, total in ghost])
        owners = [[g] for g, _ in ghost]
    for members, (sq, u) in zip(owners, results):  # U too, for the sums' own guard (:mod:`.sum_guard`)
        for g, part, bound in zip(members, _parts(sq, len(members)), _parts(u, len(members))):
            g._sq, g._u = part, bound
            out.append(part)
    return out + dense_sq_norms(dense + [torch.cat(rows, 1) for rows in small.values()])


def _parts(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """The ``n`` members' rows of a stack's per-sample ``x`` (the k-th's at rows k·B…)."""
    return x.unflatten(0, (n, -1)).unbind(0) if n > 1 else [x]


def stack_key(rep) -> tuple | None:
    """What a factored use of one group on a device that launches kernels shares with the uses it is
    stacked with (factor shapes, dtypes, device, parameter shape); None for any other use."""
    if not isinstance(rep, Factored) or rep.left.shape[1] != 1 or not launches_kernels(rep.left):
        return None
    right = right_like(rep)
    return (tuple(rep.left.shape), tuple(right.shape), rep.left.dtype, right.dtype, rep.left.device, rep.shape)


def _formable(g: ParamGrad) -> bool:
    """Whether unsettled ``g`` is one use on the instantiation path, ``freed`` (the planner's choice),
    that :mod:`.formed` norms by forming it and freeing it (on a GPU), its sum then from its factors."""
    return (
        g.freed
        and not g._settled
        and g._sq is None
        and len(g.reps) == 1
        and F.formable(g.reps[0])
        and not g._on_ghost(0, g.reps[0])
    )


def _stackable(g: ParamGrad) -> bool:
    """Whether settled ``g`` is one use with a :func:`stack_key` (on the ghost path): normed and
    summed in a stack of its shape (:func:`_stacks`)."""
    return len(g.reps) == 1 and stack_key(g.reps[0]) is not None


def _stacks(grads: list[ParamGrad]) -> list[list[ParamGrad]]:
    """``grads`` (each :func:`_stackable`) in groups of one :func:`stack_key`, each group's factors
    at most :data:`STACK_BYTES` (a group of one where a use's exceed it)."""
    groups: dict[tuple, list[ParamGrad]] = {}
    for g in grads:
        groups.setdefault(stack_key(g.reps[0]), []).append(g)
    out = []
    for members in groups.values():
        per = stack_capacity(members[0].reps[0])
        out += [members[i : i + per] for i in range(0, len(members), per)]
    return out


def stack_capacity(rep: Factored) -> int:
    """How many uses of ``rep``'s shape one stack holds: :data:`STACK_BYTES` of their factors, at least one."""
    right = right_like(rep)
    size = rep.left.numel() * rep.left.element_size() + right.numel() * right.element_size()
    return max(1, STACK_BYTES // max(size, 1))


def _stacked(members: list[ParamGrad]) -> list:
    """The single uses of ``members`` (one shape) as one factored use of all their samples, the
    n-th member's at rows n·B to (n+1)·B; a member alone as it is."""
    reps = [g.reps[0] for g in members]
    if len(reps) == 1:
        return reps
    return [Factored(torch.cat([r.left for r in reps]), torch.cat([r.right for r in reps]), reps[0].shape)]


@no_autocast()
@exact_matmuls()  # once for every product of every sum
def clipped_sums(grads: dict[str, ParamGrad], scale: torch.Tensor, drop: torch.Tensor | None) -> dict:
    """{name: Σ_i scale_i g_i} for every parameter of ``grads`` (:meth:`ParamGrad.clipped_sum`),
    those that are one small dense use summed as one concatenated row per sample and dtype (one
    product instead of one each; each sum a view of the shared result, in the parameter's shape).
    A sum that fails on what a layer recorded is refused, naming the parameter."""
    out: dict[str, torch.Tensor] = {}
    small: dict[torch.dtype, list] = {}
    flagged: dict[str, torch.Tensor] = {}
    stackable: list[ParamGrad] = []
    deferred = drop is None and launches_kernels(scale)  # on a GPU: one host read for every parameter, below
    for name, g in grads.items():
        rows = g._rows if g._rows is not _UNSET else _small_rows(_one_dense(g))
        if isinstance(rows, torch.Tensor):
            small.setdefault(rows.dtype, []).append((name, rows, g.reps[0].grad.shape[1:]))
            continue
        if deferred and _stackable(g):
            stackable.append(g)
            continue
        out[name], lost = _summed(name, g, scale, drop, deferred)
        if lost is not None:
            flagged[name] = lost
    names = {id(g): name for name, g in grads.items()} if stackable else {}
    for members in _stacks(stackable):  # each member's sum its own block of one batched product
        labels = [names[id(g)] for g in members]
        sums, lost = _stacked_sums(labels, members, scale)
        out.update(zip(labels, sums))
        if lost is not None:
            flagged.update((n, lost) for n in labels)
    risky, amplified = sum_guard.risky_samples(grads)
    flags = list(flagged.values()) + list(amplified.values())
    fired = read_flags(flags) if flags and any_flag(flags) else []  # one host read; a second for all if any fired
    for name, lost in zip(flagged, fired):
        if lost:  # a scaled factor lost bits: its sum in float64 (a stack's members one by one)
            out[name] = _summed(name, grads[name], scale, drop, False)[0]
    for name, amplify in zip(amplified, fired[len(flagged) :]):
        if amplify:  # a sum that could round past R: those samples' shares in float64
            out[name] = sum_guard.exact_sum(grads[name], scale, drop, risky[name])
    for group in small.values():
        total = ParamGrad([Dense(torch.cat([rows for _, rows, _ in group], 1))]).clipped_sum(scale, drop)
        for (name, rows, shape), part in zip(group, total.split([rows.shape[1] for _, rows, _ in group])):
            out[name] = part if part.shape == shape else part.view(shape)  # a vector as it is: no operator
    return {name: out[name] for name in grads}
