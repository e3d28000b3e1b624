"""Exact cost accounting of one training step, at any size, without computing it (issue 30 item 1).

:class:`ShapeTrace` is a ``TorchDispatchMode`` under which every ATen operator runs for its
output's shape only: the operator runs on ``meta`` copies of its inputs (PyTorch's own shape
functions) and returns uninitialised CPU tensors of that shape, dtype and stride, whose pages the
OS never touches. The real training step of a mode (:mod:`bench_modes`, dpzoo's engine with its
hooks, Opacus) runs at a GPU configuration's real size on any machine in seconds. For every
operator it records FLOPs (``torch.utils.flop_counter``'s formulas for products and convolutions;
one per element written or read otherwise), bytes read and written, its dtype, whether it is a
product a GPU runs on tensor cores, and whether it makes the host wait for the device; and the
peak of live tensor memory. The counts depend only on the code, the library versions and the
sizes, not on the machine.

What it cannot see, by construction:

- values: an operator the host reads (``.item()``, ``bool(t)``, ``nonzero``) gets the answer of
  a step where every check passes (nothing non-finite, nothing out of range, nothing lost), so the
  trace follows the path a normal step takes; dpzoo's first-step self-check is off.
- the device: the trace runs CPU tensors, with dpzoo's tensor-core product path on
  (:data:`dpzoo.grad_norms.half.TENSOR_CORE_DEVICES`) and batched products where a GPU would launch
  many small ones (:data:`~dpzoo.grad_norms.half.LAUNCH_DEVICES`), the optimizer's multi-tensor (foreach)
  kernels as on CUDA, and the CPU attention kernels counted by the formulas of the GPU's. Under
  CPU autocast softmax, log-softmax, layer norm and sums stay in bf16 where CUDA autocast runs them
  in float32: a bf16 trace leaves out those casts and counts their bytes at half width (the
  non-private step as much as the DP step).
- fusion and library choices inside a kernel (cuDNN, cuBLAS, flash attention): one operator is one
  kernel with the bytes of its inputs and outputs.

The counts are the same on any machine for the same versions of torch, transformers and Python
(the lock: constraints.txt); the Python-call count is CPython's (``sys.setprofile``).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import sys
import warnings
from dataclasses import dataclass, field

import bench_modes
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten
# operators whose result the host reads: the answer a passing step gets
HOST_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.nonzero.default, aten.equal.default}
# operators that allocate or relabel memory without a kernel
NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.lift_fresh.default}
HALF = (torch.bfloat16, torch.float16)
# operators that relabel memory (no kernel, no new storage): run for real
RELABELS = {aten.set_, aten._unsafe_view}
# in-place operators that write their destination without reading it
WRITE_ONLY = {aten.copy_, aten.fill_, aten.zero_, aten.normal_, aten.uniform_, aten.bernoulli_, aten.random_}
# reductions whose speed on a GPU depends on how many contiguous entries each output reduces
REDUCTIONS = {aten.linalg_vector_norm, aten.sum, aten.mean, aten.amax, aten.amin, aten.norm}
# the CPU's attention kernels counted by the formulas of the GPU's (same products)
FORMULA_OF = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward,
}
MODE_LOOKUPS = ("torch/_library/simple_registry.py",)  # run per operator only under a Python dispatch mode
# no first-step self-check (it compares values); the planner's memory budget of an 80 GB GPU (half
# its memory, the engine's default there), not of the machine that traces: the same plan anywhere
ENGINE = {"self_check": False, "memory_budget": 40 * 2**30}


@dataclass
class Op:
    """One operator of the traced step."""

    name: str
    flops: float
    read: int  # bytes
    written: int
    dtype: str  # of the first tensor input (of the output for a factory)
    unit: str  # "tc_half", "tc_half_out32", "tc_tf32", "fp32", "fp64" (products) or "memory"
    kernel: bool  # launches device work
    sync: bool  # the host waits for the device's answer
    source: str = ""  # the innermost dpzoo function that ran it ("" for the model's own and torch's)
    inner: int = 0  # a reduction over the innermost dimensions: entries per output (0: another operator)


@dataclass
class Trace:
    """Every operator of one step, the Python function calls around them (the host's work that
    launches no operator: module calls, hooks, dpzoo's bookkeeping), the peak of live tensor memory."""

    ops: list[Op] = field(default_factory=list)
    python_calls: int = 0
    peak_bytes: int = 0
    start_bytes: int = 0


def _meta(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.Generator):
        return None
    if isinstance(x, torch.device):  # e.g. autocast's casts name the device
        return torch.device("meta")
    return x


def _bytes(t: torch.Tensor) -> int:
    """Bytes an operator touches in ``t``: its elements, a broadcast (stride 0) dimension once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride != 0 else 1
    return n * t.element_size()


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _unit(func, inputs: list[torch.Tensor]) -> str:
    packet = FORMULA_OF.get(func._overloadpacket, func._overloadpacket)
    if packet not in flop_registry:
        return "memory"
    dtype = inputs[0].dtype if inputs else torch.float32
    if dtype in HALF:  # a float32 result of half operands (out_dtype) runs other kernels than half-in, half-out
        return "tc_half_out32" if func._overloadname == "dtype" else "tc_half"
    if dtype == torch.float64:
        return "fp64"
    if "conv" in str(packet):  # cuDNN runs float32 convolutions on TF32 tensor cores unless told not to
        return "tc_tf32" if torch.backends.cudnn.allow_tf32 else "fp32"
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tc_tf32"


def _mutated(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an operator without results writes (its arguments marked ``a!``)."""
    names = [a.name for a in func._schema.arguments]
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            out += _tensors(args[i] if i < len(args) else kwargs.get(names[i]))
    return out


def passing_answer(func, args):
    """What a host read returns in a step where every check passes."""
    t = args[0]
    if func is aten.nonzero.default:  # no flagged element
        return torch.empty((0, t.dim()), dtype=torch.long)
    if func is aten.equal.default:
        return True
    return False if t.dtype == torch.bool else 0


def passing_list(t: torch.Tensor):
    """What ``t.tolist()`` returns in a step where every check passes: False (bool) or 0 everywhere."""
    zero = False if t.dtype == torch.bool else 0.0 if t.is_floating_point() else 0

    def nest(shape):
        return [nest(shape[1:]) for _ in range(shape[0])] if shape else zero

    return nest(tuple(t.shape))


class ShapeTrace(TorchDispatchMode):
    """Runs operators for their shapes; records them while :attr:`recording` (see the module).
    ``Tensor.tolist`` is no operator (it reads the memory itself): while the mode is on it is
    answered as a host read too (:func:`passing_list`), not with whatever the memory held."""

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        tracer = self

        def tolist(t):
            if tracer.recording:
                tracer.trace.ops.append(Op("Tensor.tolist", 0.0, _bytes(t), 0, str(t.dtype).removeprefix("torch."),
                                           "memory", False, True, _dpzoo_source()))  # fmt: skip
            return passing_list(t)

        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        return super().__exit__(*exc)

    def __init__(self):
        super().__init__()
        self.recording = False
        self.trace = Trace()
        self._live: dict[int, tuple[StorageWeakRef, int, int]] = {}  # serial -> (storage, bytes, address)
        self._serial = itertools.count()
        self._live_bytes = 0

    def live_bytes(self) -> int:
        """Bytes of the tensors allocated under this mode that are still alive."""
        dead = [k for k, (ref, _, _) in self._live.items() if ref.expired()]
        for k in dead:
            self._live_bytes -= self._live.pop(k)[1]
        return self._live_bytes

    def track(self, tensors, fresh: bool = False) -> None:
        """Count ``tensors``' storages as live memory (``fresh``: just allocated; else, e.g. a batch
        made outside the mode, unless already counted)."""
        counted = set() if fresh else {addr for k, (ref, _, addr) in self._live.items() if not ref.expired()}
        for t in tensors:
            s = t.untyped_storage()
            if s.data_ptr() not in counted:
                self._live[next(self._serial)] = (StorageWeakRef(s), s.nbytes(), s.data_ptr())
                self._live_bytes += s.nbytes()
                counted.add(s.data_ptr())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS:
            self._record(func, args, kwargs, [], sync=True)
            return passing_answer(func, args)
        if func._overloadpacket in RELABELS:  # no kernel, no new memory: the real (free) operator
            self._record(func, args, kwargs, [], view=True)
            return func(*args, **kwargs)
        rets = func._schema.returns
        aliased = [r.alias_info is not None for r in rets]
        if rets and all(aliased) and not any(r.alias_info.is_write for r in rets):
            self._record(func, args, kwargs, [], view=True)
            return func(*args, **kwargs)  # a view: no kernel, no memory
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
        if any(aliased):  # in place or out=: the written argument is the result
            result = self._written(func, args, kwargs)
        elif not rets:  # in place on lists (the _foreach_ operators): what they write are their arguments
            self._record(func, args, kwargs, _mutated(func, args, kwargs), flops_out=out)
            return None
        else:
            result = tree_map(self._allocate, out)
        self._record(func, args, kwargs, _tensors(result), flops_out=out)
        return result

    def _written(self, func, args, kwargs):
        schema = func._schema
        names = [a.name for a in schema.arguments]
        found = []
        for r in schema.returns:
            i = next(
                i
                for i, a in enumerate(schema.arguments)
                if a.alias_info and a.alias_info.is_write and (r.alias_info.before_set == a.alias_info.before_set)
            )
            found.append(args[i] if i < len(args) else kwargs[names[i]])
        return found[0] if len(found) == 1 else tuple(found)

    def _allocate(self, x):
        if not isinstance(x, torch.Tensor):
            return x
        t = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
        self.track([t], fresh=True)
        return t

    def _record(self, func, args, kwargs, outputs, sync=False, flops_out=None, view=False) -> None:
        if not self.recording:
            return
        source = _dpzoo_source()
        if view:
            self.trace.ops.append(Op(str(func), 0.0, 0, 0, "", "memory", False, False, source))
            return
        inputs = _tensors((args, {k: v for k, v in kwargs.items() if k != "out"}))
        if func._overloadpacket in WRITE_ONLY:  # fills or copies into its destination without reading it
            inputs = [t for t in inputs if not any(t is o for o in outputs)]
        written = sum(_bytes(t) for t in outputs)
        read = sum(_bytes(t) for t in inputs)
        packet = FORMULA_OF.get(func._overloadpacket, func._overloadpacket)
        if packet in flop_registry and flops_out is not None:
            flops = _flops(packet, tree_map(_meta, args), tree_map(_meta, kwargs), flops_out)
        else:
            flops = float(max([t.numel() for t in inputs + outputs] or [0]))
        dtype = str((inputs or outputs or [torch.empty(0)])[0].dtype).removeprefix("torch.")
        kernel = not sync and func not in NO_KERNEL
        inner = _inner_extent(func, args, kwargs, outputs)
        self.trace.ops.append(
            Op(str(func), flops, read, written, dtype, _unit(func, inputs), kernel, sync, source, inner)
        )
        self.trace.peak_bytes = max(self.trace.peak_bytes, self.live_bytes())


def trace_step(
    config: str | dict, mode: str, precision: str = "fp32", warmup: int = 2, prepare=None, cpu_routes: bool = False
) -> Trace:
    """The operators of one training step of ``mode`` on ``config`` (a :mod:`bench_modes` config),
    after ``warmup`` untraced steps (the engine plans on its first). ``prepare(run, tracer)``, if
    given, runs once the runner is built (cost_predict.py's timed plans). ``cpu_routes``: take the
    routes dpzoo takes on a CPU only (a convolution's per-sample gradients by grouped convolution);
    off by default, as the traced step stands for a GPU's. Raises :class:`bench_modes.Unsupported`
    when the library refuses the combination."""
    from dpzoo.grad_norms.rules import conv

    before = conv.GROUPED_MIN_POSITIONS
    if not cpu_routes:
        conv.GROUPED_MIN_POSITIONS = float("inf")
    try:
        return _trace_step(config, mode, precision, warmup, prepare)
    finally:
        conv.GROUPED_MIN_POSITIONS = before


def _trace_step(config: str | dict, mode: str, precision: str, warmup: int, prepare) -> Trace:
    import torch.fx.experimental._config as fx_config

    from dpzoo.grad_norms import half

    tracer = ShapeTrace()
    devices, launching = set(half.TENSOR_CORE_DEVICES), set(half.LAUNCH_DEVICES)
    half.TENSOR_CORE_DEVICES.add("cpu")
    half.LAUNCH_DEVICES.add("cpu")
    # boolean-mask indexing needs a nonzero count: every element kept (the passing step's answer)
    with fx_config.patch(meta_nonzero_assume_all_nonzero=True), _seeded():
        try:
            with tracer:
                # foreach: the multi-tensor optimizer kernels torch uses on CUDA
                run = bench_modes.make_runner(config, mode, "cpu", precision, engine_kwargs=ENGINE, foreach=True)
            if prepare is not None:
                prepare(run, tracer)
            for i in range(warmup + 1):
                batch = run.next_batch()  # outside the mode: the Poisson sampler draws real indices
                tracer.track(_tensors(batch))
                tracer.recording = i == warmup
                if tracer.recording:
                    gc.collect()  # and none during the step: what is freed when is then the same every run
                    gc.disable()
                    tracer.trace.start_bytes = tracer.live_bytes()
                try:
                    with tracer, count_python_calls(tracer.trace) if tracer.recording else contextlib.nullcontext():
                        run.train_step(batch)
                finally:
                    gc.enable()
                tracer.recording = False
        finally:
            half.TENSOR_CORE_DEVICES.clear()
            half.TENSOR_CORE_DEVICES.update(devices)
            half.LAUNCH_DEVICES.clear()
            half.LAUNCH_DEVICES.update(launching)
    return tracer.trace


def _dpzoo_source() -> str:
    """``grad_norms/reps.py:_gram``: the innermost dpzoo function on the stack, or ""."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/dpzoo/" in path:
            return f"{path.rsplit('/dpzoo/', 1)[1]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return ""


@contextlib.contextmanager
def count_python_calls(trace: Trace):
    """Count the Python function calls of the step into ``trace``, not those of the tracer itself
    (its dispatch handler, and the rule lookups torch makes for any Python dispatch mode)."""
    dispatch = ShapeTrace.__torch_dispatch__.__code__
    inside = 0

    def profile(frame, event, arg):
        nonlocal inside
        if frame.f_code is dispatch:
            inside += 1 if event == "call" else -1 if event == "return" else 0
        elif event == "call" and not inside and not frame.f_code.co_filename.endswith(MODE_LOOKUPS):
            trace.python_calls += 1

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)


def _inner_extent(func, args, kwargs, outputs) -> int:
    """For a reduction over a tensor's innermost dimensions, each output's entries contiguous in
    memory (the rest of the tensor may be strided: a row slice), into more than one output: the
    entries each output reduces (a GPU reads short runs far below its bandwidth:
    :data:`gpu_model.SHORT_RUN_SHARE`); 0 for any other operator."""
    x = args[0] if args else None
    if func._overloadpacket not in REDUCTIONS or not isinstance(x, torch.Tensor) or not outputs:
        return 0
    if outputs[0].numel() <= 1 or x.dim() == 0:
        return 0
    names = [a.name for a in func._schema.arguments]
    i = names.index("dim") if "dim" in names else None
    dim = kwargs.get("dim", args[i] if i is not None and i < len(args) else None)
    if dim is None:
        return 0
    dims = sorted(d % x.dim() for d in ([dim] if isinstance(dim, int) else dim))
    if not dims or dims != list(range(x.dim() - len(dims), x.dim())):
        return 0
    run = 1  # the reduced dimensions must lie one after the other in memory
    for d in reversed(dims):
        if x.shape[d] != 1 and x.stride(d) != run:
            return 0
        run *= x.shape[d]
    return run if run > 1 else 0  # one entry per output: a copy, at the whole bandwidth


@contextlib.contextmanager
def _seeded():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


def summarize(trace: Trace) -> dict:
    """Totals of a trace: operators, kernels, host reads, FLOPs per unit, bytes, peak memory."""
    flops: dict[str, float] = collections.defaultdict(float)
    for op in trace.ops:
        if op.kernel:
            flops[op.unit] += op.flops
    return {
        "ops": len(trace.ops),
        "kernels": sum(op.kernel for op in trace.ops),
        "host_reads": sum(op.sync for op in trace.ops),
        "python_calls": trace.python_calls,
        "gflops": {u: f / 1e9 for u, f in sorted(flops.items())},
        "gbytes": sum(op.read + op.written for op in trace.ops if op.kernel) / 1e9,
        "peak_mb": trace.peak_bytes / 2**20,
    }


def _flops(packet, args, kwargs, out) -> float:
    """torch's formula for ``packet``, except that a grouped convolution's weight gradient is counted
    once per group, not once per group for every group: torch.utils.flop_counter contracts the whole
    input with every output channel (32x over for 32 groups: a per-sample convolution with the batch
    folded into the groups)."""
    formula = flop_registry[packet]
    if packet is not torch.ops.aten.convolution_backward or len(args) < 11 or args[9] == 1 or not args[10][1]:
        return float(formula(*args, **kwargs, out_val=out))
    groups, (grad_input, _, grad_bias) = args[9], args[10]
    rest = float(formula(*args[:10], [grad_input, False, grad_bias], *args[11:], **kwargs, out_val=out))
    weight = float(formula(*args[:10], [False, True, False], *args[11:], **kwargs, out_val=out))
    return rest + weight / groups
