"""Asynchronous checkpoints against synchronous DCP saves: what a save costs the training loop.

The recipe GPT (``--d-model`` x ``--layers``, data parallel, AdamW) trains on 2 ranks. In the
same run: steps without any save (the baseline), a synchronous save (``recipes.checkpoint
.save_checkpoint``: ``dcp.save``, then the checksums and the rename; training stops for all of
it), and an asynchronous one (``recipes.checkpoint_async.AsyncCheckpointer``: training stops
only to stage the state; DCP's writer thread writes while the next steps run, and the
checkpoint is published once written). Rank 0 prints the stall of each, the median step time
while the asynchronous save is written against the baseline's, and the time from its start to
its publication.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/checkpoint_async.py
    ... benchmarks/checkpoint_async.py --d-model 768 --layers 12   # ~150 M parameters

On a host the writer thread shares the cores that compute (on this 2-core machine, two ranks and
two writers share two cores); on an accelerator the steps run on the device and the thread only
competes for the host.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import foundation.device as hd
import parallel
from parallel import ParallelConfig
from recipes.checkpoint import save_checkpoint
from recipes.checkpoint_async import AsyncCheckpointer
from recipes.gpt import GPT

VOCAB, SEQ = 4096, 64


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    p.add_argument("--steps", type=int, default=8, help="baseline steps")
    args = p.parse_args()
    parallel.init()
    device = hd.resolve("device")
    torch.manual_seed(0)
    model = GPT(VOCAB, d_model=args.d_model, n_layer=args.layers, n_head=8, block_size=SEQ,
                dropout=0.0).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    model = parallel.parallelize(model, ParallelConfig()).model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    g = torch.Generator().manual_seed(dist.get_rank())

    def step() -> float:
        x = torch.randint(0, VOCAB, (args.batch, SEQ), generator=g).to(device)
        start = time.perf_counter()
        _, loss = model(x, torch.roll(x, -1, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        hd.synchronize(device)
        return time.perf_counter() - start

    root = Path(tempfile.mkdtemp(prefix="ckpt_bench_")) if dist.get_rank() == 0 else None
    shared = [str(root) if root else None]
    dist.broadcast_object_list(shared, src=0)
    root = Path(shared[0])
    try:
        for _ in range(2):
            step()  # warm-up: optimizer state exists, allocator warm
        baseline = [step() for _ in range(args.steps)]
        parallel.barrier()
        start = time.perf_counter()
        save_checkpoint(root / "sync", 1, model, opt, sched, device)
        sync_stall = time.perf_counter() - start
        saver = AsyncCheckpointer(None)
        parallel.barrier()
        start = time.perf_counter()
        saver.save(root / "async", 1, model, opt, scheduler=sched, device=device)
        async_stall = time.perf_counter() - start
        during, published = [], None
        while published is None:
            during.append(step())
            published = saver.poll()
        publish_s = time.perf_counter() - start
        saver.close()
    finally:
        parallel.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
    if dist.get_rank() == 0:
        base, busy = statistics.median(baseline), statistics.median(during)
        print(f"GPT {n_params / 1e6:.0f} M parameters, {dist.get_world_size()} ranks, "
              f"{args.batch}x{SEQ} tokens per rank and step\n"
              f"| | seconds |\n|---|---|\n"
              f"| step, no save (median of {len(baseline)}) | {base:.3f} |\n"
              f"| synchronous save: training stopped | {sync_stall:.3f} |\n"
              f"| asynchronous save: training stopped (staging) | {async_stall:.3f} |\n"
              f"| step while it is written (median of {len(during)}) | {busy:.3f} "
              f"({busy / base:.2f}x the baseline) |\n"
              f"| asynchronous save: start to published | {publish_s:.3f} |\n"
              f"stall ratio async/sync: {async_stall / sync_stall:.2f}", flush=True)
    parallel.destroy()


if __name__ == "__main__":
    main()
