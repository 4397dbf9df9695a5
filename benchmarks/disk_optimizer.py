"""The disk tier's optimizer step against what the disk can do, in the same process.

    python benchmarks/disk_optimizer.py                       # 100 M parameters (1.2 GB of state)
    python benchmarks/disk_optimizer.py --params 5e8 --dir /mnt/nvme

A step of :class:`hetero.offload.DiskAdamW` reads every byte of its state (FP32 master and both
moments: 12 B per parameter) and writes it back once. The floor is the disk's own time for those
bytes, measured here first with the same file class, chunk size and IO path: one pass writing
every chunk, one reading it. The step is then timed with direct IO (``O_DIRECT``, aligned
buffers, no page cache) and buffered, and with the host-memory tier (``hetero.optim.OffloadAdamW``
over the same parameters) for scale, and the floor's pass is repeated through DeepSpeed's libaio
``aio`` op where it builds (``apt install libaio-dev``): the IO path this tier did not choose.
Printed: each step's seconds, its ratio to the disk floor (1.0: the disk was busy the whole
step), and the GB/s moved.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from hetero.offload import DiskAdamW
from hetero.offload.disk_file import ALIGN, ChunkFile, aligned_empty
from hetero.optim import OffloadAdamW


def disk_floor(directory: Path, numel: int, chunk_mb: float, direct: bool) -> float:
    """Seconds to write, then read back, 12 B per parameter in chunks, through ChunkFile."""
    per_chunk = max(ALIGN, int(chunk_mb * 2**20) // 12 // ALIGN * ALIGN)
    chunks = -(-numel // per_chunk)
    file = ChunkFile(directory / "floor.bin", chunks, 12 * per_chunk, direct=direct)
    buffers = [aligned_empty(3 * per_chunk) for _ in range(2)]
    for b in buffers:
        b.fill_(1.0)
    try:
        start = time.perf_counter()
        pending = [file.write(i, buffers[i % 2]) for i in range(chunks)]
        for p in pending:
            p.result()
        reads = [file.read(i, buffers[i % 2]) for i in range(chunks)]
        for r in reads:
            r.result()
        return time.perf_counter() - start
    finally:
        file.close()


def deepspeed_aio_floor(directory: Path, numel: int, chunk_mb: float) -> float | None:
    """The same write-then-read pass as :func:`disk_floor` through DeepSpeed's libaio ``aio``
    op (ZeRO-Infinity's swapper IO; its default handle: 1 MiB blocks, queue depth 8, two chunks
    in flight), or None where DeepSpeed or its op's build (``libaio-dev``) is missing."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            return None
        aio = AsyncIOBuilder().load(verbose=False)
    except Exception:  # noqa: BLE001 (not installed, or its build failed: no row)
        return None
    per_chunk = max(ALIGN, int(chunk_mb * 2**20) // 12 // ALIGN * ALIGN)
    chunks = -(-numel // per_chunk)
    handle = aio.aio_handle(2**20, 8, False, True, 1)
    buffers = [aligned_empty(3 * per_chunk) for _ in range(2)]
    for b in buffers:
        b.fill_(1.0)
    path = directory / "deepspeed_floor.bin"
    with open(path, "wb") as f:
        f.truncate(chunks * buffers[0].nbytes)
    try:
        start = time.perf_counter()
        for submit in (handle.async_pwrite, handle.async_pread):
            for i in range(chunks):
                submit(buffers[i % 2], str(path), i * buffers[0].nbytes)
                if i % 2 or i == chunks - 1:
                    handle.wait()
        return time.perf_counter() - start
    finally:
        path.unlink()


def _params(numel: int) -> list[torch.nn.Parameter]:
    rows = 4096
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(rows, 1024) * 0.02)
              for _ in range(max(1, numel // (rows * 1024)))]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return params


def _step_seconds(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                  grads: list[torch.Tensor], steps: int) -> float:
    """Seconds per step, the same gradients given before each (an offloading optimizer takes
    them and lets go of them at its step)."""
    def one() -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()

    one()  # warm-up: first touches, kernel choice
    start = time.perf_counter()
    for _ in range(steps):
        one()
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--chunk-mb", dest="chunk_mb", type=float, default=64.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the state files go (default: a temp dir "
                    "under the working directory, on its disk)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir or ".") as tmp:
        directory = Path(tmp)
        params = _params(int(args.params))
        grads = [p.grad for p in params]
        numel = sum(p.numel() for p in params)
        state_gb = numel * 12 / 1e9
        print(f"{numel / 1e6:.0f} M parameters, {state_gb:.2f} GB of optimizer state, chunks of "
              f"{args.chunk_mb:.0f} MB, {directory}")
        print("| variant | step s | vs the disk's write+read | GB/s moved |")
        print("| --- | --- | --- | --- |")
        for direct in (True, False):
            floor = disk_floor(directory, numel, args.chunk_mb, direct)
            opt = DiskAdamW(params, path=directory, chunk_mb=args.chunk_mb, direct=direct)
            label = "direct" if opt.direct else "buffered"
            seconds = _step_seconds(opt, params, grads, args.steps)
            opt.close()
            print(f"| disk floor ({label}) | {floor:.2f} | 1.00x | {2 * state_gb / floor:.2f} |")
            print(f"| DiskAdamW ({label}) | {seconds:.2f} | {seconds / floor:.2f}x | "
                  f"{2 * state_gb / seconds:.2f} |")
        aio = deepspeed_aio_floor(directory, numel, args.chunk_mb)
        if aio is not None:
            print(f"| DeepSpeed aio (libaio) write+read | {aio:.2f} | - | "
                  f"{2 * state_gb / aio:.2f} |")
        host = OffloadAdamW(params)
        print(f"| OffloadAdamW (host memory) | {_step_seconds(host, params, grads, args.steps):.2f}"
              f" | - | - |")


if __name__ == "__main__":
    main()
