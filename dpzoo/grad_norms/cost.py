"""The per-layer planner: ghost norm or instantiation for each use of a layer in a step, chosen by
estimated time under a memory budget.

The BK paper (§3.2, BK-MixOpt) chooses by space: ghost norm iff 2T² < p·d. Its own cost table
(BK paper Table 2) shows that time can point the other way: in BK the clipped sum is formed
anyway, and a use on the instantiation path forms it from the per-sample gradients it already
holds. Counting multiply-adds of one use with B samples, G groups, T positions, p inputs and d
outputs per group (a Factored representation, :mod:`dpzoo.grad_norms.reps`):

* ghost norm: the two Gram matrices and their product, 2·B·G·T²·(p + d) + B·G·T², then the
  clipped sum Σ_i c_i L_iᵀ R_i, 2·B·G·T·p·d; it holds B·G·T² numbers;
* instantiation: g_i = L_iᵀ R_i, 2·B·G·T·p·d, then its squared sum and Σ_i c_i g_i, 2·B·G·p·d,
  plus :data:`TRAFFIC` per element for moving the B·G·p·d numbers it holds until the clip
  factors are known (after every layer's norm).

Counting arithmetic alone, instantiation would win nearly always for sequences; the memory
traffic term keeps it to layers whose per-sample gradients are small beside their Grams (every
layer of GPT-2 4×256 at T = 128, a convolution's high-resolution stages), and ghost norm is faster
for few positions (T = 1 and wide layers: ResNet's last stages). ``autotune=True`` times both paths instead (:func:`measure_paths`), and is
what ``autotune=None`` (the default) does on CUDA: there the step is bound by kernel launches and
host synchronisations, not arithmetic, and the ghost path launches about three times the
operators of instantiation (its Grams, the float guard, the split clipped sum), so the model
misorders the paths: measured on an H200 in bf16 (benchmarks/results/gpu_h200_1127), ViT-B/16's
DP step took 184 ms with the model's plan and 113 ms with every layer instantiated. Not when
``torch.use_deterministic_algorithms`` is on: timed plans are not reproducible bit for bit.
An embedding lookup (OneHot) costs B·T²·(d + 1) by ghost norm and forms a B·V·d table by
instantiation. Every instantiated use is held at once, so the planner shares one budget among
them: the uses where instantiation saves time are taken in order of time saved per byte while
their memory fits; every other use takes the ghost norm, except that a use whose ghost norm alone
would not fit the budget is instantiated if that is smaller (the space rule as the fallback).

The budget (``memory_budget``, bytes) defaults to half of the device's free memory when the
step is assembled (:func:`default_budget`). Both paths are exact up to the ghost norm's rounding
bound (an upper bound: :mod:`dpzoo.grad_norms.float_guard`), so the choice changes time, memory
and that margin, never the guarantee (tests compare every choice with brute force).
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import replace

import torch

from ..device_memory import available_memory
from ..errors import InvalidArgumentError
from . import reps as R
from .formed import formable
from .param_grad import ParamGrad, clipped_sums, stack_capacity, stack_key, total_sq_norms
from .use_costs import TRAFFIC, UseCost, use_cost

__all__ = [
    "UseCost",
    "use_cost",
    "plan_uses",
    "measure_paths",
    "default_budget",
    "check_budget",
    "check_autotune",
    "BUDGET_FRACTION",
    "TRAFFIC",
    "autotunes",
    "TIMING_ROOM",
    "run_paths",
    "measure_freed",
]

# the share of free device memory the instantiated per-sample gradients may take by default
BUDGET_FRACTION = 0.5


def check_budget(budget: float | None) -> float | None:
    """``memory_budget`` as given, or an :class:`~dpzoo.errors.InvalidArgumentError` saying what it must be."""
    if budget is None:
        return None
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 0:
        raise InvalidArgumentError(
            f"memory_budget must be a number of bytes >= 0 (0: ghost norm everywhere) or None (half of the "
            f"device's free memory), got {budget!r}."
        )
    return float(budget)


def check_autotune(autotune) -> bool | None:
    """``autotune`` as given (True, False or None), or an :class:`~dpzoo.errors.InvalidArgumentError`."""
    if autotune is not None and not isinstance(autotune, bool):
        raise InvalidArgumentError(
            f"autotune must be True, False or None (time the paths on CUDA only), got {autotune!r}."
        )
    return autotune


def default_budget(device: torch.device) -> float:
    """:data:`BUDGET_FRACTION` of the memory available on ``device``
    (:func:`dpzoo.device_memory.available_memory`: CUDA's free memory; on CPU MemAvailable under
    any cgroup limit, not MemFree, which misses the reclaimable page cache), or 1 GiB on other
    devices and where it cannot be read."""
    if device.type == "cuda" and not torch.cuda.is_available():
        return float(2**30)
    if device.type not in ("cuda", "cpu", "mps"):
        return float(2**30)
    available, _ = available_memory(device)
    return BUDGET_FRACTION * available if available > 0 else float(2**30)


# a use is timed only if its paths fit this many times over, in the budget and in the device's free
# memory (else the model decides): the bytes count elements in the factors' dtype, and the ghost path
# holds float32 Grams and their product (a float64 recheck, which timing avoids, would hold more).
# Timed without a bound, ResNet-50-GN's stem at 224² (112² positions) ran an H200 out of memory
# asking for a (64, 112², 112²) float64 tensor (75 GiB; benchmarks/results/gpu_h200_1127)
TIMING_ROOM = 16
# (G, T, p, d, dtype, device) -> per-sample milliseconds (ghost, instantiation), measured once
MEASURED: dict[tuple, tuple[float, float]] = {}


def autotunes(device: torch.device) -> bool:
    """Whether ``autotune=None`` times the two paths on ``device``: on CUDA (see the module
    docstring), unless the user asked torch for deterministic algorithms (timed plans can differ
    between runs, and with them the rounding of the norms and sums)."""
    return device.type == "cuda" and not torch.are_deterministic_algorithms_enabled()


def measure_paths(rep, stack: int = 1) -> tuple[float, float]:
    """Milliseconds of the ghost path and of the instantiation path for ``rep`` (a Factored
    representation) as a step runs them (the norm, with the float guard on the ghost path, then the
    clipped sum: :func:`~dpzoo.grad_norms.param_grad.total_sq_norms` and
    :func:`~dpzoo.grad_norms.param_grad.clipped_sums`), each the faster of two timed runs after a
    warm-up; each path of ``stack`` uses of this shape at once, per use (on a GPU a step norms and
    sums the ghost path's as one stack, and reads the host once for all uses of either path: timed
    alone, the instantiation path paid a host read the step shares). Measured once per shape and stack without the batch size (both
    paths are linear in it) and scaled to this batch. Timed on random factors of ``rep``'s shapes,
    dtype and device, never on its values (the float guard's rechecks, and a CPU's subnormals, take
    data-dependent time: the plan must depend on shapes alone), drawn from a generator of its own.
    Each sample's rows share a component, as real activations do: factors independent across
    positions make the guard recheck every sample in float64 from T = 512 on, which ordinary data
    rarely needs (docs/DESIGN.md, "Floating point"), and would bias the timing against the ghost path."""
    return _measured(rep, stack, freed=(False, False), ghost=(True, False))


def measure_freed(rep, stack: int = 1) -> float:
    """Milliseconds of the instantiation path for ``rep`` with each use formed for its norm and
    freed (:mod:`.formed`; on a GPU, a single plain factored use), timed as :func:`measure_paths`
    times the other two."""
    return _measured(rep, stack, freed=(True,), ghost=(False,))[0]


def _measured(rep, stack: int, freed: tuple, ghost: tuple) -> tuple:
    """:func:`measure_paths` of the paths (``ghost``, ``freed``), each once per shape and stack."""
    b = rep.left.shape[0]
    key = (*_paths_key(rep), stack) + (("freed",) if any(freed) else ())
    if key not in MEASURED:
        device = rep.left.device
        gen = torch.Generator(device).manual_seed(0)  # its own: the user's RNG streams stay as they were
        left, right = (_probe(x, gen, device) for x in (rep.left, R.right_like(rep)))
        rep = R.Factored(left, right, rep.shape)
        scale = torch.rand(b, generator=gen, device=device)  # clip factors are float32
        MEASURED[key] = tuple(
            _timed(lambda: run_paths(rep, g, stack, scale, f), device) / stack / b for g, f in zip(ghost, freed)
        )
    return tuple(ms * b for ms in MEASURED[key])


def run_paths(rep, ghost: bool, uses: int, scale: torch.Tensor, freed: bool = False) -> None:
    """What a step runs for ``uses`` single uses like ``rep`` on one path (``ghost``; ``freed``: an
    instantiated use formed for its norm and freed): their norms
    (:func:`~dpzoo.grad_norms.param_grad.total_sq_norms`) and clipped sums by ``scale``."""
    grads = {str(i): ParamGrad([rep], ghost, freed=freed) for i in range(uses)}
    total_sq_norms(list(grads.values()))
    clipped_sums(grads, scale, None)


def _paths_key(rep) -> tuple:
    """:data:`MEASURED`'s key for a Factored ``rep``: its shapes without the batch, dtype, device."""
    _, g, t, p = rep.left.shape
    right = R.right_like(rep)
    return (g, t, p, right.shape[3], right.dtype, str(rep.left.device))


