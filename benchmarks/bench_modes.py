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
# tiny models for the script's own tests (not run by default)
TINY_CONFIGS = {
    "gpt2-tiny-tied": dict(kind="lm", vocab=64, layers=1, width=16, heads=2, tied=True, batch=4, seq=8),
    "gpt2-tiny-untied": dict(kind="lm", vocab=64, layers=1, width=16, heads=2, tied=False, batch=4, seq=8),
}
ALL_CONFIGS = {**CONFIGS, **TINY_CONFIGS}


class Unsupported(Exception):
    """The library refuses this (config, mode); ``str()`` is the reason."""


def build(cfg: dict, device: str = "cpu"):
    """(model, x, y, criterion, forward) of a config, seeded: every call gives the same weights and batch."""
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
            vocab_size=cfg["vocab"],
            num_layers=cfg["layers"],
            width=cfg["width"],
            num_heads=cfg["heads"],
            max_positions=cfg["seq"],
            tie_word_embeddings=cfg["tied"],
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]))
        y = x.clone()
        crit = SequenceCrossEntropy(shift=True)
        fwd = lambda m, x: m(input_ids=x).logits  # noqa: E731
    return model.to(device).train(), x.to(device), y.to(device), crit, fwd


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
    loader: Any = None  # dpzoo: the engine's loader (the engine steps only on batches from it)
    engine: Any = None
    steps: int = field(default=0)

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def step(self) -> float:
        x, y = next(iter(self.loader)) if self.loader is not None else (self.x, self.y)
        self._sync()
        t = time.perf_counter()
        loss = self.crit(self.fwd(self.model, x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
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


def make_runner(config: str | dict, mode: str, device: str = "cpu") -> Runner:
    """Build ``mode`` on ``config`` (a name of :data:`ALL_CONFIGS` or a config dict); raises
    :class:`Unsupported` when the library refuses the combination."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import dpzoo
    from dpzoo.privacy.modes import TRAINING_MODES

    warnings.filterwarnings("ignore")
    cfg = ALL_CONFIGS[config] if isinstance(config, str) else config
    model, x, y, crit, fwd = build(cfg, device)
    if mode == "nonprivate-bias":
        for n, p in model.named_parameters():
            p.requires_grad_(n.endswith("bias"))
    elif not (mode == "nonprivate-full" or mode.startswith(("dpzoo-", "opacus-"))):
        raise ValueError(f"unknown mode {mode!r}")
    opt = torch.optim.SGD(list(model.parameters()), lr=1e-4)
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    run = Runner(mode, model, opt, crit, fwd, x, y, device)
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


def peak_memory(config: str, mode: str, device: str, warmup: int, steps: int) -> dict:
    """Run ``mode`` alone (call it in a fresh process): its peak memory in MB. CPU: the peak RSS
    during the training steps (``peak_mb``; the high-water mark is reset once the libraries, model
    and engine are built, whose imports peak far above any step) and that minus the RSS before the
    first step (``training_mb``: what the steps add); GPU: ``torch.cuda.max_memory_allocated``."""
    import torch

    try:
        run = make_runner(config, mode, device)
    except Unsupported as e:
        return {"config": config, "mode": mode, "status": "unsupported", "reason": str(e)}
    if not device.startswith("cuda"):
        with open("/proc/self/clear_refs", "w") as f:  # Linux: reset VmHWM to the current RSS
            f.write("5")
        built_mb = _status_mb("VmRSS")
    for _ in range(warmup + steps):
        run.step()
    if device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated() / 2**20
        res = {"measure": "cuda_max_memory_allocated", "peak_mb": peak, "training_mb": peak}
    else:
        peak = _status_mb("VmHWM")
        res = {
            "measure": "peak_rss_during_steps",
            "peak_mb": peak,
            "built_mb": built_mb,
            "training_mb": peak - built_mb,
        }
    return {"config": config, "mode": mode, "status": "ok", **res}
