"""Parameter server: lookup + LazyAdam update rows/s of a row-sharded host table, against the
single-host ``EmbeddingLookup(target="CPU")``.

Each step looks up ``BENCH_IDS`` ids per rank (uniform, or Zipf with s = 1.1: a few hot rows),
backpropagates a mean and runs ``hetero.optim.LazyAdam``; rows/s counts the ids of every rank. With
one rank the single-host table is timed in the same process and the ratio printed; with N ranks
the sharded figure is the whole job's, and each rank's table + optimizer bytes are printed
against 1/N of the whole.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 1 benchmarks/parameter_server.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/parameter_server.py

``BENCH_VOCAB`` (default 10 M) x ``BENCH_DIM`` (64) is the table; ``BENCH_STEPS`` (10) the steps.
Each kind is also run with the device-side cache (``cache_size=BENCH_CACHE``, default 65 536 rows):
one refresh after the 4 warm-up steps fills it from their lookups (its time printed), the measured
steps run without one (a refresh is every ``cache_refresh`` steps, 100 by default), and their hit
rate (distinct rows served by the cache) is printed. TorchRec's row-wise
sharded ``EmbeddingBagCollection`` is the peer named in the issue; it does not load here:
fbgemm-gpu-cpu 1.9.0's kernels have undefined symbols against torch 2.13.

A last row ships the looked-up rows to the accelerator (the table stays in host memory, its
output on the device; each step timed to the device's synchronize); without an accelerator it is
printed as skipped, with the reason.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

import foundation.device as hd
import hetero
import parallel

VOCAB = int(float(os.environ.get("BENCH_VOCAB", 10e6)))
DIM = int(os.environ.get("BENCH_DIM", 64))
IDS = int(os.environ.get("BENCH_IDS", 65536))
STEPS = int(os.environ.get("BENCH_STEPS", 10))
CACHE = int(os.environ.get("BENCH_CACHE", 65536))
WARMUP = 4


def ids(kind: str, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    if kind == "uniform":
        return torch.randint(0, VOCAB, (IDS,), generator=g)
    ranks = torch.arange(1, 10_000_001, dtype=torch.float64)  # Zipf over the first 10 M ranks
    probs = ranks.pow(-1.1)
    drawn = torch.multinomial(probs / probs.sum(), IDS, replacement=True, generator=g)
    return (drawn * 2654435761) % VOCAB  # hashed ids: hot rows scattered over the table


def rows_per_s(table: hetero.nn.EmbeddingLookup, kind: str, rank: int, world: int
               ) -> tuple[float, float]:
    """Steady-state rows/s of the job, and (with a cache) the milliseconds of the one refresh
    after the warm-up steps, which fills the cache from their lookups."""
    opt = hetero.optim.LazyAdam(table.parameters(), lr=0.01)
    batches = [ids(kind, s, rank) for s in range(STEPS + WARMUP)]
    times, refresh = [], 0.0
    for step, batch in enumerate(batches):
        if step == WARMUP and table.cache is not None:
            parallel.barrier()
            start = time.perf_counter()
            table.cache.refill()
            refresh = time.perf_counter() - start
        parallel.barrier()
        start = time.perf_counter()
        opt.zero_grad()
        table(batch).mean().backward()
        opt.step()
        hd.synchronize()  # rows shipped to an accelerator: the copies are part of the step
        parallel.barrier()
        if step >= WARMUP:
            times.append(time.perf_counter() - start)
    return IDS * world / statistics.median(times), refresh * 1e3


def held_bytes(table: hetero.nn.EmbeddingLookup) -> int:
    opt = hetero.optim.LazyAdam(table.parameters(), lr=0.01)
    table(torch.arange(2)).sum().backward()
    opt.step()
    return table.weight.numel() * table.weight.element_size() + sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim())


def device_row(rank: int, world: int) -> str:
    """Rows/s of the sharded table (no cache, Zipf ids) whose rows go to the accelerator — the
    host-table case the parameter server is for — or why the row is skipped."""
    if not hd.has_accelerator():
        return f"device row skipped: no accelerator here ({hd.build_facts()})"
    device = hd.resolve("device")
    torch.manual_seed(0)
    table = hetero.nn.EmbeddingLookup(VOCAB, DIM, sharding="row").to(device)
    rate, _ = rows_per_s(table, "zipf", rank, world)
    return f"| {world} | zipf, rows to {device} | — | — | {rate / 1e6:.2f} M | — | — | — |"


def main() -> None:
    parallel.init()
    torch.set_num_threads(1)
    rank, world = parallel.get_rank(), parallel.get_world_size()
    whole = VOCAB * DIM * 4 * 3
    for cache in (None, CACHE):
        torch.manual_seed(0)
        sharded = hetero.nn.EmbeddingLookup(VOCAB, DIM, sharding="row", cache_size=cache,
                                            cache_refresh=10**9)  # refreshed by hand, once
        rows, hits = {}, {}
        for kind in ("uniform", "zipf"):
            if sharded.cache is not None:
                sharded.cache.clear()
            rows[kind] = rows_per_s(sharded, kind, rank, world)
            if sharded.cache is not None:  # the measured steps' hit rate
                cache_ = sharded.cache
                hits[kind] = cache_.hits / max(cache_.lookups, 1)
        held = torch.tensor(float(held_bytes(sharded)))
        most = parallel.collectives.all_reduce(held, op="max").item()
        del sharded
        if rank != 0:
            continue
        for kind, (rate, refresh) in rows.items():
            hit = f"{hits[kind]:.0%}, refresh {refresh:.0f} ms" if cache else "—"
            line = f"| {world} | {kind} | {cache or '—'} | {hit} | {rate / 1e6:.2f} M |"
            if world == 1 and cache is None:
                single = hetero.nn.EmbeddingLookup(VOCAB, DIM)
                base, _ = rows_per_s(single, kind, 0, 1)
                del single
                line += f" {base / 1e6:.2f} M | {rate / base:.2f}× |"
            else:
                line += " — | — |"
            print(line + f" {most / 2**30:.2f} GiB ({most / (whole / world):.2f} of 1/N) |",
                  flush=True)
    line = device_row(rank, world)
    if rank == 0:
        print(line, flush=True)
    parallel.destroy()


if __name__ == "__main__":
    main()
