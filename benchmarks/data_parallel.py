"""DataParallel vs torch DDP: step time on the same ~5 M-parameter model, one launch.

Both wrap identical copies of an MLP (3 blocks of 512 -> 1536 -> 512, 4.7 M parameters) and run
forward + backward + SGD step on the same batches, taking turns step by step. The launch runs
``BENCH_ROUNDS`` rounds (default 5) of ``BENCH_STEPS`` steps each; rank 0 prints each round's
throughput ratio (DDP's median step time / ours), their median and spread, and a per-phase
table over all rounds: forward, backward, optimizer step, and inside our backward the time the
reducer's hooks take (bucket fills and launches) and its end-of-backward reduction (the
remaining launches, the waits, the gradients handed back). It also measures how much of the
AllReduce time the reducer hides behind backward: (backward with communication - backward under
``no_sync``) is the exposed part of the time the same gradients take to all-reduce on their own.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/data_parallel.py
"""

from __future__ import annotations

import collections
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from timing import median_ms
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import foundation.device as hd
import parallel
from parallel.data.grad_reducer import GradReducer

STEPS = int(os.environ.get("BENCH_STEPS", 20))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", 5))
PHASES = ("forward", "backward", "step", "total")


def build() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(512, 1536), nn.GELU(), nn.Linear(1536, 512))
              for _ in range(3)]
    return nn.Sequential(*blocks).to(hd.resolve("device"))


class ReducerClock:
    """Time spent in two of the reducer's own methods, per step: its gradient hooks (bucket
    fills and launches during backward) and its end-of-backward reduction."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = collections.defaultdict(float)
        self._saved: dict[str, Callable] = {}

    def __enter__(self) -> ReducerClock:
        for label, name in (("hooks", "_on_grad"), ("end of backward", "_complete")):
            method = self._saved[name] = getattr(GradReducer, name)
            setattr(GradReducer, name, self._timed(label, method))
        return self

    def _timed(self, label: str, method: Callable) -> Callable:
        spent = self.spent

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - start
        return timed

    def __exit__(self, *exc: object) -> None:
        for name, method in self._saved.items():
            setattr(GradReducer, name, method)


def _round(models: dict[str, nn.Module], x: torch.Tensor, clock: ReducerClock
           ) -> dict[str, dict[str, list[float]]]:
    """One round: ``STEPS`` timed steps of each model (after 3 untimed), taking turns step by
    step (drift hits all alike); per model and phase, the times in ms."""
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
    times = {name: collections.defaultdict(list) for name in models}
    for i in range(STEPS + 3):
        for name, model in models.items():
            clock.spent.clear()
            parallel.barrier()
            t0 = time.perf_counter()
            loss = F.mse_loss(model(x), x)
            t1 = time.perf_counter()
            loss.backward()
            hd.synchronize()
            t2 = time.perf_counter()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            hd.synchronize()
            t3 = time.perf_counter()
            if i < 3:
                continue
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
                times[name][phase].append(seconds * 1e3)
            for label, seconds in clock.spent.items():
                times[name][f"  reducer {label}"].append(seconds * 1e3)
    return times


def _overlap(ours: parallel.data.DataParallel, x: torch.Tensor
             ) -> tuple[float, float, float]:
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
    ratios: list[float] = []
    with ReducerClock() as clock:  # before the reducer registers its hooks
        ours = parallel.data.DataParallel(build(), bucket_cap_mb=cap)
        ddp = DistributedDataParallel(build())
        models = {"DataParallel": ours, "torch DDP": ddp}
        phases: dict[str, dict[str, list[float]]] = {n: collections.defaultdict(list)
                                                     for n in models}
        for _ in range(ROUNDS):
            times = _round(models, x, clock)
            ratios.append(statistics.median(times["torch DDP"]["total"])
                          / statistics.median(times["DataParallel"]["total"]))
            for name in models:
                for phase, values in times[name].items():
                    phases[name][phase] += values
    alone, with_comm, comm = _overlap(ours, x)
    hidden = min(1.0, max(0.0, 1 - (with_comm - alone) / comm))
    if parallel.get_rank() == 0:
        params = sum(p.numel() for p in ours.parameters())
        print(f"{parallel.get_world_size()} ranks, {dist.get_backend_config()}, "
              f"{params / 1e6:.1f} M params, batch 32 per rank, {ROUNDS} rounds of {STEPS} steps")
        print("throughput x DDP per round: " + " ".join(f"{r:.3f}" for r in ratios))
        print(f"median {statistics.median(ratios):.3f} x DDP (spread {min(ratios):.3f}-"
              f"{max(ratios):.3f})")
        print(f"{'median ms':<26} {'DataParallel':>12} {'torch DDP':>10}")
        for phase in phases["DataParallel"]:
            ddp_ms = (f"{statistics.median(phases['torch DDP'][phase]):10.2f}"
                      if phase in phases["torch DDP"] else f"{'':>10}")
            print(f"{phase:<26} {statistics.median(phases['DataParallel'][phase]):12.2f} "
                  f"{ddp_ms}")
        print(f"backward alone {alone:.2f} ms, with AllReduce {with_comm:.2f} ms, AllReduce "
              f"alone {comm:.2f} ms: {hidden:.0%} of the AllReduce hidden behind backward")
    del ours, ddp  # DDP's reducer must go before its process group
    parallel.destroy()


if __name__ == "__main__":
    main()
