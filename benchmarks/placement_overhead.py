"""What ``hetero.place`` costs: forward + backward of a placed GPT vs the same model unplaced.

On a host-only machine nothing really crosses devices ("device" is the CPU), so the ratio is the
runtime's own overhead: partition dispatch, the boundary copies' no-op checks, the host worker
thread. Two placements are timed: no tags (one partition) and the token embedding on the CPU
(three partitions, one on the worker thread). With a GPU present it also times the embedding on
the CPU against everything on the GPU, the cost of the real host round trip.

    python benchmarks/placement_overhead.py [--steps 30] [--batch 16]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

import hetero
import hetero.device as hd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
from gpt import GPT  # noqa: E402


def _step_ms(model: torch.nn.Module, idx: torch.Tensor, steps: int) -> float:
    times = []
    for i in range(steps + 3):
        hd.synchronize()
        start = time.perf_counter()
        _, loss = model(idx, idx)
        loss.backward()
        hd.synchronize()
        if i >= 3:  # warm-up: capture, allocator, first kernels
            times.append((time.perf_counter() - start) * 1e3)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    dev = hd.resolve("device")
    torch.manual_seed(0)
    base = GPT(vocab_size=64, d_model=192, n_layer=4, n_head=6, block_size=64, dropout=0.0)
    idx = torch.randint(0, 64, (args.batch, 64), device=dev)

    rows = []
    plain = copy.deepcopy(base).to(dev)
    plain_ms = _step_ms(plain, idx, args.steps)
    untagged = hetero.place(copy.deepcopy(base).to(dev), (idx, idx))
    rows.append(("placed, no tags", len(untagged.plan), _step_ms(untagged, idx, args.steps)))
    tagged = copy.deepcopy(base).to(dev)
    hetero.set_device(tagged.tok_emb, "cpu")
    tagged = hetero.place(tagged, (idx, idx))
    rows.append(("placed, tok_emb on cpu", len(tagged.plan), _step_ms(tagged, idx, args.steps)))

    print(f"GPT 1.8M params, batch {args.batch}x64, device {dev}, torch threads "
          f"{torch.get_num_threads()}; median of {args.steps} fwd+bwd steps")
    print(f"{'model':<26} {'partitions':>10} {'ms':>8} {'unplaced ms':>12} {'ratio':>6}")
    for name, parts, ms in rows:
        print(f"{name:<26} {parts:>10} {ms:>8.2f} {plain_ms:>12.2f} {ms / plain_ms:>6.3f}")
    if not hd.has_accelerator():
        print("no GPU available: the embedding-on-CPU vs all-on-GPU comparison needs one")


if __name__ == "__main__":
    main()
