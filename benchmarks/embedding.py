"""Host embedding training step: ``EmbeddingLookup`` + ``LazyAdam`` vs ``nn.Embedding(sparse=True)``
+ ``torch.optim.SparseAdam``, in one process, on the same ids and gradients.

One step is lookup, backward of a fixed output gradient, and the sparse update; rows/s counts
looked-up rows (batch × fields) per second. Steps of the two alternate so both see the same
machine load; the medians are compared. ``--dist zipf`` draws ids from a log-uniform (Zipf-like)
law, closer to real click logs than ``uniform``, with far fewer distinct rows per batch. With an
accelerator present both deliver the looked-up rows to it (ours ships the distinct rows; the peer
copies its whole output). ``--skip-peer --vocab 10000000`` shows a 2.5 GB table training with
its peak memory (no per-step copy of the table).

    python benchmarks/embedding.py                         # 1 M x 64, batch 16384 x 26, uniform
    python benchmarks/embedding.py --dist zipf --steps 10
    python benchmarks/embedding.py --vocab 10000000 --skip-peer --steps 3
    python benchmarks/embedding.py --dist zipf --disk .   # the table and its state in files

``--disk DIR``: ours keeps the table and its LazyAdam state at rest in files under ``DIR``
(``EmbeddingLookup(disk_path=...)``, the parameter server's cold rows on disk) and is compared
with the same table in memory (the peer then); the anonymous memory at the end says what the
process holds itself, beside the page cache.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time

import torch
from torch import nn

import foundation.device as hd
from hetero.nn import EmbeddingLookup
from hetero.optim import LazyAdam


def batch_ids(vocab: int, batch: int, fields: int, dist: str, gen: torch.Generator
              ) -> torch.Tensor:
    """One batch of ids: uniform, or log-uniform over a hashed (shuffled) vocabulary."""
    if dist == "uniform":
        return torch.randint(0, vocab, (batch, fields), generator=gen)
    r = torch.rand(batch, fields, generator=gen, dtype=torch.float64)
    ranks = (vocab ** r - 1).long().clamp_(0, vocab - 1)
    return (ranks * 2654435761) % vocab  # spread frequent ids over the table, as hashing does


def make_step(module: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
    def step(ids: torch.Tensor, grad: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        out = module(ids)
        out.to(device).backward(grad)  # a no-op move for ours: it delivers there itself
        optimizer.step()
        hd.synchronize()
    return step


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def anonymous_gib() -> float:
    """The process's own memory (``RssAnon``): without the file pages mapped in."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status
                    if line.startswith("RssAnon")) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--fields", type=int, default=26)
    parser.add_argument("--dist", choices=("uniform", "zipf"), default="uniform")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip-peer", action="store_true", help="time ours only")
    parser.add_argument("--disk", default=None, help="a directory: ours keeps the table and its "
                        "state in files there, the peer is the same table in memory")
    args = parser.parse_args()
    device = hd.resolve("device")
    scratch = tempfile.TemporaryDirectory(dir=args.disk) if args.disk else None
    torch.manual_seed(0)
    start = time.perf_counter()
    ours = EmbeddingLookup(args.vocab, args.dim,
                           disk_path=scratch.name if scratch else None).to(device)
    made = time.perf_counter() - start
    runs = {"ours": make_step(ours, LazyAdam(ours.parameters(), lr=1e-3), device)}
    if not args.skip_peer and scratch is not None:  # the same table, in memory
        torch.manual_seed(0)
        peer_table = EmbeddingLookup(args.vocab, args.dim).to(device)
        runs["peer"] = make_step(peer_table, LazyAdam(peer_table.parameters(), lr=1e-3), device)
    elif not args.skip_peer:  # the same initial table
        peer = nn.Embedding.from_pretrained(ours.weight.detach().clone(), freeze=False,
                                            sparse=True)
        runs["peer"] = make_step(peer, torch.optim.SparseAdam(peer.parameters(), lr=1e-3), device)
    gen = torch.Generator().manual_seed(1)
    grad = torch.randn(args.batch, args.fields, args.dim, device=device)
    times: dict[str, list[float]] = {name: [] for name in runs}
    distinct = []
    for i in range(args.steps + 1):  # step 0 warms up (state allocation, first-touch pages)
        ids = batch_ids(args.vocab, args.batch, args.fields, args.dist, gen)
        distinct.append(ids.unique().numel())
        for name, step in runs.items():
            start = time.perf_counter()
            step(ids, grad)
            if i:
                times[name].append(time.perf_counter() - start)
    rows = args.batch * args.fields
    print(f"table {args.vocab:,} x {args.dim} fp32 ({args.vocab * args.dim * 4 / 2**30:.2f} GiB)"
          f", batch {args.batch} x {args.fields} ids ({args.dist}, "
          f"~{statistics.mean(distinct):,.0f} distinct), output on {device}, "
          f"{torch.get_num_threads()} threads; median of {args.steps} steps")
    print(f"{'step':<44} {'ms':>9} {'rows/s':>12}")
    med = {name: statistics.median(t) for name, t in times.items()}
    labels = {"ours": "EmbeddingLookup(target='CPU') + LazyAdam",
              "peer": "nn.Embedding(sparse=True) + SparseAdam"}
    if scratch is not None:
        labels = {"ours": "table + LazyAdam state on disk", "peer": "the same in memory"}
        print(f"table made in its file in {made:.1f} s")
    for name, seconds in med.items():
        print(f"{labels[name]:<44} {seconds * 1e3:>9.1f} {rows / seconds:>12,.0f}")
    if "peer" in med:
        print(f"ratio (ours rows/s / peer rows/s): {med['peer'] / med['ours']:.2f}")
    print(f"peak host memory (RSS): {peak_rss_gib():.2f} GiB; anonymous memory now "
          f"{anonymous_gib():.2f} GiB")


if __name__ == "__main__":
    main()
