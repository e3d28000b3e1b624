"""The scratch harness of issue 17's exploration runs (docs/RESULTS.md, "exploration" rows): a DP
transformer-seqrec on MovieLens-1M with the output bias from exact counts (``--bias freq``,
log(count + 1)) and Adam or SGD. The script that ran, tidied (same computation); the recipe is
``dpzoo train transformer-seqrec`` (train_seqrec). Run from the repository root with
$DPZOO_DATA set:

    python benchmarks/results/dpformer_ml1m/recipe_cpu/exploration/harness.py --epochs 20 --bias freq --tag adam
    python benchmarks/results/dpformer_ml1m/recipe_cpu/exploration/harness.py --epochs 20 --bias freq --opt sgd --lr 0.5 --tag sgd

It writes res_TAG.json in the working directory.
"""

import argparse
import json
import math
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

from dpzoo.hub.load_save import load
from dpzoo.losses import SequenceCrossEntropy
from dpzoo.privacy import PrivacyEngine
from dpzoo.seqrec.downloads import load_dataset
from dpzoo.seqrec.train import evaluate

p = argparse.ArgumentParser()
p.add_argument("--model", default="transformer-seqrec")
p.add_argument("--eps", type=float, default=5.0)
p.add_argument("--epochs", type=int, default=20)
p.add_argument("--batch", type=int, default=1024)
p.add_argument("--lr", type=float, default=1e-2)
p.add_argument("--opt", default="adam")  # adam | sgd
p.add_argument("--mom", type=float, default=0.9)
p.add_argument("--d", type=int, default=64)
p.add_argument("--maxlen", type=int, default=50)
p.add_argument("--bias", default="none")  # none | freq
p.add_argument("--lastk", type=int, default=0)
p.add_argument("--sched", default="warm")  # warm | const | cos
p.add_argument("--eval", type=int, default=5)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--dropout", type=float, default=0.2)
p.add_argument("--nonprivate", action="store_true")
p.add_argument("--freeze", default="")
p.add_argument("--wd", type=float, default=1e-5)
p.add_argument("--tag", default="")
p.add_argument("--phys", type=int, default=256)
a = p.parse_args()
torch.manual_seed(a.seed)
ds = load_dataset("ml-1m")
x, y = ds.to_padded(a.maxlen, "train")
N = len(x)
model = load(a.model, num_items=ds.num_items, max_len=a.maxlen, d_model=a.d, dropout=a.dropout).train()
if hasattr(model, "set_token_frequencies"):
    model.set_token_frequencies(x)
if a.bias == "freq":  # exact counts of users holding each item, outside ε
    s = x.sort(dim=1).values
    first = torch.ones_like(s, dtype=torch.bool)
    first[:, 1:] = s[:, 1:] != s[:, :-1]
    counts = torch.bincount(s[first], minlength=ds.num_items + 1).float()
    counts[0] = 0
    with torch.no_grad():
        model.out.bias.copy_(torch.log(counts + 1.0) - torch.log(counts.sum()))
        model.out.bias[0] = -20.0
for name, prm in model.named_parameters():
    if a.freeze and any(f in name for f in a.freeze.split(",")):
        prm.requires_grad_(False)
params = [q for q in model.parameters() if q.requires_grad]
if a.opt == "sgd":
    opt = torch.optim.SGD(params, lr=a.lr, momentum=a.mom, weight_decay=a.wd)
else:
    opt = torch.optim.Adam(params, lr=a.lr, weight_decay=a.wd)
engine = None
sigma = 0.0
if a.nonprivate:
    gen = torch.Generator().manual_seed(a.seed)
    loader = DataLoader(TensorDataset(x, y), batch_size=a.batch, shuffle=True, generator=gen)
    base = opt
else:
    engine = PrivacyEngine(accountant="rdp")
    model, opt, loader = engine.make_private(
        module=model,
        optimizer=opt,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=a.batch),
        target_delta=1.0 / N**1.1,
        epochs=a.epochs,
        max_grad_norm=1.0,
        clipping="automatic",
        mode="bk-mixopt",
        max_physical_batch_size=a.phys,
        target_epsilon=a.eps,
    )
    base = opt.original_optimizer
    sigma = engine.noise_multiplier
total = a.epochs * len(loader)
warm = max(1, int(0.2 * total))


def lr_factor(step: int) -> float:
    if a.sched == "warm":  # 20% warm-up, then linear decay (train_seqrec's schedule)
        return (step + 1) / warm if step < warm else max(0.0, (total - step) / max(1, total - warm))
    if a.sched == "const":
        return 1.0
    return 0.5 * (1 + math.cos(math.pi * step / total))


sched = torch.optim.lr_scheduler.LambdaLR(base, lr_factor)
if engine is not None:  # one schedule step per logical (Poisson) batch, not per micro-batch
    opt.attach_step_hook(lambda _: sched.step())
crit = SequenceCrossEntropy(ignore_index=0, token_reduction="mean")
hist = []
print(f"N={N} sigma={sigma:.3f} steps={total} q={a.batch / N:.3f}", flush=True)
t0 = time.time()


def evaluate_both(epoch: int) -> None:
    v = evaluate(model, ds, a.maxlen, "valid")
    t = evaluate(model, ds, a.maxlen, "test")
    r = {"epoch": epoch, "valid": v["ndcg@10"], "test": t["ndcg@10"], "test_hit": t["hit@10"], "s": time.time() - t0}
    hist.append(r)
    print(json.dumps(r), flush=True)


evaluate_both(0)
for epoch in range(1, a.epochs + 1):
    for xb, yb in loader:
        logits = model(xb)
        if a.lastk:
            logits, yb = logits[:, -a.lastk :], yb[:, -a.lastk :]
        crit(logits, yb).backward()
        opt.step()
        opt.zero_grad()
        if engine is None:
            sched.step()
    if epoch % a.eval == 0 or epoch == a.epochs:
        evaluate_both(epoch)
out = {"args": vars(a), "sigma": sigma, "hist": hist, "eps": engine.get_epsilon(1.0 / N**1.1) if engine else None}
with open(f"res_{a.tag}.json", "w") as f:
    json.dump(out, f)
print("done", out["eps"], flush=True)
