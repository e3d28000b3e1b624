"""The one-run audit (``dpzoo.audit``) over seeds and claimed ε, for dpzoo's engine and the two
positive controls; one JSON per claimed ε, the evidence of docs/RESULTS.md's audit tables.

    python benchmarks/audit_sweep.py --epsilon 2 --seeds 0 1 2 3 4 5 6 7 8 9 --out benchmarks/results/audit
    python benchmarks/audit_sweep.py --epsilon 4 --seeds 0 1 2 --out benchmarks/results/audit
    python benchmarks/audit_sweep.py --threat-model white-box --epsilon 2 --seeds 0 1 2 3 4
    python benchmarks/audit_sweep.py --threat-model white-box --epsilon 2 --seeds 0 1 2 3 4 --canaries 1000
    python benchmarks/audit_sweep.py --threat-model white-box --full-batch --epsilon 2 --canaries 50000 --seeds 0 1 2 3 4
    python benchmarks/audit_sweep.py --threat-model white-box --epsilon 2 --seeds 0 1 2 3 4 \
        --mechanisms noise-skipped-per-epoch group-outside-engine unclipped

With ``--mechanisms`` the rows of the other mechanisms already in the file are kept (their
commands stay listed in the file's ``meta.commands``).

Each (mechanism, seed) is one ``dpzoo.audit(epsilon=E, seed=S, broken=B)`` with the built-in
defaults (digits + 1,000 Dirac canaries, 2,500 in the white-box audit, 10 epochs, Abadi clipping at R = 1); the engine's noise
and sampling are secret, so a rerun gives other bounds for the engine's rows.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

import dpzoo

MECHANISMS = {  # None: dpzoo's engine as is
    "black-box": (None, "no-noise", "unclipped"),
    "white-box": (
        None,
        "no-noise",
        "sensitivity-2x",
        "sensitivity-1.5x",
        "half-noise",
        "noise-skipped-per-epoch",
        "group-outside-engine",
        "unclipped",
    ),
}


def run(epsilon: float, seeds: list[int], threat_model: str, canaries: int, mechanisms, batch_size) -> list[dict]:
    rows = []
    for seed in seeds:
        for broken in mechanisms:
            result = dpzoo.audit(
                epsilon=epsilon,
                seed=seed,
                broken=broken,
                threat_model=threat_model,
                canaries=canaries,
                batch_size=batch_size,
            )
            row = result.to_dict(scores=False) | {"seed": seed}
            rows.append(row)
            print(f"ε = {epsilon} seed {seed} {broken or 'engine'}: bound {result.epsilon_lower_bound:.3f}", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epsilon", type=float, default=2.0)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--out", default="benchmarks/results/audit")
    p.add_argument("--threat-model", choices=list(MECHANISMS), default="black-box")
    p.add_argument("--canaries", type=int, default=None, help="default: the audit's (1000; 2500 white-box)")
    p.add_argument("--mechanisms", nargs="+", default=None, help="engine and/or control names (default: all)")
    p.add_argument("--full-batch", action="store_true", help="every step trains on the whole set (q = 1)")
    args = p.parse_args(argv)
    mechanisms = MECHANISMS[args.threat_model]
    if args.mechanisms:
        mechanisms = tuple(None if m == "engine" else m for m in args.mechanisms)
    batch_size = "full" if args.full_batch else 64
    rows = run(args.epsilon, args.seeds, args.threat_model, args.canaries, mechanisms, batch_size)
    meta = {
        "command": "python benchmarks/audit_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "dpzoo": dpzoo.__version__,
        "platform": platform.platform(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "audit" if args.threat_model == "black-box" else "white_box"
    suffix = ("" if args.canaries is None else f"_m{args.canaries}") + ("_full" if args.full_batch else "")
    path = out / f"{name}_eps{args.epsilon:g}{suffix}.json"
    if args.mechanisms and path.exists():  # a subset: keep the other mechanisms' rows
        old = json.loads(path.read_text())
        rows = [r for r in old["runs"] if r["broken"] not in mechanisms] + rows
        meta["commands"] = old["meta"].get("commands", [old["meta"]["command"]]) + [meta["command"]]
    path.write_text(json.dumps({"meta": meta, "runs": rows}, indent=1) + "\n")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
