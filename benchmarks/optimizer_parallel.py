"""Optimizer parallel (``ShardedDataParallel`` levels 1/2/3) vs unsharded DataParallel, torch FSDP2
(``fully_shard``, with and without ``CPUOffloadPolicy``) and ``ZeroRedundancyOptimizer``.

Every variant trains an identical copy of the same MLP (6 blocks of 512 -> 1536 -> 512, 9.4 M
parameters) with AdamW on the same batches, taking turns step by step so drift hits all alike.
Rank 0 prints per variant: the median step time (forward + backward + optimizer step) and its
ratio to unsharded DataParallel, and the bytes each rank holds of optimizer state and of weights
as a fraction of the whole (``× N``: 1.00 means exactly total / N). The offload rows compare the
host optimizer step itself: ``OffloadAdamW`` on each rank's FP32 slice against FSDP2's
``CPUOffloadPolicy`` running torch's AdamW on its host shards.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/optimizer_parallel.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/optimizer_parallel.py
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import foundation.device as hd
import parallel
from hetero.optim import OffloadAdamW

STEPS = int(os.environ.get("BENCH_STEPS", 15))


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(512, 1536), nn.GELU(), nn.Linear(1536, 512))
                           for _ in range(6)]).to(hd.resolve("device"))


def fsdp2(offload: bool) -> nn.Module:
    model = build()
    on_accelerator = hd.resolve("device").type != "cpu"  # pinning needs an accelerator
    policy = CPUOffloadPolicy(pin_memory=on_accelerator) if offload else None
    kwargs = {"offload_policy": policy} if policy else {}
    for block in model:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Optimizer-state bytes this rank holds (its slices; ZeRO's partition)."""
    if isinstance(opt, OffloadAdamW):
        return opt.memory_stats()["host_bytes"]
    inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
    return sum(_local(t).nbytes for s in inner.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def weight_bytes(model: nn.Module) -> int:
    """Weight bytes this rank holds between steps (level1 keeps them whole, as ZeRO-1)."""
    if getattr(model, "keeps_whole_weights", False):
        return sum(p.numel() * p.element_size() for p in model.parameters())
    return sum(_local(p).nbytes for p in model.parameters())


def variants() -> dict[str, tuple[nn.Module, Callable[[nn.Module], torch.optim.Optimizer]]]:
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4)  # noqa: E731
    return {
        "DataParallel (unsharded)": (parallel.data.DataParallel(build()), adamw),
        "level1": (parallel.optimizer_parallel.ShardedDataParallel(build(), "level1"), adamw),
        "level2": (parallel.optimizer_parallel.ShardedDataParallel(build(), "level2"), adamw),
        "level3": (parallel.optimizer_parallel.ShardedDataParallel(build(), "level3"), adamw),
        "torch FSDP2": (fsdp2(offload=False), adamw),
        "ZeroRedundancyOptimizer + DDP": (
            DistributedDataParallel(build()),
            lambda m: ZeroRedundancyOptimizer(m.parameters(), torch.optim.AdamW, lr=1e-4)),
        "level2 + OffloadAdamW": (
            parallel.optimizer_parallel.ShardedDataParallel(build(), "level2"),
            lambda m: OffloadAdamW(m.parameters(), lr=1e-4, overlap_backward=False)),
        "FSDP2 + CPUOffloadPolicy": (fsdp2(offload=True), adamw),
    }


def ranks_line(world: int, device: torch.device) -> str:
    """How the job communicates: ``world`` ranks over the backend that reduces ``device``'s
    tensors (gloo on the host, NCCL/HCCL on an accelerator)."""
    return f"{world} {hd.group_backend(None, device)} ranks"


def main() -> None:
    parallel.init()
    world = parallel.get_world_size()
    device = hd.resolve("device")
    runs = variants()
    opts = {name: make(model) for name, (model, make) in runs.items()}
    x = torch.randn(32, 512, device=device)
    step_ms: dict[str, list[float]] = {name: [] for name in runs}
    opt_ms: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(STEPS + 3):
        for name, (model, _) in runs.items():
            parallel.barrier()
            start = time.perf_counter()
            F.mse_loss(model(x), x).backward()
            hd.synchronize()
            mid = time.perf_counter()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            hd.synchronize()
            end = time.perf_counter()
            if i >= 3:
                step_ms[name].append((end - start) * 1e3)
                opt_ms[name].append((end - mid) * 1e3)
    total_params = sum(p.numel() for p in build().parameters())
    state_total, weight_total = total_params * 8, total_params * 4  # AdamW: 2 FP32 moments
    base = statistics.median(step_ms["DataParallel (unsharded)"])
    rows = []
    for name, (model, _) in runs.items():
        step = statistics.median(step_ms[name])
        state = state_bytes(opts[name]) * world / state_total
        weights = weight_bytes(model) * world / weight_total
        rows.append((name, step, step / base, statistics.median(opt_ms[name]), state, weights))
    if parallel.get_rank() == 0:
        print(f"{ranks_line(world, device)}, {total_params / 1e6:.1f} M parameters, AdamW, "
              f"batch 32/rank, median of {STEPS} steps (torch {torch.__version__}, {device})")
        print(f"{'variant':32s} {'step ms':>8s} {'vs DP':>6s} {'opt ms':>7s} "
              f"{'state ×N':>9s} {'weights ×N':>10s}")
        for name, step, ratio, opt, state, weights in rows:
            print(f"{name:32s} {step:8.1f} {ratio:5.2f}× {opt:7.1f} {state:9.2f} {weights:10.2f}")
        host = {n: statistics.median(opt_ms[n]) for n in ("level2 + OffloadAdamW",
                                                          "FSDP2 + CPUOffloadPolicy")}
        print(f"host optimizer step: OffloadAdamW on the slice is "
              f"{host['FSDP2 + CPUOffloadPolicy'] / host['level2 + OffloadAdamW']:.2f}× "
              f"FSDP2 CPUOffloadPolicy's torch AdamW")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
