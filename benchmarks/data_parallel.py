"""parallel.DataParallel vs torch DDP: step time on the same ~5 M-parameter model, one launch.

Both wrap identical copies of an MLP (3 blocks of 512 -> 1536 -> 512, 4.7 M parameters) and run
forward + backward + SGD step on the same batches; the median step times and our throughput as a
fraction of DDP's are printed by rank 0. It also measures how much of the AllReduce time our
reducer hides behind backward: (backward with communication - backward under ``no_sync``) is the
exposed part of the time the same gradients take to all-reduce on their own.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/data_parallel.py
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from timing import median_ms
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import foundation.device as hd
import parallel

STEPS = int(os.environ.get("BENCH_STEPS", 20))


def build() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(512, 1536), nn.GELU(), nn.Linear(1536, 512))
              for _ in range(3)]
    return nn.Sequential(*blocks).to(hd.resolve("device"))


def _step_ms(models: dict[str, nn.Module], x: torch.Tensor) -> dict[str, float]:
    """Median step time of each model, taking turns step by step (drift hits all alike)."""
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(STEPS + 3):
        for name, model in models.items():
            parallel.barrier()
            start = time.perf_counter()
            F.mse_loss(model(x), x).backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            hd.synchronize()
            if i >= 3:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _overlap(ours: parallel.DataParallel, x: torch.Tensor) -> tuple[float, float, float]:
    """(backward alone, backward with AllReduce, AllReduce of the same bytes alone), in ms."""

    def backward(sync: bool) -> None:
        if sync:
            F.mse_loss(ours(x), x).backward()
        else:
            with ours.no_sync():
                F.mse_loss(ours(x), x).backward()
        ours.zero_grad(set_to_none=True)

    flat = torch.randn(sum(p.numel() for p in ours.parameters()), device=x.device)
    return (median_ms(lambda: backward(False), STEPS), median_ms(lambda: backward(True), STEPS),
            median_ms(lambda: dist.all_reduce(flat), STEPS))


def main() -> None:
    parallel.init()
    x = torch.randn(32, 512, device=hd.resolve("device"))
    cap = float(os.environ.get("BENCH_BUCKET_MB", 25))
    ours, ddp = parallel.DataParallel(build(), bucket_cap_mb=cap), DistributedDataParallel(build())
    step_ms = _step_ms({"DataParallel": ours, "torch DDP": ddp}, x)
    ours_ms, ddp_ms = step_ms["DataParallel"], step_ms["torch DDP"]
    alone, with_comm, comm = _overlap(ours, x)
    hidden = min(1.0, max(0.0, 1 - (with_comm - alone) / comm))
    if parallel.get_rank() == 0:
        params = sum(p.numel() for p in ours.parameters())
        print(f"{parallel.get_world_size()} ranks, {dist.get_backend_config()}, "
              f"{params / 1e6:.1f} M params, batch 32 per rank, median of {STEPS} steps")
        for name, ms in (("DataParallel", ours_ms), ("torch DDP", ddp_ms)):
            print(f"{name:<13} {ms:8.2f} ms/step  throughput {ddp_ms / ms:5.3f} x DDP")
        print(f"backward alone {alone:.2f} ms, with AllReduce {with_comm:.2f} ms, AllReduce "
              f"alone {comm:.2f} ms: {hidden:.0%} of the AllReduce hidden behind backward")
    del ours, ddp  # DDP's reducer must go before its process group
    parallel.destroy()


if __name__ == "__main__":
    main()
