"""Semi-auto parallel (``parallel.shard`` strategies) vs the same Megatron plan hand-written with
torch's ``parallelize_module`` (ColwiseParallel / RowwiseParallel), on a transformer block.

Runs on every rank of a torchrun job. Both copies start from the same weights; each training step
is forward, backward and an AdamW step on the same replicated batch. Rank 0 prints the median
step times, their ratio (goal: <= 1.10) and the largest difference in loss and weights between
the two, which must stay at float32 rounding.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/semi_auto.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/semi_auto.py \
        --d-model 512 --seq 128 --batch 4 --steps 20
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import foundation.device as hd
import parallel


class Block(nn.Module):
    """Pre-LN transformer block; heads are inferred from head_dim so it runs on local shards
    (parallelize_module's default) as well as on global DTensors (semi-auto)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)
        self.attend = F.scaled_dot_product_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (w(h).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        a = self.attend(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.wo(a)
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


def semi_auto(block: Block, mp: int) -> Block:
    """Megatron as strategy tuples: column-parallel q/k/v and fc1, heads split for attention,
    row-parallel wo and fc2 whose partial sums are all-reduced at once (as RowwiseParallel)."""
    for proj in (block.wq, block.wk, block.wv, block.fc1):
        parallel.shard(proj, ((1, 1, 1), (mp, 1)))
    for proj in (block.wo, block.fc2):
        parallel.shard(proj, ((1, 1, mp), (1, mp)), out_strategy=((1, 1, 1),))
    parallel.shard(block.act, ((1, 1, mp),))
    block.attend = parallel.shard(F.scaled_dot_product_attention, ((1, mp, 1, 1),) * 3)
    return parallel.parallelize(block, parallel.ParallelConfig()).model  # split by its tags


def torch_tp(block: Block, world: int) -> Block:
    mesh = init_device_mesh(hd.resolve("device").type, (world,))
    plan = {name: ColwiseParallel() for name in ("wq", "wk", "wv", "fc1")}
    plan.update(wo=RowwiseParallel(), fc2=RowwiseParallel())
    return parallelize_module(block, mesh, plan)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor
               ) -> tuple[float, float]:
    """(milliseconds, loss) of one forward + backward + AdamW step."""
    parallel.barrier()
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    hd.synchronize()
    return (time.perf_counter() - start) * 1e3, loss.item()


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args.add_argument("--d-model", type=int, default=256)
    args.add_argument("--heads", type=int, default=8)
    args.add_argument("--seq", type=int, default=128)
    args.add_argument("--batch", type=int, default=8)
    args.add_argument("--steps", type=int, default=20)
    args.add_argument("--warmup", type=int, default=3)
    cfg = args.parse_args()
    parallel.init()
    rank, world = parallel.get_rank(), parallel.get_world_size()
    device = hd.resolve("device")
    torch.manual_seed(0)
    base = Block(cfg.d_model, cfg.heads).to(device)
    x = torch.randn(cfg.batch, cfg.seq, cfg.d_model, device=device)
    ours, peer = semi_auto(copy.deepcopy(base), world), torch_tp(copy.deepcopy(base), world)
    first_diff = (ours(x) - peer(x)).abs().max().item()
    models = {"ours": ours, "peer": peer}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    ms: dict[str, list[float]] = {"ours": [], "peer": []}
    loss: dict[str, list[float]] = {"ours": [], "peer": []}
    for step in range(cfg.warmup + cfg.steps):  # interleaved, alternating who goes first
        for k in (("ours", "peer") if step % 2 else ("peer", "ours")):
            t, value = train_step(models[k], opts[k], x)
            loss[k].append(value)
            if step >= cfg.warmup:
                ms[k].append(t)
    ours_loss, peer_loss = loss["ours"], loss["peer"]
    loss_diff = max(abs(a - b) for a, b in zip(ours_loss, peer_loss, strict=True))
    weight_diff = max((_full(a) - _full(b)).abs().max().item() for a, b in zip(
        ours.parameters(), peer.parameters(), strict=True))
    if rank == 0:
        o, p = statistics.median(ms["ours"]), statistics.median(ms["peer"])
        print(f"{world} ranks on {device}; block d_model={cfg.d_model} heads={cfg.heads} "
              f"seq={cfg.seq} batch={cfg.batch}; median of {cfg.steps} train steps")
        print("| semi-auto (parallel.shard) ms | parallelize_module ms | ratio | output diff "
              "| max loss diff | max weight diff |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        print(f"| {o:.2f} | {p:.2f} | {o / p:.2f} | {first_diff:.1e} | {loss_diff:.1e} "
              f"| {weight_diff:.1e} |")
    parallel.destroy()


if __name__ == "__main__":
    main()
