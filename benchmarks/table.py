"""Print the markdown table of a training_step.json (the README's benchmark table).

python benchmarks/table.py benchmarks/results/training_step.json
"""

import json
import sys

MODES = ["nonprivate-full", "nonprivate-bias", "dpzoo-bk-mixopt", "dpzoo-bitfit", "opacus-hooks", "opacus-ghost"]


def main(path: str) -> None:
    data = json.load(open(path))
    results = data["results"]
    configs = list(dict.fromkeys(r["config"] for r in results))
    print("| config | " + " | ".join(MODES) + " |")
    print("| --- | " + " | ".join("---" for _ in MODES) + " |")
    for c in configs:
        cells = []
        for m in MODES:
            r = next((r for r in results if r["config"] == c and r["mode"] == m), None)
            if r is None:
                cells.append("")
            elif "error" in r:
                cells.append("unsupported")
            else:
                cells.append(f"{r['time_ratio']:.2f}× / {r['memory_ratio']:.2f}×")
        print(f"| {c} | " + " | ".join(cells) + " |")
    base = {r["config"]: r["step_s"] for r in results if r["mode"] == "nonprivate-full" and "step_s" in r}
    print()
    print("Non-private full step (s): " + ", ".join(f"{c} {s:.3f}" for c, s in base.items()))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/training_step.json")
