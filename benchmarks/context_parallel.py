"""Context parallel: one attention layer's step on a split sequence, ours against torch's
``context_parallel`` and against one rank holding the whole sequence, in the same run.

The model is ``--layers`` attention blocks as users write them (a fused QKV projection,
``F.scaled_dot_product_attention(is_causal=True)``, the output projection, a residual); a step is
its forward and backward on ``[1, T, width]``. Rows, per sequence length:

* ``one rank, whole sequence``: what context parallel replaces (every rank runs it; its time is
  one rank's);
* ``ours, ring`` / ``ours, ulysses``: ``parallel.context_parallel.ContextParallel`` over all the
  ranks (balanced head-tail chunks);
* ``torch context_parallel``: ``torch.distributed.tensor.experimental.context_parallel`` over
  the same ranks (its ring over the fused kernels, load-balanced). Its dispatch handles CUDA's
  flash, efficient and cuDNN kernels only, so on another device the row says so and is skipped.

Each cell is the median of interleaved rounds (``timing.py``) and the peak bytes a rank's step
allocates (``torch.accelerator.max_memory_allocated`` on an accelerator, the profiler's tensor
bytes on the host: ``peak_tensor_bytes.py``), with the ratio against torch's row where it ran,
else against one rank's. On an accelerator the layer runs in bf16, on the host in fp32.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/context_parallel.py \\
        --lengths 1024 2048 4096            # the issue's 4096 8192 16384 on a GPU
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from peak_tensor_bytes import PeakTensorBytes
from timing import interleaved_median_ms
from torch import nn

import foundation.device as hd
import parallel
from parallel.context_parallel import ContextParallel


class Attention(nn.Module):
    """A decoder's attention block."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Blocks(nn.Module):
    """``layers`` attention blocks with residuals; ``position_ids`` is taken (and unused) as a
    model's is."""

    def __init__(self, width: int, heads: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attention(width, heads) for _ in range(layers))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def _torch_step(model: nn.Module, x: torch.Tensor) -> Callable[[], object] | str:
    """torch's context parallel step, or why it cannot run here."""
    if hd.resolve("device").type != "cuda":
        return (f"skipped: torch's context_parallel dispatches CUDA's fused attention kernels "
                f"only (this run's device: {hd.resolve('device').type})")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cuda", (dist.get_world_size(),), mesh_dim_names=("cp",))

    def step() -> None:
        local = x.detach().clone()
        with context_parallel(mesh, buffers=[local], buffer_seq_dims=[1]):
            model(local.requires_grad_()).float().square().mean().backward()
    return step


def _peak(step: Callable[[], object]) -> int:
    if hd.has_accelerator():
        hd.synchronize()
        torch.accelerator.reset_peak_memory_stats()
        before = torch.accelerator.memory_allocated()
        step()
        hd.synchronize()
        return torch.accelerator.max_memory_allocated() - before
    with PeakTensorBytes() as peak:
        step()
    return peak.bytes


def run(length: int, width: int, heads: int, layers: int, repeats: int) -> list[str]:
    device = hd.resolve("device")
    dtype = torch.bfloat16 if hd.has_accelerator() else torch.float32
    torch.manual_seed(0)
    model = Blocks(width, heads, layers).to(device, dtype)
    x = torch.randn(1, length, width, device=device, dtype=dtype)
    group = dist.group.WORLD

    def plain(wrapped: nn.Module) -> Callable[[], object]:
        return lambda: wrapped(x).float().square().mean().backward()

    steps: dict[str, Callable[[], object]] = {
        "one rank, whole sequence": plain(model),
        "ours, ring": plain(ContextParallel(model, group, method="ring")),
        "ours, ulysses": plain(ContextParallel(model, group, method="ulysses")),
    }
    peer = _torch_step(model, x)
    rows = []
    if isinstance(peer, str):
        rows.append(f"| {length} | torch context_parallel | {peer} | | | |")
        base = "one rank, whole sequence"
    else:
        steps["torch context_parallel"] = peer
        base = "torch context_parallel"
    times = interleaved_median_ms(steps, repeats, warmup=1)
    peaks = {name: _peak(step) for name, step in steps.items()}
    for name in steps:
        rows.append(f"| {length} | {name} | {times[name]:.1f} | {peaks[name] / 2**20:.1f} | "
                    f"{times[base] / times[name]:.2f}x | {peaks[name] / peaks[base]:.2f}x |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    parallel.init()
    torch.set_num_threads(1)
    rows = [row for length in args.lengths
            for row in run(length, args.width, args.heads, args.layers, args.repeats)]
    if parallel.get_rank() == 0:
        world = parallel.get_world_size()
        print(f"context parallel over {world} ranks, {args.layers} attention blocks of width "
              f"{args.width}, {args.heads} heads, "
              f"device {hd.resolve('device')} ({hd.build_facts()})")
        print("| tokens | step | ms | peak MiB per rank | speed vs base | memory vs base |")
        print("|---|---|---|---|---|---|")
        print("\n".join(rows))
        print("base: torch's context_parallel where it ran, else one rank's whole sequence")
    parallel.destroy()


if __name__ == "__main__":
    main()
