"""A GPU's step time predicted from a traced step's operators (issue 30 item 2).

Per operator, a roofline: its FLOPs at the attainable rate of the unit it runs on (tensor cores in
bf16/fp16, with a half or a float32 result, or TF32; the float32 or float64 pipes) or its bytes
at the attainable memory bandwidth, whichever takes longer, plus a fixed time per kernel (launch
and tail). The host pays a fixed time per operator (dispatch, launch) and per Python call around them
(module calls, hooks, dpzoo's bookkeeping: counted in the trace) and runs ahead of the
device until it reads a device value (``.item()``, ``bool(t)``): the step is cut into segments
at those reads, each costing the longer of its host time and its device time, plus the read's
latency.

Peak rates and bandwidths are the data sheets' (dense, no sparsity). The attainable fractions of
the products come from the H100 GEMM probe (benchmarks/results/gpu_h100_1126/gemm_probe.json: a
ViT-B/16 weight gradient in bf16 ran at 55% of the bf16 peak, the same product with a float32
result at 21%, in float32 at 68% of the float32 peak). The five other constants (memory
efficiency, a kernel's fixed time, host time per operator and per Python call, a host read's
latency) are
calibrated on the H100 table of 2026-11-26 by :func:`calibrate`, which also reports the error of
each configuration predicted with constants fitted on the others (``cost_report.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np
from cost_trace import Trace

UNITS = ("memory", "tc_half", "tc_half_out32", "tc_tf32", "fp32", "fp64")


@dataclass(frozen=True)
class Device:
    """A GPU's peak rates (per second), attainable fractions and fixed costs (seconds)."""

    name: str
    peak_flops: dict  # unit -> FLOP/s, data sheet, dense
    bandwidth: float  # bytes/s of HBM, data sheet
    unit_efficiency: dict  # unit -> attainable fraction of its peak (gemm_probe)
    memory_efficiency: float = 0.6  # attainable fraction of the bandwidth
    kernel_s: float = 3e-6  # fixed device time per kernel (launch and tail)
    host_op_s: float = 10e-6  # host time per operator (dispatch, launch)
    host_call_s: float = 1e-6  # host time per Python function call around the operators
    host_read_s: float = 30e-6  # a host read: drain the queue, copy back, resume

    def rate(self, unit: str) -> float:
        return self.peak_flops[unit] * self.unit_efficiency[unit]


_HOPPER_PEAK = {"tc_half": 989e12, "tc_half_out32": 989e12, "tc_tf32": 494e12, "fp32": 67e12, "fp64": 67e12}
_HOPPER_EFFICIENCY = {"tc_half": 0.55, "tc_half_out32": 0.21, "tc_tf32": 0.5, "fp32": 0.68, "fp64": 0.68}
DEVICES = {
    "h100": Device("NVIDIA H100 80GB HBM3 (SXM5)", _HOPPER_PEAK, 3.35e12, _HOPPER_EFFICIENCY),
    "h200": Device("NVIDIA H200 (SXM)", _HOPPER_PEAK, 4.8e12, _HOPPER_EFFICIENCY),
}


# the share of the attainable bandwidth a reduction reaches when each output reduces k contiguous
# entries, measured on an H200 (benchmarks/results/gpu_h200_1128/dense_runs/dense_norm_runs.json:
# a (32, 768·3072) float32 tensor's run norms, each run length's TB/s over the best); below 32 as 32
# (not measured), from 2,048 on the whole
SHORT_RUN_SHARE = {32: 0.18, 64: 0.32, 128: 0.58, 256: 0.82, 512: 0.86, 1024: 0.95, 2048: 1.0}


def run_share(inner: np.ndarray) -> np.ndarray:
    """:data:`SHORT_RUN_SHARE` of each operator's inner extent, interpolated in log2; 1 for 0."""
    ks = np.log2(list(SHORT_RUN_SHARE))
    shares = np.interp(np.log2(np.maximum(inner, 1)), ks, list(SHORT_RUN_SHARE.values()))
    return np.where(inner > 0, shares, 1.0)


@dataclass
class Arrays:
    """A trace as arrays: what :func:`predict` needs, computed once per trace."""

    flops: np.ndarray
    nbytes: np.ndarray
    unit: np.ndarray  # index into UNITS
    kernel: np.ndarray  # bool
    share: np.ndarray  # of the attainable bandwidth (short-run reductions below 1)
    segment: np.ndarray  # index of the host read that ends the operator's segment
    reads: int
    python_calls: int


