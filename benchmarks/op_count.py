"""How many operators a training step launches, and how many of them make the host wait for the
device: the part of a GPU step's cost that a CPU can count exactly.

On a GPU, a step of many small kernels costs the host's time per operator (Python, dispatch,
launch), and an operator that reads a device value on the host (``.item()``, ``bool(t)``,
``.any()`` in an ``if``, ``nonzero``) stops the host from running ahead of the device. An H100
measured dpzoo's GPT-2 small step at the same time in fp32 and bf16 while the non-private step
halved (docs/RESULTS.md): what DP added there was not arithmetic. This script counts, for one step
of each mode after two warm-up steps, every ATen operator (a ``TorchDispatchMode``) and the ones
that synchronise (``_local_scalar_dense``, ``nonzero``, ``is_nonzero``). The counts are the same
on any machine; they depend on the layer structure and, through the planner and the Gram chunks,
on the sizes, so compare modes within one configuration.

    python benchmarks/op_count.py --out benchmarks/results/op_count
    python benchmarks/op_count.py --configs gpt2-small-12x64 --modes nonprivate-full dpzoo-bk-mixopt

Writes ``op_count.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_modes  # noqa: E402

# GPT-2 small's and ViT-B/16's layer structure at a width a CPU steps through in a second
CONFIGS = {
    "gpt2-small-12x64": dict(kind="lm", vocab=512, layers=12, width=64, heads=2, tied=True, batch=4, seq=32),
    "resnet18-gn-bias@32": bench_modes.ALL_CONFIGS["resnet18-gn-bias@32"],
}
MODES = ["nonprivate-full", "nonprivate-bias", "dpzoo-bk-mixopt", "dpzoo-instantiate", "dpzoo-bitfit"]
SYNCS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default"}


def count_step(config: dict, mode: str, precision: str) -> dict:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    runner = bench_modes.make_runner(config, mode, "cpu", precision)
    runner.step()
    runner.step()
    with Count() as counted:
        runner.step()
    ops = counted.ops
    return {
        "ops": sum(ops.values()),
        "syncs": sum(n for op, n in ops.items() if op in SYNCS),
        "top": dict(ops.most_common(15)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS), help="default: all")
    parser.add_argument("--modes", nargs="+", default=MODES, help="default: " + " ".join(MODES))
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="default: fp32")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for op_count.json (default: .)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    result: dict = {"precision": args.precision, "configs": {}}
    for name in args.configs:
        rows = result["configs"][name] = {"config": CONFIGS[name], "modes": {}}
        for mode in args.modes:
            rows["modes"][mode] = row = count_step(CONFIGS[name], mode, args.precision)
            base = rows["modes"].get("nonprivate-full")
            ratio = f" ({row['ops'] / base['ops']:.1f}x non-private)" if base else ""
            print(f"{name} {mode}: {row['ops']} ops{ratio}, {row['syncs']} host syncs", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "op_count.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
