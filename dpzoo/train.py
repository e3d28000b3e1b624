"""``dpzoo train``: private training of a zoo model on a built-in dataset, from one command.

Image classifiers (ResNet-GN, ViT, EfficientNet-GN) train on scikit-learn's digits (bundled,
no download), privately, with dpzoo's engine; the run prints accuracy and ε per epoch,
writes the metrics as JSON and saves the model with its privacy metadata.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from .datasets import digits_dataset
from .errors import DPZooError
from .hub import load, save
from .privacy import PrivacyEngine
from .registry import model_card

__all__ = ["train_image_classifier"]


def _evaluate(model, dataset, batch_size=256) -> float:
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in DataLoader(dataset, batch_size=batch_size):
            correct += (model(x).argmax(1) == y).sum().item()
    model.train()
    return correct / len(dataset)


def train_image_classifier(
    name: str,
    *,
    data: str = "digits",
    epsilon: float = 8.0,
    delta: float = 1e-5,
    epochs: int = 5,
    batch_size: int = 64,
    lr: float = 1e-3,
    mode: str = "bk-mixopt",
    clipping: str = "automatic",
    max_grad_norm: float = 1.0,
    image_size: int = 16,
    small: bool = True,
    out: str | Path | None = None,
    seed: int = 0,
    accountant: str = "rdp",
    overrides: dict | None = None,
    log=print,
) -> dict:
    """Train ``name`` with DP on ``data``; returns the metrics (also written to ``out``)."""
    card = model_card(name)
    if card.task != "image-classification":
        raise DPZooError(
            f"dpzoo train {name}: only image classifiers train on built-in data for now ({name} is {card.task})."
        )
    if data != "digits":
        raise DPZooError(f"Unknown dataset {data!r}: the built-in one is 'digits'.")
    torch.manual_seed(seed)
    train, test = digits_dataset(size=image_size)
    kwargs = dict(card.test_overrides) if small else {}
    kwargs.update(num_classes=10, **(overrides or {}))
    if "img_size" in card.overrides:
        kwargs["img_size"] = image_size
    model = load(name, **kwargs).train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    engine = PrivacyEngine(accountant=accountant)
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(train, batch_size=batch_size),
        target_epsilon=epsilon,
        target_delta=delta,
        epochs=epochs,
        max_grad_norm=max_grad_norm,
        clipping=clipping,
        mode=mode,
    )
    # `seed` fixes the initialisation and the data split; Poisson membership and noise are secret
    log(
        f"{name} on {data}: {len(train)} train / {len(test)} test images, mode {mode}, "
        f"σ = {engine.noise_multiplier:.3f}, q = {engine.sample_rate:.4f}, target ε = {epsilon} at δ = {delta}"
    )
    history = []
    t = time.time()
    for epoch in range(1, epochs + 1):
        for x, y in loader:  # empty Poisson batches are taken by the engine (noise-only steps)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        acc = _evaluate(model, test)
        eps = engine.get_epsilon(delta)
        history.append({"epoch": epoch, "test_accuracy": acc, "epsilon": eps, "seconds": time.time() - t})
        log(f"epoch {epoch}: test accuracy {acc:.3f}  ε = {eps:.2f}  ({time.time() - t:.0f}s)")
    result = {
        "model": name,
        "data": data,
        "mode": mode,
        "clipping": clipping,
        "epochs": epochs,
        "batch_size": batch_size,
        "lr": lr,
        "delta": delta,
        "noise_multiplier": engine.noise_multiplier,
        "sample_rate": engine.sample_rate,
        "accountant": accountant,
        "history": history,
    }
    if out is not None:
        out = Path(out)
        engine.detach()
        save(model, out / "model", privacy=engine.privacy_metadata(delta))
        (out / "metrics.json").write_text(json.dumps(result, indent=2) + "\n")
        log(f"saved the model (with its privacy metadata) and metrics.json to {out}")
    return result