def arrays(trace: Trace, dense_runs: int | None = None) -> Arrays:
    """``dense_runs``: price the float32 dense norms' run norms (``rounding._runs_sq``) as runs of
    that many entries, for a table measured before the GPU's run length changed: the same bytes;
    not quite the same operators (a gradient whose width is a multiple of 32 but not of 1,024, e.g.
    GPT-2's 50,257 × 768 embedding, has one remainder norm more today, priced as it is), and a
    gradient of exactly 2²⁰ entries has its second-stage norm repriced too."""
    ops = trace.ops
    sync = np.array([op.sync for op in ops], dtype=bool)
    inner = np.array([op.inner for op in ops], dtype=float)
    if dense_runs is not None:
        from dpzoo.grad_norms.rounding import LAUNCH_DENSE_CHUNK

        runs = np.array([op.source.endswith("rounding.py:_runs_sq") for op in ops], dtype=bool)
        inner = np.where(runs & (inner == LAUNCH_DENSE_CHUNK), dense_runs, inner)
    return Arrays(
        flops=np.array([op.flops for op in ops], dtype=float),
        nbytes=np.array([op.read + op.written for op in ops], dtype=float),
        unit=np.array([UNITS.index(op.unit) for op in ops], dtype=int),
        kernel=np.array([op.kernel for op in ops], dtype=bool),
        share=run_share(inner),
        segment=np.concatenate([[0], np.cumsum(sync)[:-1]]).astype(int) if ops else np.zeros(0, int),
        reads=int(sync.sum()),
        python_calls=trace.python_calls,
    )


def kernel_seconds(a: Arrays, device: Device) -> np.ndarray:
    """Each operator's device time: its roofline plus the kernel's fixed time (0 for no kernel)."""
    rates = np.array([np.inf] + [device.rate(u) for u in UNITS[1:]])
    compute = a.flops / rates[a.unit]
    memory = a.nbytes / (device.bandwidth * device.memory_efficiency * a.share)
    return np.where(a.kernel, np.maximum(compute, memory) + device.kernel_s, 0.0)


def predict(trace: Trace | Arrays, device: Device) -> dict:
    """Predicted step time (ms), and its parts: device time, host time, whether the host bounds it."""
    a = trace if isinstance(trace, Arrays) else arrays(trace)
    dev = kernel_seconds(a, device)
    segments = a.reads + 1
    seg_dev = np.bincount(a.segment, weights=dev, minlength=segments)
    # the Python calls spread over the segments as the operators are
    per_op = device.host_op_s + device.host_call_s * a.python_calls / max(len(a.flops), 1)
    seg_host = np.bincount(a.segment, minlength=segments) * per_op
    total = np.maximum(seg_dev, seg_host).sum() + a.reads * device.host_read_s
    return {
        "ms": total * 1e3,
        "device_ms": dev.sum() * 1e3,
        "host_ms": seg_host.sum() * 1e3,
        "bound": "host" if seg_host.sum() > dev.sum() else "device",
    }


GRID = {
    "memory_efficiency": (0.3, 0.45, 0.6, 0.75, 0.9),
    "kernel_s": (1e-6, 2e-6, 4e-6, 6e-6),
    "host_op_s": (4e-6, 6e-6, 8e-6, 10e-6, 12e-6),
    "host_call_s": (0.0, 0.5e-6, 1e-6, 1.5e-6, 2e-6, 3e-6),
    "host_read_s": (20e-6, 50e-6, 100e-6, 200e-6),
}


def ratio_errors(cells: list, device: Device) -> list[float]:
    """Relative errors of the predicted DP/non-private ratios; ``cells`` are (arrays of the
    mode, arrays of its baseline, measured ratio)."""
    return [(predict(m, device)["ms"] / predict(b, device)["ms"]) / ratio - 1 for m, b, ratio in cells]


def _score(errors: list[float]) -> tuple:
    return (sum(abs(e) > 0.2 for e in errors), float(np.median(np.abs(errors))) if errors else 0.0)


def calibrate(cells: dict, device: Device) -> tuple[Device, dict]:
    """The grid's constants that put most ratios within 20% (then the smallest median error), fitted
    on all configurations; and, per configuration, its errors with constants fitted on the others
    (leave one configuration out). ``cells``: configuration -> list as for :func:`ratio_errors`."""

    def fit(groups) -> Device:
        flat = [c for g in groups for c in cells[g]]
        best = None
        for values in itertools.product(*GRID.values()):
            d = dataclasses.replace(device, **dict(zip(GRID, values)))
            score = _score(ratio_errors(flat, d))
            if best is None or score < best[0]:
                best = (score, d)
        return best[1]

    held_out = {g: ratio_errors(cells[g], fit([h for h in cells if h != g])) for g in cells}
    return fit(list(cells)), held_out


def by_source(trace: Trace, device: Device, top: int = 8) -> list[dict]:
    """The dpzoo functions whose operators cost most device time on ``device`` (``""``: the
    model's own and torch's operators), with their operator and host-read counts."""
    dev = kernel_seconds(arrays(trace), device)
    rows: dict = {}
    for op, t in zip(trace.ops, dev):
        r = rows.setdefault(op.source or "(model, loss, optimizer)", {"device_ms": 0.0, "ops": 0, "host_reads": 0})
        r["device_ms"] += t * 1e3
        r["ops"] += 1
        r["host_reads"] += op.sync
    ranked = sorted(rows.items(), key=lambda kv: -kv[1]["device_ms"])[:top]
    return [{"source": k, **v} for k, v in ranked]
