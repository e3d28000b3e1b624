"""The models and training modes that ``bench_training_step.py`` times: each (config, mode) built
into a :class:`Runner` whose ``step()`` runs and times one full training step.

Every mode of a config is built from the same seed (same weights, same batch). The DP modes run
the real DP step on a fixed batch: dpzoo through ``make_private`` with ``batch_size = N`` (sample
rate 1, so every Poisson batch is the whole fixed batch) and its loader's batches; Opacus through
``dpzoo.engines.opacus.make_private`` without Poisson sampling. Clipping, noise and the optimizer
step run at every step (``Runner.dp_steps`` counts the steps the accountant saw). A combination
the library refuses raises :class:`Unsupported` with the reason.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

MODES = [
    "nonprivate-full",
    "nonprivate-bias",
    "dpzoo-bk-mixopt",
    "dpzoo-bk",
    "dpzoo-instantiate",
    "dpzoo-bitfit",
    "opacus-hooks",
    "opacus-ghost",
]
BASELINE = "nonprivate-full"
# the physical floor of full DP training: the non-private step plus a Gaussian draw (dpzoo's secret
# generator) added to every trainable coordinate's gradient, what no DP step can avoid
FLOOR = "floor"
# a second baseline for a mode: its ratio to this one is reported too (bias-only vs bias-only)
SECOND_BASELINE = {"dpzoo-bitfit": "nonprivate-bias"}

_LM = dict(kind="lm", vocab=1024, layers=4, width=256, heads=4)
CONFIGS = {
    "resnet18-gn-bias@32": dict(kind="image", name="resnet18-gn-bias", size=32, batch=32),
    "resnet18-gn-bias@128": dict(kind="image", name="resnet18-gn-bias", size=128, batch=32),
    "gpt2-4x256-v1024-tied": dict(_LM, tied=True, batch=16, seq=128),
    "gpt2-4x256-v1024-untied": dict(_LM, tied=False, batch=16, seq=128),
    # MovieLens-1M sized next-item models (3,416 items, d = 64, 2 blocks), the DPFormer setting
    "transformer-seqrec-ml1m": dict(kind="seqrec", name="transformer-seqrec", batch=128, seq=50, items=3416),
    "dpformer-ml1m": dict(kind="seqrec", name="dpformer", batch=128, seq=50, items=3416),
}
# the GPU table (issue 16): real sizes; run with --configs on a GPU machine
_GPT2_SMALL = dict(kind="lm", vocab=50257, layers=12, width=768, heads=12, tied=True, batch=32)
# full DP on a ~1B model: the BK modes and DP-BiTFiT (Opacus' per-sample gradients, B × 1.1B floats, cannot fit)
LLAMA_MODES = ["nonprivate-full", "nonprivate-bias", "dpzoo-bk-mixopt", "dpzoo-bk", "dpzoo-bitfit"]
GPU_CONFIGS = {
    "gpt2-small-t128": dict(_GPT2_SMALL, seq=128),
    "gpt2-small-t512": dict(_GPT2_SMALL, seq=512),
    "gpt2-small-t1024": dict(_GPT2_SMALL, seq=1024),
    "vit-base-patch16@224": dict(kind="image", name="vit-base-patch16", size=224, batch=64),
    "resnet50-gn-bias@224": dict(kind="image", name="resnet50-gn-bias", size=224, batch=64),
    # TinyLlama-1.1B's shape (22 layers, width 2048, grouped-query attention), random weights
    "llama-bias-1b-t512": dict(
        kind="llama",
        vocab=32000,
        layers=22,
        width=2048,
        heads=32,
        kv_heads=4,
        mlp=5632,
        batch=8,
        seq=512,
        modes=LLAMA_MODES,
    ),
}
# tiny models for the script's own tests (not run by default)
TINY_CONFIGS = {
    "gpt2-tiny-tied": dict(kind="lm", vocab=64, layers=1, width=16, heads=2, tied=True, batch=4, seq=8),
    "gpt2-tiny-untied": dict(kind="lm", vocab=64, layers=1, width=16, heads=2, tied=False, batch=4, seq=8),
    "llama-tiny": dict(
        kind="llama", vocab=64, layers=1, width=16, heads=2, kv_heads=1, mlp=32, batch=4, seq=8, modes=LLAMA_MODES
    ),
}
# the 1.1B llama's 22 layers at width 64: a step bound by the host on a CPU, as the 1.1B llama's
# DP-BiTFiT step is on a GPU (its per-layer Python: hooks, bookkeeping, guards), timed here
HOST_CONFIGS = {
    "llama-22x64-t16": dict(
        kind="llama", vocab=256, layers=22, width=64, heads=4, kv_heads=1, mlp=128, batch=4, seq=16, modes=LLAMA_MODES
    ),
}
ALL_CONFIGS = {**CONFIGS, **GPU_CONFIGS, **TINY_CONFIGS, **HOST_CONFIGS}
PRECISIONS = ("fp32", "bf16")  # bf16: the forward and loss under torch.autocast(bfloat16), weights fp32


def config_modes(config: str | dict, modes: list[str]) -> list[str]:
    """``modes`` restricted to those the config is benchmarked in (its ``modes`` key; default all)."""
    cfg = ALL_CONFIGS[config] if isinstance(config, str) else config
    return [m for m in modes if m in cfg.get("modes", MODES)]


class Unsupported(Exception):
    """The library refuses this (config, mode); ``str()`` is the reason."""


def failure(e: BaseException) -> dict:
    """A mode that ran out of memory or broke (building, warming up, measuring): reported, not fatal."""
    import torch

    status = "oom" if isinstance(e, torch.cuda.OutOfMemoryError) else "error"
    return {"status": status, "reason": f"{type(e).__name__}: {' '.join(str(e).split())}"[:300]}


def build(cfg: dict, device: str = "cpu", model_mode: Any = None):
    """(model, x, y, criterion, forward) of a config, seeded: every call gives the same weights and
    batch. ``model_mode``: a context (e.g. a ``FakeTensorMode``) the model is built in, not the data."""
    import torch

    import dpzoo

    torch.manual_seed(0)
    in_mode = model_mode if model_mode is not None else contextlib.nullcontext()
    if cfg["kind"] == "image":
        with in_mode:
            model = dpzoo.load(cfg["name"], num_classes=10)
        x = torch.randn(cfg["batch"], 3, cfg["size"], cfg["size"])
        y = torch.randint(0, 10, (cfg["batch"],))
        crit = torch.nn.CrossEntropyLoss()
        fwd = lambda m, x: m(x)  # noqa: E731
    elif cfg["kind"] == "seqrec":
        from dpzoo.losses import SequenceCrossEntropy

        with in_mode:
            model = dpzoo.load(cfg["name"], num_items=cfg["items"], max_len=cfg["seq"])
        x = torch.randint(1, cfg["items"] + 1, (cfg["batch"], cfg["seq"]))
        y = torch.randint(1, cfg["items"] + 1, (cfg["batch"], cfg["seq"]))
        if hasattr(model, "set_token_frequencies"):  # Re-Attention active in every mode, as in training
            model.set_token_frequencies(x)
            model.set_dp_noise(noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=cfg["batch"])
        crit = SequenceCrossEntropy(ignore_index=0)
        fwd = lambda m, x: m(x)  # noqa: E731
    else:  # causal LMs: GPT-2 ("lm") or llama-bias ("llama"), one token batch as input and target
        from dpzoo.losses import SequenceCrossEntropy

        shape = dict(
            vocab_size=cfg["vocab"],
            num_layers=cfg["layers"],
            width=cfg["width"],
            num_heads=cfg["heads"],
            max_positions=cfg["seq"],
        )
        if cfg["kind"] == "llama":
            with torch.device(device), in_mode:  # initialised where it trains: 1.1B weights take a while on a CPU
                model = dpzoo.load("llama-bias", **shape, num_kv_heads=cfg["kv_heads"], intermediate_size=cfg["mlp"])
        else:
            no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
            with in_mode:
                model = dpzoo.load("gpt2", **shape, tie_word_embeddings=cfg["tied"], **no_dropout)
        x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]))
        y = x.clone()
        crit = SequenceCrossEntropy(shift=True)
        fwd = lambda m, x: m(input_ids=x).logits  # noqa: E731
    if device != "cpu":  # (built on the CPU; .to would swap a fake tensor's parameters, see cost_report.py)
        model, x, y = model.to(device), x.to(device), y.to(device)
    return model.train(), x, y, crit, fwd


@dataclass
class Runner:
    """One mode of one config, built once: ``step()`` runs a training step and returns its seconds."""

    mode: str
    model: Any
    opt: Any
    crit: Any
    fwd: Callable
    x: Any
    y: Any
    device: str = "cpu"
    precision: str = "fp32"
    loader: Any = None  # dpzoo: the engine's loader (the engine steps only on batches from it)
    engine: Any = None
    steps: int = field(default=0)
    noise_floor: bool = False  # FLOOR: noise on every trainable coordinate before the optimizer step

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def train_step(self, batch, phase: Callable = contextlib.nullcontext) -> None:
        """Forward (with the loss), backward, optimizer step on ``batch``, each phase inside
        ``phase(name)`` (e.g. torch.profiler's ``record_function``)."""
        import torch

        x, y = batch
        with phase("forward"):
            with torch.autocast(self.device.split(":")[0], dtype=torch.bfloat16, enabled=self.precision == "bf16"):
                loss = self.crit(self.fwd(self.model, x), y)
        with phase("backward"):
            loss.backward()
        if self.noise_floor:
            from dpzoo.privacy.data import secret_generator

            with phase("noise"):
                for p in self.model.parameters():
                    if p.grad is not None:
                        p.grad.add_(torch.empty_like(p).normal_(0.0, 1.0, generator=secret_generator(p.device)))
        with phase("optimizer"):
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def next_batch(self):
        return next(iter(self.loader)) if self.loader is not None else (self.x, self.y)

    def step(self) -> float:
        batch = self.next_batch()
        self._sync()
        t = time.perf_counter()
        self.train_step(batch)
        self._sync()
        self.steps += 1
        return time.perf_counter() - t

    def dp_steps(self) -> int | None:
        """Steps the privacy accountant has counted (None for a non-private mode)."""
        if self.engine is None:
            return None
        if self.mode.startswith("dpzoo"):
            return int(self.engine.steps)
        return sum(int(h[2]) for h in self.engine.accountant.history)


def make_runner(
    config: str | dict,
    mode: str,
    device: str = "cpu",
    precision: str = "fp32",
    model_mode: Any = None,
    engine_kwargs: dict | None = None,
    foreach: bool | None = None,
) -> Runner:
    """Build ``mode`` on ``config`` (a name of :data:`ALL_CONFIGS` or a config dict); raises
    :class:`Unsupported` when the library refuses the combination. ``model_mode``: a context the
    model, its optimizer and engine are built in (not the data), e.g. ``cost_trace``'s;
    ``engine_kwargs``: more arguments to dpzoo's ``make_private`` (e.g. ``self_check=False``);
    ``foreach``: the optimizer's (None: torch's default, multi-tensor kernels on CUDA only)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import dpzoo
    from dpzoo.privacy.modes import TRAINING_MODES

    warnings.filterwarnings("ignore")
    cfg = ALL_CONFIGS[config] if isinstance(config, str) else config
    model, x, y, crit, fwd = build(cfg, device, model_mode)
    in_mode = model_mode if model_mode is not None else contextlib.nullcontext()
    if mode == "nonprivate-bias":
        for n, p in model.named_parameters():
            p.requires_grad_(n.endswith("bias"))
    elif not (mode in ("nonprivate-full", FLOOR) or mode.startswith(("dpzoo-", "opacus-"))):
        raise ValueError(f"unknown mode {mode!r}")
    opt = torch.optim.SGD(list(model.parameters()), lr=1e-4, foreach=foreach)
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} ({', '.join(PRECISIONS)})")
    run = Runner(mode, model, opt, crit, fwd, x, y, device, precision, noise_floor=mode == FLOOR)
    with in_mode:
        try:
            if mode.startswith("dpzoo-"):
                name = mode.removeprefix("dpzoo-")
                if name not in TRAINING_MODES:
                    raise Unsupported(f"dpzoo has no mode {name!r} (modes: {', '.join(TRAINING_MODES)})")
                engine = dpzoo.PrivacyEngine()
                # batch_size = N: q = 1, so every Poisson batch is the whole (fixed) batch, as for the others
                run.model, run.opt, run.loader = engine.make_private(
                    module=model,
                    optimizer=opt,
                    data_loader=loader,
                    noise_multiplier=1.0,
                    max_grad_norm=1.0,
                    mode=name,
                    train_head=None,
                    **(engine_kwargs or {}),
                )
                run.engine = engine
            elif mode.startswith("opacus-"):
                from opacus import PrivacyEngine

                from dpzoo.engines.opacus import make_private

                gsm = {"opacus-hooks": "hooks", "opacus-ghost": "ghost"}.get(mode)
                if gsm is None:
                    raise Unsupported(f"no Opacus mode {mode!r} (opacus-hooks, opacus-ghost)")
                engine = PrivacyEngine()
                out = make_private(
                    engine,
                    module=model,
                    optimizer=opt,
                    data_loader=loader,
                    noise_multiplier=1.0,
                    max_grad_norm=1.0,
                    poisson_sampling=False,
                    criterion=crit,
                    grad_sample_mode=gsm,
                )
                if gsm == "ghost":
                    run.model, run.opt, run.crit, _ = out
                else:
                    run.model, run.opt, _ = out
                run.engine = engine
        except dpzoo.DPZooError as e:
            raise Unsupported(" ".join(str(e).split())[:300]) from e
    return run


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        return int(next(ln for ln in f if ln.startswith(key)).split()[1]) / 1024


def peak_memory(config: str, mode: str, device: str, warmup: int, steps: int, precision: str = "fp32") -> dict:
    """Run ``mode`` alone (call it in a fresh process): its peak memory in MB. CPU: the peak RSS
    during the training steps (``peak_mb``; the high-water mark is reset once the libraries, model
    and engine are built, whose imports peak far above any step) and that minus the RSS before the
    first step (``training_mb``: what the steps add); GPU: see :func:`cuda_peak_memory`."""
    if device.startswith("cuda"):
        return cuda_peak_memory(config, mode, device, steps, precision)
    try:
        run = make_runner(config, mode, device, precision)
    except Unsupported as e:
        return {"config": config, "mode": mode, "status": "unsupported", "reason": str(e)}
    with open("/proc/self/clear_refs", "w") as f:  # Linux: reset VmHWM to the current RSS
        f.write("5")
    built_mb = _status_mb("VmRSS")
    for _ in range(warmup + steps):
        run.step()
    peak = _status_mb("VmHWM")
    res = {"measure": "peak_rss_during_steps", "peak_mb": peak, "built_mb": built_mb, "training_mb": peak - built_mb}
    return {"config": config, "mode": mode, "status": "ok", **res}


def free_cuda() -> None:
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()


def cuda_peak_memory(config: str | dict, mode: str, device: str, steps: int, precision: str = "fp32") -> dict:
    """``mode``'s peak CUDA memory in MB (``torch.cuda.max_memory_allocated``), counted from the
    memory allocated before it is built, so modes can be measured one after another in one process:
    ``first_step_mb`` covers the build and first step (dpzoo's engine checks its plan on the first
    step), ``peak_mb`` = ``training_mb`` the ``steps`` later steps (steady state), each including the
    weights. Out of memory gives status ``oom``; the memory is freed before returning."""
    import torch

    free_cuda()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run = None
    try:
        run = make_runner(config, mode, device, precision)
        run.step()
        first = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(max(1, steps)):
            run.step()
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    except Unsupported as e:
        return {"mode": mode, "status": "unsupported", "reason": str(e)}
    except Exception as e:  # out of memory, or a library failing at its first step (e.g. Opacus under autocast)
        return {"mode": mode, **failure(e)}
    finally:
        del run
        free_cuda()
    return {
        "mode": mode,
        "status": "ok",
        "measure": "cuda_max_memory_allocated above the memory allocated before the build",
        "first_step_mb": first,
        "peak_mb": peak,
        "training_mb": peak,
    }


def largest_batch(config: str, mode: str, device: str, precision: str, cap: int) -> dict:
    """The largest batch, doubling from the config's, with which ``mode`` builds and runs two steps
    without running out of CUDA memory (``None`` if even the config's does not), up to ``cap``."""

    cfg = ALL_CONFIGS[config]
    batch, fits = cfg["batch"], None
    free_cuda()
    while batch <= cap:
        run = None
        try:
            run = make_runner(dict(cfg, batch=batch), mode, device, precision)
            run.step()
            run.step()
            fits = batch
        except Exception:  # out of memory (or any failure): the previous batch is the largest
            break
        finally:
            del run
            free_cuda()
        batch *= 2
    return {"largest_batch": fits, "capped": batch > cap, "cap": cap, "search": "doubling from the config's batch"}
