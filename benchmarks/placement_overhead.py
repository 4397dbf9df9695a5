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


def _one_step_ms(model: torch.nn.Module, idx: torch.Tensor) -> float:
    hd.synchronize()
    start = time.perf_counter()
    _, loss = model(idx, idx)
    loss.backward()
    hd.synchronize()
    model.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) * 1e3


def _interleaved_ms(models: dict[str, torch.nn.Module], idx: torch.Tensor,
                    steps: int) -> dict[str, float]:
    """Median step time of each model, the models taking turns step by step so that drift in
    the machine's load hits them all alike."""
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(steps + 3):
        for name, model in models.items():
            ms = _one_step_ms(model, idx)
            if i >= 3:  # warm-up: capture, allocator, first kernels
                times[name].append(ms)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    dev = hd.resolve("device")
    torch.manual_seed(0)
    base = GPT(vocab_size=64, d_model=192, n_layer=4, n_head=6, block_size=64, dropout=0.0)
    idx = torch.randint(0, 64, (args.batch, 64), device=dev)

    untagged = hetero.place(copy.deepcopy(base).to(dev), (idx, idx))
    tagged = copy.deepcopy(base).to(dev)
    hetero.set_device(tagged.tok_emb, "cpu")
    tagged = hetero.place(tagged, (idx, idx))
    models = {"unplaced": copy.deepcopy(base).to(dev), "placed, no tags": untagged,
              "placed, tok_emb on cpu": tagged}
    ms = _interleaved_ms(models, idx, args.steps)
    plain_ms = ms.pop("unplaced")
    rows = [(name, len(models[name].plan), t) for name, t in ms.items()]

    print(f"GPT 1.8M params, batch {args.batch}x64, device {dev}, torch threads "
          f"{torch.get_num_threads()}; median of {args.steps} fwd+bwd steps")
    print(f"{'model':<26} {'partitions':>10} {'ms':>8} {'unplaced ms':>12} {'ratio':>6}")
    for name, parts, ms in rows:
        print(f"{name:<26} {parts:>10} {ms:>8.2f} {plain_ms:>12.2f} {ms / plain_ms:>6.3f}")
    if not hd.has_accelerator():
        print("no GPU available: the embedding-on-CPU vs all-on-GPU comparison needs one")


if __name__ == "__main__":
    main()