def _probe(x: torch.Tensor, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Random factors on ``device`` shaped like ``x`` (B, G, T, k; a meta tensor for a factor not
    yet formed): a per-sample component shared by every position, plus half as much noise per position."""
    shared = torch.randn(*x.shape[:2], 1, x.shape[3], generator=gen, device=device)
    rows = torch.randn(x.shape, generator=gen, device=device).mul_(0.5).add_(shared)
    return rows.to(x.dtype)


def _timed(fn, device: torch.device) -> float:
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    fn()
    runs = []
    for _ in range(2):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        runs.append(1000 * (time.perf_counter() - start))
    return min(runs)


def plan_uses(
    by_param: dict[str, list], budget: float | None = None, autotune: bool | None = None
) -> dict[str, list[UseCost]]:
    """{parameter: one :class:`UseCost` per use, with the choice made} for a step's
    representations (``by_param``: parameter name → its uses' representations). ``budget``:
    bytes the instantiated uses may hold together (None: :func:`default_budget` of their device).
    A parameter with more than two uses is summed densely by :class:`~dpzoo.grad_norms.param_grad.ParamGrad`
    (O(uses) instead of O(uses²) cross terms): its uses are reported, not planned. ``autotune``:
    the linear uses are timed on both paths (:func:`measure_paths`, once per shape, where they
    fit: :func:`_time_uses`) and compared by time instead of multiply-adds (None: on CUDA only,
    :func:`autotunes`)."""
    costs: dict[str, list[UseCost]] = {}
    for n, rs in by_param.items():  # loops, not a comprehension per parameter: this runs every step
        costs[n] = row = []
        for i, r in enumerate(rs):
            row.append(use_cost(n, i, r))
    device = next((rep_device(r) for rs in by_param.values() for r in rs), torch.device("cpu"))
    if autotune is None:
        autotune = autotunes(device)
    if budget is None:
        budget = default_budget(device)
    if autotune:
        costs = _time_uses(by_param, costs, min(budget, _free(device)))
    plannable = [c for n, cs in costs.items() if len(cs) <= 2 for c in cs if c.kind != "dense"]
    faster = sorted(
        (c for c in plannable if c.time(False) < c.time(True)),
        key=lambda c: (c.time(True) - c.time(False)) / max(c.instantiate_bytes, 1.0),
        reverse=True,
    )
    chosen: dict[tuple[str, int], str] = {}
    left = budget
    for c in faster:
        if c.instantiate_bytes <= left:
            chosen[(c.param, c.use)] = "instantiate: faster, fits the budget"
            left -= c.instantiate_bytes
    for c in plannable:
        key = (c.param, c.use)
        if key in chosen:
            continue
        if c.ghost_bytes > budget and c.instantiate_bytes < c.ghost_bytes and c.instantiate_bytes <= left:
            chosen[key] = "instantiate: the ghost norm alone exceeds the budget"
            left -= c.instantiate_bytes
    out: dict[str, list[UseCost]] = {}
    for n, cs in costs.items():
        rows = []
        for c in cs:
            if c.kind == "dense":
                rows.append(c)
            elif len(cs) > 2:
                rows.append(_with(c, False, f"summed densely with the other {len(cs) - 1} uses"))
            elif (c.param, c.use) in chosen:
                rows.append(_with(c, False, chosen[(c.param, c.use)]))
            elif c.freed_ms is not None and c.freed_ms < c.time(True) and c.freed_bytes <= budget:
                # only where the plan would take the ghost norm: its clipped sum is the ghost path's
                why = "instantiate, formed for its norm and freed: faster than the ghost norm"
                rows.append(replace(c, ghost=False, freed=True, why=why))
            elif c.time(False) < c.time(True):
                rows.append(_with(c, True, "ghost: instantiating would exceed the budget"))
            else:
                rows.append(_with(c, True, "ghost: faster"))
        out[n] = rows
    return out


def _time_uses(by_param: dict[str, list], costs: dict[str, list[UseCost]], room: float) -> dict[str, list[UseCost]]:
    """``costs`` in milliseconds: each linear use of a parameter with at most two uses timed
    (:func:`measure_paths`) where its paths and factors fit ``room`` :data:`TIMING_ROOM` times
    over or its shape was timed before (so a step with less free memory keeps the plan), and a
    device out of memory while timing leaves the use to the model; every other use's
    multiply-adds converted at the median rate of the timed ones, so the budget compares one unit."""
    out = {n: list(cs) for n, cs in costs.items()}
    stacks = _stack_sizes(by_param)
    for n, rs in by_param.items():
        for i, r in enumerate(rs):
            c = out[n][i]
            if len(rs) > 2 or not isinstance(r, R.Factored):
                continue
            right = R.right_like(r)
            factors = (r.left.numel() + right.numel()) * right.element_size()
            one = TIMING_ROOM * max(c.ghost_bytes, c.instantiate_bytes, factors)  # per use timed at once
            want = stacks.get((n, i), 1)
            # a shape timed once keeps its timing: the room (free memory now) only guards new timings,
            # with as many uses at once as it holds
            key = _paths_key(r)  # once: the planner runs every step
            stack = want if (*key, want) in MEASURED else max(1, min(want, int(room // max(one, 1))))
            fits = (*key, stack) in MEASURED or one * stack <= room
            if not fits:
                continue
            try:
                ghost_ms, inst_ms = measure_paths(r, stack)
                freed = MEASURED.get((*key, stack, "freed")) if len(rs) == 1 and type(r) is R.Factored else None
                freed_ms = freed[0] * r.left.shape[0] if freed else _freed_ms(r, rs, stack)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                continue
            out[n][i] = _timed_row(c, float(ghost_ms), float(inst_ms), None if freed_ms is None else float(freed_ms))
    timed = [c for cs in out.values() for c in cs if c.timed]
    if not timed:
        return costs
    rate = statistics.median([c.ghost_ms / c.ghost_flops for c in timed if c.ghost_ms is not None and c.ghost_flops] +
                             [c.instantiate_ms / c.instantiate_flops for c in timed if c.instantiate_ms is not None and c.instantiate_flops])  # fmt: skip
    for n, cs in out.items():
        out[n] = [c if c.timed or c.kind == "dense" else _priced_row(c, float(rate)) for c in cs]
    return out


@functools.lru_cache(maxsize=1 << 12, typed=True)  # Python floats (a timer's numpy float: one row each)
def _timed_row(c: UseCost, ghost_ms: float, inst_ms: float, freed_ms: float | None) -> UseCost:
    return replace(c, ghost_ms=ghost_ms, instantiate_ms=inst_ms, freed_ms=freed_ms, timed=True)


@functools.lru_cache(maxsize=1 << 12, typed=True)
def _priced_row(c: UseCost, rate: float) -> UseCost:
    """``c`` with its multiply-adds converted to milliseconds at ``rate`` (the timed uses' median)."""
    return replace(c, ghost_ms=c.ghost_flops * rate, instantiate_ms=c.instantiate_flops * rate)


def _freed_ms(r, rs: list, stack: int) -> float | None:
    """:func:`measure_freed` of a single use the freed path can take; else None."""
    return measure_freed(r, stack) if len(rs) == 1 and formable(r) else None


def _stack_sizes(by_param: dict[str, list]) -> dict[tuple[str, int], int]:
    """{(parameter, use): how many uses its ghost path would be stacked with (itself included)}: the
    single factored uses of one group on a GPU, by shape and dtype, up to
    :func:`~dpzoo.grad_norms.param_grad.stack_capacity` (as if all took the ghost path)."""
    keys: dict[tuple[str, int], tuple] = {}
    for n, rs in by_param.items():
        key = stack_key(rs[0]) if len(rs) == 1 and isinstance(rs[0], R.Factored) else None  # no call for the rest
        if key is not None:
            keys[(n, 0)] = key
    counts: dict[tuple, int] = {}
    for key in keys.values():
        counts[key] = counts.get(key, 0) + 1
    return {use: min(counts[key], stack_capacity(by_param[use[0]][0])) for use, key in keys.items()}


def _free(device: torch.device) -> float:
    """Free memory on ``device`` in bytes (CUDA's; elsewhere unbounded: the budget decides)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return float("inf")
    return float(available_memory(device)[0])


@functools.lru_cache(maxsize=1 << 12)
def _with(c: UseCost, ghost: bool, why: str) -> UseCost:
    return replace(c, ghost=ghost, why=why)  # frozen rows: one copy per choice, not one a step


def rep_device(rep) -> torch.device:
    return (
        rep.grad.device
        if isinstance(rep, R.Dense)
        else rep.left.device
        if isinstance(rep, R.Factored)
        else rep.right.device
    )
