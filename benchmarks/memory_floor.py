"""The memory a one-backward DP step holds for its clip: every layer's output gradient, kept
from the backward pass until the clip factors (which need every layer's norm) are known, beside
the layer inputs. Traced on meta tensors at the GPU configs' real sizes (cost_trace.py: exact,
the same on any machine).

    python benchmarks/memory_floor.py --configs gpt2-small-t128 gpt2-small-t512 --precision bf16

Per config: the non-private step's peak of live memory, the DP step's with every use on the ghost
path (dpzoo-bk: the leanest plan, no per-sample gradient held), and what that step holds when
assembly starts (the output gradients and the stored inputs, each storage once), with the output
gradients' share of the non-private peak. Book-keeping (one backward) holds them by design; only
recomputing them (a second backward, as two-pass ghost clipping does) or a smaller batch frees
them. Not a bound: the DP step also holds things the non-private step does not, and the reverse
(no weight gradients during its backward). Writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cost_trace  # noqa: E402

from dpzoo.grad_norms import hooks  # noqa: E402

MB = 2.0**20


def _held(step) -> dict[str, int]:
    """Bytes of the output gradients and of the stored inputs ``step``'s uses hold (each storage once)."""
    seen: set[int] = set()
    out = {"output_grads": 0, "stored_inputs": 0}
    for use in step.uses:
        for key, tensors in (("output_grads", (use.grad,)), ("stored_inputs", use.activations or ())):
            for t in tensors:
                if not hasattr(t, "untyped_storage"):
                    continue
                storage = t.untyped_storage()
                if id(storage) not in seen:
                    seen.add(id(storage))
                    out[key] += storage.nbytes()
    return out


def traced_with_held(config: str | dict, mode: str, precision: str) -> tuple:
    """(the traced step of ``mode``, what its last assembly found held: :func:`_held`)."""
    found: dict[str, int] = {}
    inner = hooks.assemble

    def assemble(step, *args, **kwargs):
        found.update(_held(step))
        return inner(step, *args, **kwargs)

    hooks.assemble = assemble
    try:
        trace = cost_trace.trace_step(config, mode, precision)
    finally:
        hooks.assemble = inner
    return trace, found


def floor(config: str | dict, precision: str) -> dict:
    plain = cost_trace.trace_step(config, "nonprivate-full", precision)
    ghost, held = traced_with_held(config, "dpzoo-bk", precision)
    base = plain.peak_bytes
    return {
        "config": config, "precision": precision,
        "nonprivate_peak_mb": base / MB,
        "dp_all_ghost_peak_mb": ghost.peak_bytes / MB,
        "output_grads_mb": held["output_grads"] / MB,
        "stored_inputs_mb": held["stored_inputs"] / MB,
        "dp_all_ghost_ratio": ghost.peak_bytes / base,
        "output_grads_share": held["output_grads"] / base,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=["gpt2-small-t128", "gpt2-small-t512", "vit-base-patch16@224"])
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rows = []
    for config in args.configs:
        row = floor(config, args.precision)
        rows.append(row)
        print(f"{config} {args.precision}: non-private peak {row['nonprivate_peak_mb']:.0f} MB; every use ghost "
              f"{row['dp_all_ghost_peak_mb']:.0f} MB ({row['dp_all_ghost_ratio']:.2f}x), of it output gradients "
              f"{row['output_grads_mb']:.0f} MB held for the clip ({row['output_grads_share']:.2f}x "
              "of the non-private peak)")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": "python benchmarks/memory_floor.py " + " ".join(argv or sys.argv[1:]),
                                        "counts": "deterministic: traced on meta tensors (cost_trace.py)",
                                        "rows": rows}, indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
