"""Time and memory of one training step: non-private vs dpzoo vs Opacus, as ratios.

Each (model, mode) runs in its own process (so peak memory is its own): the median of
``--steps`` steps after ``--warmup`` steps, and the process's peak RSS. Results are written
as JSON and a PNG, each mode reported as a ratio to non-private full training of the same
model in the same run. Not a test: timings depend on the machine.

    python benchmarks/bench_training_step.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

MODES = ["nonprivate-full", "nonprivate-bias", "dpzoo-bk-mixopt", "dpzoo-bitfit", "opacus-hooks", "opacus-ghost"]
CONFIGS = {
    "resnet18-gn-bias@32": dict(kind="image", name="resnet18-gn-bias", size=32, batch=32),
    "resnet18-gn-bias@128": dict(kind="image", name="resnet18-gn-bias", size=128, batch=32),
    "gpt2-4x256-v1024-tied": dict(kind="lm", tied=True, batch=16, seq=128),
    "gpt2-4x256-v1024-untied": dict(kind="lm", tied=False, batch=16, seq=128),
    # MovieLens-1M sized next-item models (3,416 items, d = 64, 2 blocks), the DPFormer setting
    "transformer-seqrec-ml1m": dict(kind="seqrec", name="transformer-seqrec", batch=128, seq=50, items=3416),
    "dpformer-ml1m": dict(kind="seqrec", name="dpformer", batch=128, seq=50, items=3416),
}


def _build(cfg):
    import torch

    import dpzoo

    torch.manual_seed(0)
    if cfg["kind"] == "image":
        model = dpzoo.load(cfg["name"], num_classes=10)
        x = torch.randn(cfg["batch"], 3, cfg["size"], cfg["size"])
        y = torch.randint(0, 10, (cfg["batch"],))
        crit = torch.nn.CrossEntropyLoss()
        fwd = lambda m, x: m(x)  # noqa: E731
    elif cfg["kind"] == "seqrec":
        from dpzoo.losses import SequenceCrossEntropy

        model = dpzoo.load(cfg["name"], num_items=cfg["items"], max_len=cfg["seq"])
        x = torch.randint(1, cfg["items"] + 1, (cfg["batch"], cfg["seq"]))
        y = torch.randint(1, cfg["items"] + 1, (cfg["batch"], cfg["seq"]))
        if hasattr(model, "set_token_frequencies"):  # Re-Attention active in every mode, as in training
            model.set_token_frequencies(x)
            model.set_dp_noise(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=cfg["batch"])
        crit = SequenceCrossEntropy(ignore_index=0)
        fwd = lambda m, x: m(x)  # noqa: E731
    else:
        from dpzoo.losses import SequenceCrossEntropy

        model = dpzoo.load(
            "gpt2",
            vocab_size=1024,
            num_layers=4,
            width=256,
            num_heads=4,
            max_positions=cfg["seq"],
            tie_word_embeddings=cfg["tied"],
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        x = torch.randint(0, 1024, (cfg["batch"], cfg["seq"]))
        y = x.clone()
        crit = SequenceCrossEntropy(shift=True)
        fwd = lambda m, x: m(input_ids=x).logits  # noqa: E731
    return model.train(), x, y, crit, fwd


def worker(config: str, mode: str, warmup: int, steps: int) -> dict:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import dpzoo

    warnings.filterwarnings("ignore")
    torch.set_num_threads(os.cpu_count() or 1)
    cfg = CONFIGS[config]
    model, x, y, crit, fwd = _build(cfg)
    if mode in ("nonprivate-bias",):
        for n, p in model.named_parameters():
            p.requires_grad_(n.endswith("bias"))
    opt = torch.optim.SGD([p for p in model.parameters()], lr=1e-4)
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    if mode.startswith("dpzoo"):
        engine = dpzoo.PrivacyEngine()
        # batch_size = N: q = 1, so every Poisson batch is the whole (fixed) batch, as for the others
        model, opt, loader = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            mode="bitfit" if mode == "dpzoo-bitfit" else "bk-mixopt",
            train_head=None,
        )
    elif mode.startswith("opacus"):
        from opacus import PrivacyEngine

        from dpzoo.engines.opacus import make_private

        try:
            out = make_private(
                PrivacyEngine(),
                module=model,
                optimizer=opt,
                data_loader=loader,
                noise_multiplier=1.0,
                max_grad_norm=1.0,
                poisson_sampling=False,
                criterion=crit,
                grad_sample_mode="ghost" if mode == "opacus-ghost" else "hooks",
            )
        except dpzoo.UnsupportedModuleError as e:
            return {"config": config, "mode": mode, "error": str(e).split(":")[0]}
        if mode == "opacus-ghost":
            model, opt, crit, loader = out
        else:
            model, opt, loader = out
    times = []
    for i in range(warmup + steps):
        if mode.startswith("dpzoo"):  # the engine steps only on batches from its loader
            x, y = next(iter(loader))
        t = time.perf_counter()
        loss = crit(fwd(model, x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return {
        "config": config,
        "mode": mode,
        "step_s": statistics.median(times),
        "steps": steps,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in results))
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(MODES)
    for j, mode in enumerate(MODES):
        for ax, key in zip(axes, ("time_ratio", "memory_ratio")):
            vals = [
                next(
                    (r.get(key, float("nan")) for r in results if r["config"] == c and r["mode"] == mode), float("nan")
                )
                for c in configs
            ]
            ax.bar([i + j * width for i in range(len(configs))], vals, width, label=mode)
    for ax, title in zip(axes, ("step time / non-private full", "peak RSS / non-private full")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(configs))])
        ax.set_xticklabels(configs, rotation=15, fontsize=8)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_title(title)
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--modes", nargs="*", default=MODES)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--worker", nargs=2, metavar=("CONFIG", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(*args.worker, args.warmup, args.steps)))
        return 0
    results = []
    for config in args.configs:
        for mode in args.modes:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                config,
                mode,
                "--warmup",
                str(args.warmup),
                "--steps",
                str(args.steps),
            ]
            t = time.time()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                res = {"config": config, "mode": mode, "error": proc.stderr.strip().splitlines()[-1][:300]}
            else:
                res = json.loads(proc.stdout.strip().splitlines()[-1])
            print(
                f"{config:<26} {mode:<16} {res.get('step_s', float('nan')):8.3f} s  "
                f"{res.get('peak_rss_mb', float('nan')):8.0f} MB  {res.get('error', '')}  ({time.time() - t:.0f}s)",
                flush=True,
            )
            results.append(res)
    for r in results:
        base = next(
            (b for b in results if b["config"] == r["config"] and b["mode"] == "nonprivate-full" and "step_s" in b),
            None,
        )
        if base and "step_s" in r:
            r["time_ratio"] = r["step_s"] / base["step_s"]
            r["memory_ratio"] = r["peak_rss_mb"] / base["peak_rss_mb"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.platform(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "command": " ".join(sys.argv),
        "warmup": args.warmup,
        "steps": args.steps,
    }
    try:
        import torch

        meta["torch"] = torch.__version__
    except ImportError:  # pragma: no cover
        pass
    (out / "training_step.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    plot(results, out / "training_step.png")
    print(f"wrote {out / 'training_step.json'} and {out / 'training_step.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
