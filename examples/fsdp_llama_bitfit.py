"""Fine-tune llama-bias with DP under FSDP2 (``fully_shard`` per decoder layer and at the root),
in DP-BiTFiT (biases only) or full Book-Keeping mode, launched with torchrun:

    torchrun --nproc_per_node 2 examples/fsdp_llama_bitfit.py --mode bitfit   # CPU, gloo, small config
    torchrun --nproc_per_node 2 examples/fsdp_llama_bitfit.py --mode bk

Each rank Poisson-samples its own shard of the data at the global rate q, computes its samples'
per-sample norms locally, and the clipped sums are reduce-scattered to the shards, each rank
noising the rows it owns (docs/DESIGN.md, "FSDP2"). Every rank reports the same ε. Run it from
the repository root with this checkout importable (``pip install -e .`` or ``PYTHONPATH=.``).

On GPUs (nccl), the full Llama-2-7B configuration of ``llama-bias`` (32 layers, width 4096):

    torchrun --nproc_per_node 8 examples/fsdp_llama_bitfit.py --mode bitfit --full --bf16

``--full`` drops the small test configuration; ``--bf16`` shards fp32 master weights and computes
in bfloat16 (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``). This example
was run on CPU only (2 gloo processes, both modes, and ``--bf16``); the GPU command is untested.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, TensorDataset

import dpzoo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["bitfit", "bk"], default="bitfit")
    ap.add_argument("--full", action="store_true", help="the full llama-bias configuration (GPUs)")
    ap.add_argument("--bf16", action="store_true", help="bfloat16 compute, fp32 shards and reduction")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8, help="expected Poisson batch per rank")
    ap.add_argument("--save", default=None, help="directory for dpzoo.save (rank 0 writes)")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same initial model on every rank
    overrides = {} if args.full else dict(dpzoo.model_card("llama-bias").test_overrides)
    model = dpzoo.load("llama-bias", **overrides).to(device).train()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.bf16 else None
    kw = {"mp_policy": mp} if mp is not None else {}
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)

    vocab, seq = model.config.vocab_size, 32
    g = torch.Generator().manual_seed(1)  # the same dataset on every rank: dpzoo shards it
    ids = torch.randint(0, vocab, (64 * dist.get_world_size(), seq), generator=g)
    loader = DataLoader(TensorDataset(ids), batch_size=args.batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3 if args.mode == "bitfit" else 1e-4)
    engine = dpzoo.PrivacyEngine()
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        target_epsilon=8.0,
        target_delta=1e-5,
        epochs=1,
        max_grad_norm=1.0,
        mode="bitfit" if args.mode == "bitfit" else "bk",
        self_check=False,  # not available under FSDP2 (tested against the single-process engine)
    )
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if rank == 0:
        print(f"{args.mode}: {trained} trained parameters, σ={engine.noise_multiplier:.3f}, q={engine.sample_rate:.3f}")
    for step, (batch,) in enumerate(loader):
        if step == args.steps:
            break
        batch = batch.to(device)
        logits = model(input_ids=batch).logits[:, :-1].float()
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="mean")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        eps = engine.get_epsilon(1e-5)
        print(f"rank {rank} step {step}: {len(batch)} samples, loss {loss.item():.3f}, ε = {eps:.3f}", flush=True)
    if args.save:
        dpzoo.save(model, args.save)  # every rank takes part; rank 0 writes, with the privacy metadata
        if rank == 0:
            print("saved to", args.save, dpzoo.privacy_metadata(args.save)["epsilon"])
    dist.barrier()  # every rank done before any tears gloo/NCCL down (an early leaver can abort the others)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
