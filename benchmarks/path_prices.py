"""Each path of one use of a layer shape, priced on a GPU by the cost model, without a GPU: the
ghost norm, instantiation held until the clip factors are known, and instantiation formed for the
norm and freed (:mod:`dpzoo.grad_norms.formed`), each as the timed planner runs it
(:func:`dpzoo.grad_norms.cost.run_paths`, ``--stack`` uses of the shape at once).

    python benchmarks/path_prices.py --batch 32 --seq 128 --out path_prices.json

Traces the operators on meta tensors (:mod:`cost_trace`) and prices them with the constants
``cost_report.py`` last calibrated (``benchmarks/results/cost/cost_report.json``). Predictions of
the model, never measurements: per use, its milliseconds (device and host), operators and Python calls.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cost_trace  # noqa: E402
import gpu_model  # noqa: E402
import torch  # noqa: E402

REPORT = Path(__file__).resolve().parent / "results" / "cost" / "cost_report.json"
# GPT-2 small's linear layers: (inputs, outputs)
SHAPES = {"c_attn": (768, 2304), "c_proj (attention)": (768, 768), "c_fc": (768, 3072), "c_proj (MLP)": (3072, 768)}
PATHS = {"ghost": (True, False), "held": (False, False), "freed": (False, True)}


def price(p: int, d: int, batch: int, seq: int, stack: int, device: gpu_model.Device, dtype=torch.bfloat16) -> dict:
    """{path: its model milliseconds and counts per use} of a Linear(p, d) use of ``batch`` samples of ``seq`` positions."""
    from dpzoo.grad_norms import cost
    from dpzoo.grad_norms import reps as R

    out = {}
    for name, (ghost, freed) in PATHS.items():
        tracer = cost_trace.ShapeTrace()
        with tracer:
            rep = R.Factored(
                torch.randn(batch, 1, seq, d, dtype=dtype), torch.randn(batch, 1, seq, p, dtype=dtype), (d, p)
            )
            scale = torch.ones(batch)
            tracer.trace, tracer.recording = cost_trace.Trace(), True
            with cost_trace.count_python_calls(tracer.trace):
                cost.run_paths(rep, ghost, stack, scale, freed)
        model = gpu_model.predict(gpu_model.arrays(tracer.trace), device)
        out[name] = {
            "ms": model["ms"] / stack,
            "device_ms": model["device_ms"] / stack,
            "host_ms": model["host_ms"] / stack,
            "ops": len(tracer.trace.ops) / stack,
            "python_calls": tracer.trace.python_calls / stack,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--stack", type=int, default=12, help="uses of one shape at once (GPT-2 small: 12 blocks)")
    parser.add_argument("--device", default="h200", choices=list(gpu_model.DEVICES))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from dpzoo.grad_norms import half

    constants = json.loads(REPORT.read_text())["validation"]["constants"]
    device = dataclasses.replace(gpu_model.DEVICES[args.device], **constants)
    half.TENSOR_CORE_DEVICES.add("cpu")  # trace on the CPU the operators CUDA runs
    half.LAUNCH_DEVICES.add("cpu")
    prices = {name: price(p, d, args.batch, args.seq, args.stack, device) for name, (p, d) in SHAPES.items()}
    result = {
        "command": "python benchmarks/path_prices.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "what": "predicted by the cost model per use, bf16 factors; not measured",
        "device": args.device,
        "batch": args.batch,
        "seq": args.seq,
        "stack": args.stack,
        "prices": prices,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for name, paths in prices.items():
        print(f"{name:20s}", "  ".join(f"{k} {v['ms']:.3f} ms ({v['ops']:.0f} ops)" for k, v in paths.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
