"""How fast a device forms the float32 dense norm of per-sample gradients by run length (issue 30).

``dpzoo.grad_norms.rounding`` bounds a float32 per-sample norm by taking it over runs of k entries
(rounding bound γ_{k+8}) whose squares are summed in float64. This times, on one (B, n) float32
tensor at an instantiated layer's size (GPT-2 small's MLP: B = 32, n = 768·3072), the two
reductions for each k, and a plain whole-row norm, as CUDA-event medians; the JSON says the read
bandwidth each reached. Not a test: timings depend on the machine.

    python benchmarks/dense_norm_runs.py --out benchmarks/results/dense_norm_runs.json
"""

from __future__ import annotations

import argparse
import json

import torch
from gemm_probe import median_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--width", type=int, default=768 * 3072)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="dense_norm_runs.json")
    args = ap.parse_args()
    flat = torch.randn(args.batch, args.width, device="cuda")
    gb = flat.numel() * 4 / 1e9
    rows = []
    for k in (32, 64, 128, 256, 512, 1024, 2048, 4096, 16384, args.width):
        runs = flat.view(args.batch, args.width // k, k)

        def two_stage(runs=runs):
            return torch.linalg.vector_norm(torch.linalg.vector_norm(runs, dim=-1), dim=-1, dtype=torch.float64)

        ms = median_ms(two_stage, args.reps)
        rows.append({"k": k, "ms": ms, "read_TB_per_s": gb / ms})
        print(f"k={k:>8}  {ms:.3f} ms  {gb / ms:.2f} TB/s", flush=True)
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "shape": list(flat.shape), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
