"""torch.compile and DP: step time of eager and compiled training, non-private and with dpzoo, as
ratios to eager non-private training, measured interleaved in one process.

Four runs of one model: non-private eager, non-private compiled, dpzoo eager, dpzoo compiled
(``torch.compile``, default backend), each built once with the same weights. After warm-up (the
compiled ones compile then), ``--rounds`` rounds run each for ``--steps`` steps, in an order that
rotates between rounds; a run's round time is the median of its steps, its ratio that over the
same round's non-private eager time; reported: the median ratio over rounds and its min–max.
The DP step is the engine's full step on a fixed batch (clip, noise, optimizer step) at sample rate 1, so
every Poisson batch is the fixed batch; noise seeded: this measures time, not privacy. Not a test: timings depend on the machine.

    python benchmarks/bench_compile.py --out benchmarks/results
    python benchmarks/bench_compile.py --device cuda --layers 12 --width 768 --vocab 50257 --batch 32 \
        --out benchmarks/results/gpu          # GPT-2 small; --bf16: under bfloat16 autocast
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.losses import SequenceCrossEntropy

RUNS = ["nonprivate-eager", "nonprivate-compiled", "dpzoo-eager", "dpzoo-compiled"]


def _gpt2(args):
    torch.manual_seed(0)
    return (
        dpzoo.load(
            "gpt2",
            vocab_size=args.vocab,
            num_layers=args.layers,
            width=args.width,
            num_heads=max(1, args.width // 64),
            max_positions=args.seq,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        .train()
        .to(args.device)
    )


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _run(name: str, args, x: torch.Tensor):
    """A ``step()`` for one run: forward, backward and optimizer step on the batch ``x``."""
    model = _gpt2(args)
    crit = SequenceCrossEntropy(shift=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    batches = None
    if name.endswith("compiled"):  # before make_private: dpzoo's hooks go on the compiled model
        model = torch.compile(model, backend=args.backend)
    if name.startswith("dpzoo"):
        engine = dpzoo.PrivacyEngine()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # seeded noise: this measures time, not privacy
            # batch_size = N: sample rate 1, so every Poisson batch is the whole fixed batch
            model, opt, batches = engine.make_private(
                module=model,
                optimizer=opt,
                data_loader=DataLoader(TensorDataset(x), batch_size=len(x)),
                noise_multiplier=1.0,
                noise_seed=0,
            )

    def step():
        xb = x if batches is None else next(iter(batches))[0]
        with torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=args.bf16):
            loss = crit(model(input_ids=xb).logits, xb)
        loss.backward()
        opt.step()
        opt.zero_grad()
        _sync(args.device)

    return step


def measure(args) -> dict:
    torch.set_num_threads(args.threads or torch.get_num_threads())
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    x = x.to(args.device)
    steps, compile_s = {}, {}
    for name in RUNS:
        steps[name] = _run(name, args, x)
        t = time.perf_counter()
        for _ in range(args.warmup):
            steps[name]()
        compile_s[name] = time.perf_counter() - t
    times: dict[str, list[float]] = {n: [] for n in RUNS}
    for r in range(args.rounds):
        order = RUNS[r % len(RUNS) :] + RUNS[: r % len(RUNS)]
        for name in order:
            ts = []
            for _ in range(args.steps):
                t = time.perf_counter()
                steps[name]()
                ts.append(time.perf_counter() - t)
            times[name].append(statistics.median(ts))
    out = {}
    for name in RUNS:
        ratios = [a / b for a, b in zip(times[name], times["nonprivate-eager"])]
        out[name] = {
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "median_ms": 1000 * statistics.median(times[name]),
            "warmup_s": compile_s[name],
            "round_ms": [1000 * t for t in times[name]],
        }
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--bf16", action="store_true", help="forward and loss under bfloat16 autocast")
    args = p.parse_args(argv)
    if args.rounds < 5:
        p.error("--rounds: at least 5, for a median and an interval that mean something")
    result = {
        "config": vars(args),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "torch": torch.__version__},
        "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
        "interval": "min-max of per-round ratios",
        "runs": measure(args),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"compile_{args.device.split(':')[0]}{'_bf16' if args.bf16 else ''}.json"
    (out / name).write_text(json.dumps(result, indent=2))
    for name, r in result["runs"].items():
        print(
            f"{name:22s} {r['ratio_median']:.2f}x [{r['ratio_min']:.2f}-{r['ratio_max']:.2f}]  "
            f"{r['median_ms']:.0f} ms  (warm-up {r['warmup_s']:.0f} s)"
        )


if __name__ == "__main__":
    main()
