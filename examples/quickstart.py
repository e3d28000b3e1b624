"""dpzoo in a minute: a DP-ready zoo model trained with DP-SGD on the bundled digits (no
download), its ε, and the model saved with its privacy metadata and loaded back.

    python examples/quickstart.py      # ~15 s on 2 CPU cores, about 95% at ε = 8 (benchmarks/first_hour.py quickstart)
"""

import tempfile

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import dpzoo
from dpzoo.datasets import digits_dataset

train, test = digits_dataset(size=16)  # scikit-learn's 8×8 digits, as 3×16×16 images
model = dpzoo.load("cnn-tanh-gn", num_classes=10)  # the DP literature's tanh CNN, GroupNorm, 10k parameters
engine = dpzoo.PrivacyEngine()
model, optimizer, loader = engine.make_private(
    module=model,
    optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
    data_loader=DataLoader(train, batch_size=256),  # the engine turns it into Poisson sampling
    target_epsilon=8.0,
    target_delta=1e-5,
    epochs=30,
    max_grad_norm=1.0,
)
for epoch in range(30):
    for x, y in loader:
        F.cross_entropy(model(x), y).backward()  # a mean of per-sample losses: clipped per sample
        optimizer.step()  # clip, add noise, step
        optimizer.zero_grad()
    if (epoch + 1) % 10 == 0:
        model.eval()
        with torch.no_grad():
            accuracy = (model(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
        model.train()
        print(f"epoch {epoch + 1}: test accuracy {accuracy:.3f}, ε = {engine.get_epsilon(1e-5):.2f}")

with tempfile.TemporaryDirectory() as out:
    dpzoo.save(model, out)  # weights (safetensors) + the privacy record: ε, δ, σ, q, steps, accountant
    again = dpzoo.load(out)
    print("saved and loaded back: ε =", round(again.dpzoo_privacy["epsilon"], 2))
