"""What parallel's differentiable collectives cost over raw torch.distributed.

Runs on every rank of a torchrun job. For each message size it times ``all_reduce`` and
``all_gather`` (functional collectives with autograd and our checks) against the in-place
``torch.distributed`` call on the same data, and rank 0 prints the medians and their ratio.
Rows marked "(check)" run ``parallel``'s collectives in check mode (every call exchanges its
signature first, ``HETERO_PARALLEL_CHECK_COLLECTIVES=1``); the others are the default mode, whose
signature check is a cache hit after the first call.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/collectives.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from timing import median_ms

import foundation.device as hd
import parallel
from foundation import collective_check

SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 22)  # float32 elements: 4 KiB .. 16 MiB
REPEATS = 20


def _gather_raw(x: torch.Tensor, world: int) -> None:
    out = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_single(out, x)


def main() -> None:
    parallel.init()
    rank, world = parallel.get_rank(), parallel.get_world_size()
    device = hd.resolve("device")
    rows = []
    for numel in SIZES:
        x = torch.randn(numel, device=device)
        pairs = {
            "all_reduce": (parallel.collectives.all_reduce, lambda t: dist.all_reduce(t.clone())),
            "all_gather": (parallel.collectives.all_gather, lambda t: _gather_raw(t, world)),
        }
        for name, (ours, peer) in pairs.items():
            ours_ms = median_ms(lambda f=ours, t=x: f(t), REPEATS)
            peer_ms = median_ms(lambda f=peer, t=x: f(t), REPEATS)
            rows.append((name, numel * 4, ours_ms, peer_ms))
            if numel == SIZES[0]:  # check mode's fixed cost shows on the smallest message
                collective_check.set_enabled(True)
                checked_ms = median_ms(lambda f=ours, t=x: f(t), REPEATS)
                collective_check.set_enabled(False)
                rows.append((f"{name} (check)", numel * 4, checked_ms, peer_ms))
    if rank == 0:
        print(f"{world} ranks, backend {dist.get_backend_config()}, device {device}")
        print(f"{'collective':<19} {'bytes':>10} {'parallel ms':>12} {'torch ms':>9} "
              f"{'ratio':>6}")
        for name, nbytes, ours_ms, peer_ms in rows:
            ratio = ours_ms / peer_ms
            print(f"{name:<19} {nbytes:>10} {ours_ms:>12.3f} {peer_ms:>9.3f} {ratio:>6.2f}")
        # nccl-tests' bus bandwidth of the largest all_reduce: the bytes each link carries
        # (2(n-1)/n of the message) per second, comparable with the links' own rate
        name, nbytes, ours_ms, peer_ms = next(r for r in reversed(rows) if r[0] == "all_reduce")
        factor = 2 * (world - 1) / world
        print(f"all_reduce bus bandwidth at {nbytes / 2**20:.0f} MiB: ours "
              f"{factor * nbytes / ours_ms / 1e6:.1f} GB/s, torch "
              f"{factor * nbytes / peer_ms / 1e6:.1f} GB/s ({ours_ms / peer_ms:.2f}x its time)")
    parallel.destroy()


if __name__ == "__main__":
    main()
