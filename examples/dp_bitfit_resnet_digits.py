"""DP-BiTFiT and two-phase X+BiTFiT fine-tuning of resnet18-gn-bias on a small real dataset.

No pretrained ResNet is reachable offline, so this is transfer learning end to end:
1. pre-train resnet18-gn-bias without privacy on "public" data: scikit-learn's digits 0–4;
2. fine-tune it with DP on "private" data: digits 5–9 (relabelled 0–4), at ε = 8, three ways:
   DP-BiTFiT (biases + head, activation-free), two-phase 1+BiTFiT (1 epoch of full DP
   fine-tuning, then DP-BiTFiT; DP-BiTFiT paper App. A.2.2), and full DP fine-tuning.

    python examples/dp_bitfit_resnet_digits.py [--epochs 4] [--epsilon 8]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import dpzoo
from dpzoo.datasets import digits_dataset


def split(ds, classes):
    x, y = ds.tensors
    keep = torch.isin(y, torch.tensor(classes))
    return TensorDataset(x[keep], y[keep] - min(classes))


def accuracy(model, ds):
    model.eval()
    with torch.no_grad():
        acc = (model(ds.tensors[0]).argmax(1) == ds.tensors[1]).float().mean().item()
    model.train()
    return acc


def pretrain(model, ds, epochs=8):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(epochs):
        for x, y in DataLoader(ds, batch_size=32, shuffle=True):
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()


def private_finetune(model, train, test, method, epochs, epsilon, delta):
    model = copy.deepcopy(model)
    # learning rates of the DP-BiTFiT paper (Table 14): 1e-3 full, 5e-3 BiTFiT, with Adam
    opt = torch.optim.Adam(model.parameters(), lr=5e-3 if method == "bitfit" else 1e-3)
    engine = dpzoo.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(train, batch_size=64),
        target_epsilon=epsilon,
        target_delta=delta,
        epochs=epochs,
        max_grad_norm=1.0,
        clipping="automatic",
        mode="bitfit" if method == "bitfit" else "bk-mixopt",
    )
    t = time.time()
    for epoch in range(epochs):
        if method == "1+bitfit" and epoch == 1:
            engine.switch_mode("bitfit")  # phase 2: biases and head only
            for g in opt.param_groups:
                g["lr"] = 5e-3
        for x, y in loader:
            if x.shape[0]:
                F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return accuracy(model, test), engine.get_epsilon(delta), time.time() - t, trainable


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    args = ap.parse_args()
    torch.manual_seed(0)
    train, test = digits_dataset(size=16)
    public_train, public_test = split(train, [0, 1, 2, 3, 4]), split(test, [0, 1, 2, 3, 4])
    private_train, private_test = split(train, [5, 6, 7, 8, 9]), split(test, [5, 6, 7, 8, 9])
    model = dpzoo.load("resnet18-gn-bias", num_classes=5, layers=[1, 1, 1, 1], width=16)
    pretrain(model, public_train)
    print(f"pre-trained without privacy on public digits 0-4: accuracy {accuracy(model, public_test):.3f}")
    print(f"before private fine-tuning, on private digits 5-9: accuracy {accuracy(model, private_test):.3f}")
    for method in ("bitfit", "1+bitfit", "full"):
        acc, eps, secs, trainable = private_finetune(
            model, private_train, private_test, method, args.epochs, args.epsilon, args.delta
        )
        print(
            f"DP {method:<9} accuracy {acc:.3f}  epsilon {eps:.2f} (delta {args.delta:g})  "
            f"trainable at the end {trainable:,}  {secs:.0f}s"
        )


if __name__ == "__main__":
    main()
