"""How fast and how exact the ways are to form a per-sample norm's products from bf16 values on a
GPU: the Gram matrices of a ghost norm and an instantiated per-sample weight gradient, at the
shapes of ViT-B/16 and GPT-2 small's linear layers.

Ghost norms (‖g‖² = Σ_{t,s}⟨a_t,a_s⟩⟨g_t,g_s⟩): float32 products in chunks of 256 features
(dpzoo's ``reps._gram``) at "highest" and at TF32 precision, the same after an upcast copy, and
bf16 operands with float32 output (``out_dtype``), whole and chunked. Instantiation (Σ_t g_t a_tᵀ
per sample): float32, TF32, bf16 with float32 output, plain bf16. For each: the median time of 20
runs (CUDA events) and the largest relative error of the squared norms against float64. Also the
upcast copies and the non-private bf16 weight gradient of the same layer, for scale.

    python benchmarks/gemm_probe.py --out benchmarks/results/gpu_h100_1126

Needs CUDA (``out_dtype`` matmuls exist only there). Writes ``gemm_probe.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

SHAPES = {  # name: (batch, positions, in features, out features)
    "vit-qkv": (64, 197, 768, 2304),
    "vit-fc1": (64, 197, 768, 3072),
    "vit-fc2": (64, 197, 3072, 768),
    "gpt2-t128-fc1": (32, 128, 768, 3072),
    "gpt2-t512-fc1": (32, 512, 768, 3072),
}


def median_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def gram_chunked(a, precision: str, chunk: int = 256):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        out = a[..., :chunk] @ a[..., :chunk].transpose(-1, -2)
        for i in range(chunk, a.shape[-1], chunk):
            out = out.add_(a[..., i : i + chunk] @ a[..., i : i + chunk].transpose(-1, -2))
        return out
    finally:
        torch.set_float32_matmul_precision(before)


def gram_half(a, chunk: int | None = None):
    """bf16 operands, float32 accumulation and output."""
    if chunk is None:
        return torch.bmm(a, a.transpose(-1, -2), out_dtype=torch.float32)
    parts = [a[..., i : i + chunk] for i in range(0, a.shape[-1], chunk)]
    return torch.stack([torch.bmm(p, p.transpose(-1, -2), out_dtype=torch.float32) for p in parts]).sum(0)


def instantiate(g, a, precision: str):
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        return torch.bmm(g.transpose(1, 2), a)
    finally:
        torch.set_float32_matmul_precision(before)


def probe(batch: int, positions: int, d_in: int, d_out: int) -> dict:
    a16 = torch.randn(batch, positions, d_in, device="cuda").bfloat16()
    g16 = (torch.randn(batch, positions, d_out, device="cuda") * 1e-3).bfloat16()
    a32, g32 = a16.float(), g16.float()
    a64, g64 = a32.double(), g32.double()
    ghost_ref = ((a64 @ a64.transpose(1, 2)) * (g64 @ g64.transpose(1, 2))).sum((1, 2))
    inst_ref = (g64.transpose(1, 2) @ a64).square().sum((1, 2))
    ghost = {
        "fp32_highest_chunked": lambda: gram_chunked(a32, "highest") * gram_chunked(g32, "highest"),
        "tf32_chunked": lambda: gram_chunked(a32, "high") * gram_chunked(g32, "high"),
        "upcast_plus_tf32": lambda: gram_chunked(a16.float(), "high") * gram_chunked(g16.float(), "high"),
        "bf16_out_f32": lambda: gram_half(a16) * gram_half(g16),
        "bf16_out_f32_chunked": lambda: gram_half(a16, 256) * gram_half(g16, 256),
    }
    inst = {
        "fp32_highest": lambda: instantiate(g32, a32, "highest"),
        "tf32": lambda: instantiate(g32, a32, "high"),
        "bf16_out_f32": lambda: torch.bmm(g16.transpose(1, 2), a16, out_dtype=torch.float32),
        "bf16_plain": lambda: torch.bmm(g16.transpose(1, 2), a16),
    }
    row = {"B": batch, "T": positions, "din": d_in, "dout": d_out}
    for name, fn in ghost.items():
        err = ((fn().double().sum((1, 2)) - ghost_ref).abs() / ghost_ref).max().item()
        row["ghost_" + name] = {"ms": median_ms(fn), "max_rel_err": err}
    for name, fn in inst.items():
        err = ((fn().double().square().sum((1, 2)) - inst_ref).abs() / inst_ref).max().item()
        row["inst_" + name] = {"ms": median_ms(fn), "max_rel_err": err}
    row["upcast_copy_ms"] = median_ms(lambda: (a16.float(), g16.float()))
    row["nonprivate_weight_grad_bf16_ms"] = median_ms(lambda: g16.reshape(-1, d_out).t() @ a16.reshape(-1, d_in))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for gemm_probe.json (default: .)")
    args = parser.parse_args()
    torch.manual_seed(0)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    for name, shape in SHAPES.items():
        result["cases"].append({"case": name, **probe(*shape)})
        print(json.dumps(result["cases"][-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemm_probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
