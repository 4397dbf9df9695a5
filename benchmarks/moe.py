"""MoE layer (``parallel.nn.MoE`` under expert parallel) vs a dense FFN of equal active
parameters and vs DeepSpeed's MoE layer, and the exposed all-to-all time with 1, 2 and 4 copies.

Every rank feeds ``TOKENS`` tokens of width ``D``; the MoE has ``E`` experts of hidden size
``F``, top-2 routing, capacity factor 1.1, experts sharded over all ranks (``ep`` = world). Rank 0
prints, per variant, the median time of one forward + backward of the layer and its ratio to
ours (copies=1); the variants run in turns, one step of each per round:

* ``dense FFN``: one MLP of hidden ``2 · F`` (the parameters a token meets under top-2), no
  communication — the compute floor the MoE's routing and exchanges are added to;
* ``DeepSpeed MoE``: ``deepspeed.moe.layer.MoE`` with the same experts, ``k=2``, the same
  capacity factor, ``ep_size`` = world (its dense ``[E, capacity, D]`` dispatch by einsum);
* ``ours, copies=c``: ``parallel.multi_copy`` splitting the expert work in ``c`` copies.

Exposed communication is the time the training stream spends waiting in ``wait_tensor`` for the
layer's collectives (``stream_waits.py``: device events around each wait on an accelerator, where
the host does not block; the host's wait time on the host): in the forward, where the copies
overlap the all-to-alls with expert compute, and in forward + backward (the backward's exchanges
are not overlapped).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/moe.py
"""

from __future__ import annotations

import copy
import os
import statistics
from collections.abc import Callable

import stream_waits
import torch
import torch.distributed as dist
from timing import interleaved_median_ms
from torch import nn

import foundation.device as hd
import parallel
from parallel import ParallelConfig
from parallel.nn import MoE

D, F, E, TOP_K, CAPACITY = 256, 1024, 4, 2, 1.1
TOKENS = int(os.environ.get("BENCH_TOKENS", 4096))
REPEATS = int(os.environ.get("BENCH_STEPS", 10))


def forward_of(layer: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    return lambda: layer(x)


def step_of(layer: nn.Module, x: torch.Tensor, unpack: bool = False) -> Callable[[], None]:
    def step() -> None:
        out = layer(x)
        if unpack:  # DeepSpeed returns (output, aux loss, expert counts)
            out, aux, _ = out
            (out.square().mean() + aux).backward()
        else:
            aux = getattr(layer, "aux_loss", None)
            (out.square().mean() + (aux if aux is not None else 0)).backward()
        layer.zero_grad(set_to_none=True)
    return step


def exposed_ms(step: Callable[[], None]) -> float:
    """Median ms per call the training stream spends waiting for the functional collectives
    (``stream_waits``: device events on an accelerator, host wait time on the host)."""
    step()  # warm
    hd.synchronize()
    per_call = []
    for _ in range(REPEATS):
        parallel.barrier()
        per_call.append(stream_waits.exposed_ms(step))
    return statistics.median(per_call)


def deepspeed_layer(world: int) -> nn.Module | None:
    """DeepSpeed's MoE layer of the same shape and settings, or None where it is missing."""
    try:
        import deepspeed
        from deepspeed.moe.layer import MoE as DeepSpeedMoE
    except ImportError:
        return None
    deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    expert = nn.Sequential(nn.Linear(D, F, bias=False), nn.GELU(), nn.Linear(F, D, bias=False))
    layer = DeepSpeedMoE(D, expert, num_experts=E, ep_size=world, k=TOP_K,
                         capacity_factor=CAPACITY, eval_capacity_factor=CAPACITY,
                         min_capacity=0, use_rts=False).to(hd.resolve("device"))
    layer.set_deepspeed_parallelism()
    return layer


def main() -> None:
    parallel.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = hd.resolve("device")
    torch.manual_seed(0)
    reference = MoE(D, F, E, top_k=TOP_K, capacity_factor=CAPACITY).to(device)
    x = torch.randn(TOKENS, D, device=device)
    steps: dict[str, Callable[[], None]] = {}
    forwards: dict[str, Callable[[], None]] = {}
    for copies in (1, 2, 4):
        layer = copy.deepcopy(reference)
        model = parallel.parallelize(
            layer, ParallelConfig(expert_degree=world, multi_copy=copies)).model
        steps[f"ours, copies={copies}"] = step_of(model, x)
        forwards[f"ours, copies={copies}"] = forward_of(model, x)
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(D, TOP_K * F), nn.GELU(), nn.Linear(TOP_K * F, D)).to(device)
    steps = {"dense FFN (2·F hidden)": step_of(dense, x), **steps}
    ds = deepspeed_layer(world)
    if ds is not None:
        # its all-to-alls are synchronous (torch.distributed.all_to_all_single + wait): all of
        # their time is exposed, and not separable as waits by this measure
        steps["DeepSpeed MoE"] = step_of(ds, x.view(1, TOKENS, D), unpack=True)
    ms = interleaved_median_ms(steps, REPEATS)  # in turns: a drifting load hits all alike
    ours = {c: ms[f"ours, copies={c}"] for c in (1, 2, 4)}
    rows = [(name, value, *((exposed_ms(forwards[name]), exposed_ms(steps[name]))
                            if name in forwards else (None, None)))
            for name, value in ms.items()]
    if rank == 0:
        print(f"MoE layer fwd+bwd, {world} ranks (ep={world}), {TOKENS} tokens/rank, d={D}, "
              f"d_ff={F}, E={E}, top-{TOP_K}, capacity {CAPACITY}, device {device.type}")
        print(f"{'variant':<24}{'ms/step':>10}{'vs ours':>9}{'exposed fwd ms':>16}"
              f"{'exposed fwd+bwd ms':>20}")
        for name, ms, forward, both in rows:
            shown = [f"{v:.1f}" if v is not None else "-" for v in (forward, both)]
            print(f"{name:<24}{ms:>10.1f}{ms / ours[1]:>8.2f}×{shown[0]:>16}{shown[1]:>20}")
    parallel.destroy()


if __name__ == "__main__":
    main()
