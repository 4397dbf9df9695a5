"""The memory hierarchy's cost: each offload setting against none and against FSDP2's
``CPUOffloadPolicy``, on the same GPT in one process.

    python benchmarks/offload_memory.py                 # the README's table (CPU: ~2 minutes)
    python benchmarks/offload_memory.py --layers 4      # smaller

For each setting it prints the median step time over interleaved rounds (forward, backward,
AdamW step; every variant runs once per round, so a drifting load hits all alike) and its ratio
to no offload, the peak bytes of weights on the device, and the activation bytes the device keeps
between forward and backward:

* ``none``: everything on the device;
* ``params=host``: :class:`hetero.offload.ParamOffload` (weights rest in host memory, one layer
  ahead on the device);
* ``activations=host``: every block's saved tensors in host memory
  (``parallel.recompute(block, "offload")``), next to ``recompute=full`` for comparison;
* ``optimizer=host ratio=0.5``: :class:`hetero.optim.OffloadAdamW` with half the state on the
  host;
* FSDP2 ``CPUOffloadPolicy`` on a one-rank mesh, every block a unit (torch's peer of
  parameter offload).

Every variant uses ``torch.optim.AdamW`` over the parameters as they are after set-up except the
ratio row (which is the optimizer), so the step-time ratio is the offload runtime's own cost.

Without an accelerator "device" and "host" are the same memory and no link separates them: the
step ratio then measures the runtime's bookkeeping and copies, and the device bytes are the
runtime's own counts (``ParamOffload.peak_device_bytes``; activations: the bytes a forward leaves
alive, ``benchmarks/held_bytes.py``, less the offloader's host copies). On an accelerator the
device figures are ``torch.accelerator.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import foundation.device as hd
import parallel
from hetero.offload import OffloadPolicy, apply_offload

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: recipes
sys.path.insert(0, str(Path(__file__).resolve().parent))
from held_bytes import HeldBytes  # noqa: E402
from timing import interleaved_median_ms  # noqa: E402

from recipes.gpt import GPT  # noqa: E402

LR = 1e-4


def _model(args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    return GPT(args.vocab, args.d_model, args.layers, args.heads, args.seq)


def _batch(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    device = hd.resolve("device")
    return x.to(device), torch.roll(x, -1, dims=1).to(device)


class Variant:
    """One setting: its step and what it keeps on the device."""

    def __init__(self, args: argparse.Namespace, name: str) -> None:
        self.name = name
        device = hd.resolve("device")
        model = _model(args)
        self.offload = None
        self.activations = None
        if name == "fsdp2 CPUOffloadPolicy":
            from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

            mesh = parallel.mesh.batch_mesh(parallel.ParallelConfig(data_degree=1))
            policy = CPUOffloadPolicy(pin_memory=hd.can_pin())
            for block in model.blocks:
                fully_shard(block, mesh=mesh, offload_policy=policy)
            fully_shard(model, mesh=mesh, offload_policy=policy)
        elif name.startswith("recompute"):
            parallel.recompute_layers(model.to(device), "blocks.*", "full")
        else:
            policy = {"none": OffloadPolicy(),
                      "params=host": OffloadPolicy(params="host", optimizer="host"),
                      "activations=host": OffloadPolicy(activations="host"),
                      "optimizer=host ratio=0.5": OffloadPolicy(optimizer="host", ratio=0.5),
                      }[name]
            if policy.params != "host":
                model.to(device)
            done = apply_offload(model, policy)
            self.offload, self.activations = done.params, done.activations
            if policy.optimizer == "host" and policy.params == "device":
                self.opt: torch.optim.Optimizer = done.optimizer(model.parameters(), lr=LR)
        if not hasattr(self, "opt"):
            self.opt = torch.optim.AdamW(model.parameters(), lr=LR)
        self.model = model
        self.weights = sum(p.numel() * p.element_size() for p in model.parameters())

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        _, loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def device_bytes(self, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
        """(peak weight bytes on the device, activation bytes kept from forward to backward)."""
        if hd.has_accelerator():
            hd.synchronize()
            torch.accelerator.reset_peak_memory_stats()
            before = torch.accelerator.memory_allocated()
            _, loss = self.model(x, y)
            held = torch.accelerator.memory_allocated() - before
            loss.backward()
            self.opt.zero_grad(set_to_none=True)
            return torch.accelerator.max_memory_allocated() - before, held
        if self.offload is not None:
            self.offload.reset_peak()
        tracker = HeldBytes()
        with tracker:
            _, loss = self.model(x, y)
        held = tracker.held()
        if self.activations is not None:
            held -= self.activations.host_bytes()
        if self.offload is not None:
            held -= self.offload.device_bytes  # the root, kept for backward: weights, not acts
        loss.backward()
        self.opt.zero_grad(set_to_none=True)
        if self.offload is not None:
            return self.offload.peak_device_bytes, held
        return self.weights, held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", dest="d_model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    parallel.init()
    names = ["none", "params=host", "fsdp2 CPUOffloadPolicy", "activations=host",
             "recompute=full", "optimizer=host ratio=0.5"]
    variants = {name: Variant(args, name) for name in names}
    x, y = _batch(args)
    steps: dict[str, Callable[[], None]] = {
        name: (lambda v=v: v.step(x, y)) for name, v in variants.items()}
    times = interleaved_median_ms(steps, args.repeats, warmup=2)
    params = sum(p.numel() for p in variants["none"].model.parameters())
    print(f"GPT {params / 1e6:.1f} M parameters, {args.layers} layers, batch {args.batch} x "
          f"{args.seq}, {hd.resolve('device')}, median of {args.repeats} interleaved rounds")
    print("| setting | step ms | vs none | weights on device MB | activations kept MB |")
    print("| --- | --- | --- | --- | --- |")
    for name, v in variants.items():
        if name.startswith("fsdp2") and not hd.has_accelerator():
            # its forward allocates its own unsharded weights, which the CPU meter cannot tell
            # from activations: device figures come from an accelerator's allocator only
            shown = ["n/a on CPU"] * 2
        else:
            shown = [f"{b / 2**20:.1f}" for b in v.device_bytes(x, y)]
        print(f"| {name} | {times[name]:.0f} | {times[name] / times['none']:.2f}x | "
              f"{shown[0]} | {shown[1]} |")
    ratio = {name: times[name] / times["none"] for name in times}
    print(f"summary: step vs none: params=host {ratio['params=host']:.2f}x (FSDP2 "
          f"CPUOffloadPolicy {ratio['fsdp2 CPUOffloadPolicy']:.2f}x), activations=host "
          f"{ratio['activations=host']:.2f}x (recompute=full {ratio['recompute=full']:.2f}x)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
