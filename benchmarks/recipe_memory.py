"""The recipe keeps the library's memory: per-rank peak RSS of ``recipes/train.py`` training a GPT
under optimizer parallel level3, against the same model through the library
(``benchmarks/memory_scale.py``'s ranks), both as ``(peak - overhead) / (state / N)``.

The recipe runs the way a user starts it (``torchrun recipes/train.py``, its data, loggers and
final checkpoint), once with the default ``model.init_device=auto`` (deferred init) and once with
``model.init_device=device`` (each rank builds the whole model first); each rank's RSS is sampled
from outside every 20 ms. Its overhead is the peak of the same recipe with a tiny GPT, as the
library's is (``memory_scale.py``). The library's ranks pin glibc's mmap threshold through the
environment; the recipe pins it itself (``foundation/host_allocator.py``). Before that the recipe's
ranks kept the pages of the whole model they had freed after sharding.

    python benchmarks/recipe_memory.py                    # 150 M parameters on 4 ranks
    python benchmarks/recipe_memory.py --params 4.5e8     # the issue's 453 M
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import memory_scale  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GIB, TINY = 2**30, 2e5


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=1.5e8, help="parameters of the GPT")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seq", type=int, default=64, help="the recipe's data.seq_len")
    args = p.parse_args(argv)
    for flag in ("params", "ranks", "steps", "seq"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    return args


def _rank_rss(agent: psutil.Process) -> dict[int, int]:
    """RSS of each rank process under a torchrun agent, by its RANK."""
    out = {}
    for child in agent.children(recursive=True):
        try:
            rank = child.environ().get("RANK")
            if rank is not None and child.name().startswith("python"):
                out[int(rank)] = child.memory_info().rss
        except psutil.Error:  # a rank that just ended
            continue
    return out


def recipe_peaks(args: argparse.Namespace, params: float, init: str, vocab: int) -> list[int]:
    """Each rank's peak RSS through ``torchrun recipes/train.py`` with a GPT of ``params``."""
    d_model, layers, heads = memory_scale.shape(params, vocab)
    with tempfile.TemporaryDirectory() as run:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.ranks}", str(ROOT / "recipes" / "train.py"),
               f"model.d_model={d_model}", f"model.n_layer={layers}", f"model.n_head={heads}",
               f"model.block_size={args.seq}", f"data.seq_len={args.seq}",
               f"data.global_batch_size={args.ranks}", f"trainer.max_steps={args.steps}",
               "trainer.progress_bar=false", "trainer.log_every=1", f"model.init_device={init}",
               "parallel.enable_parallel_optimizer=true", "parallel.optimizer_level=level3",
               "parallel.parallel_optimizer_threshold=0", f"hydra.run.dir={run}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("MALLOC_MMAP_THRESHOLD_", None)  # the recipe's own setting is measured
        agent = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
        parent, peaks = psutil.Process(agent.pid), {}
        while agent.poll() is None:
            for rank, rss in _rank_rss(parent).items():
                peaks[rank] = max(peaks.get(rank, 0), rss)
            time.sleep(0.02)
        if agent.returncode:
            raise RuntimeError(f"the recipe failed ({agent.returncode}): "
                               f"{agent.stderr.read()[-2000:] if agent.stderr else ''}")
    return [peaks[r] for r in sorted(peaks)]


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    vocab = 40  # the recipe's character vocabulary (data=grammar), for both
    lib = memory_scale.parse([f"--params={args.params}", f"--ranks={args.ranks}",
                              f"--steps={args.steps}", f"--seq={args.seq}", "--batch=1",
                              f"--vocab={vocab}"])
    lib_overhead = max(r["step"] for r in memory_scale.spawn(lib, TINY))
    reports = memory_scale.spawn(lib, args.params)
    count = reports[0]["params"]
    share = 16 * count / args.ranks
    rows = [("library (parallelize, meta)", [r["step"] for r in reports], lib_overhead)]
    for init in ("auto", "device"):
        overhead = max(recipe_peaks(args, TINY, init, vocab))
        rows.append((f"recipe, model.init_device={init}",
                     recipe_peaks(args, args.params, init, vocab), overhead))
    print(f"GPT {count / 1e6:.0f} M parameters, optimizer parallel level3, {args.ranks} gloo "
          f"ranks, {args.steps} steps of 1x{args.seq} per rank; state / N = "
          f"{share / GIB:.2f} GiB")
    print(f"{'path':<32} {'overhead':>9} {'peak per rank (GiB)':>28} {'(peak-ovh)/(state/N)':>21}")
    for name, peaks, overhead in rows:
        ratio = max(p - overhead for p in peaks) / share
        print(f"{name:<32} {overhead / GIB:>7.2f} G {' '.join(f'{p / GIB:.2f}' for p in peaks):>28}"
              f" {ratio:>21.2f}")


if __name__ == "__main__":
    main()
