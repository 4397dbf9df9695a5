"""Models larger than one rank: per-rank host memory of a GPT trained with optimizer parallel
level3 and deferred initialization, against its full training state / N; and the activation
memory of the recipe GPT with recompute none / selective / full.

A GPT of ``--params`` parameters is built on the meta device on each of ``--ranks`` spawned gloo
ranks, given to ``parallel.parallelize`` with ``optimizer_level="level3"`` (FSDP2 shards it by
shapes, then each rank allocates and fills only its shards) and trained ``--steps`` AdamW steps.
Its full fp32 training state is 16 B per parameter (weights, gradients, Adam's two moments), so
a rank's share is ``16 P / N``. Per rank the table gives the peak RSS during set-up
(``parallelize``) and during the steps (sampled by a thread: ``peak_rss.py``), and
``(step peak - overhead) / (state / N)``: the goal is at most 1.3. The overhead is the runtime's
fixed cost (Python, torch, the process group, FSDP2's machinery), measured as the step peak of
the same run with a tiny model (``--params 2e5``) in fresh ranks just before.

The activation rows run the recipe GPT (``conf/model/gpt.yaml``: d_model 192, 4 blocks,
sequences of 64, a batch of 32, a 65-token vocabulary) in one process: the bytes its forward
leaves alive for backward (``held_bytes.py``) with each ``trainer.recompute`` mode.

    python benchmarks/memory_scale.py                      # 150 M parameters on 4 ranks
    python benchmarks/memory_scale.py --params 6.5e8       # 650 M: 10.4 GB of state
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from held_bytes import HeldBytes  # noqa: E402
from peak_rss import PeakRSS  # noqa: E402
from ports import free_port  # noqa: E402

import parallel  # noqa: E402
from foundation.device import ACCELERATOR_ENV  # noqa: E402
from recipes.gpt import GPT  # noqa: E402

GIB, TINY = 2**30, 2e5


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ValueError naming the flag for a size that cannot be built."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=1.5e8, help="parameters of the GPT")
    p.add_argument("--ranks", type=int, default=4, help="gloo ranks to spawn")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=50304, help="GPT-2's, padded to 64")
    args = p.parse_args(argv)
    for flag in ("params", "ranks", "steps", "batch", "seq", "vocab"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    return args


def shape(params: float, vocab: int) -> tuple[int, int, int]:
    """(d_model, n_layer, n_head) of a GPT of about ``params`` parameters: 12 d^2 per block,
    heads of 64, 24 blocks from 200 M up (GPT-2 medium's depth), fewer below."""
    layers = 24 if params >= 2e8 else 12 if params >= 2e7 else 2
    # 12 L d^2 + vocab d = params (the tied embedding counted once)
    d = (math.sqrt(vocab**2 + 48 * layers * params) - vocab) / (24 * layers)
    d_model = max(64, 64 * round(d / 64))
    return d_model, layers, d_model // 64


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, params: float,
              results: mp.SimpleQueue) -> None:
    """One rank: build on meta, parallelize (level3, deferred init), train; report peaks."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    os.environ[ACCELERATOR_ENV] = "none"  # gloo ranks on the host, also on a GPU machine
    torch.set_num_threads(1)
    parallel.init()
    d_model, layers, heads = shape(params, args.vocab)
    with torch.device("meta"):
        model = GPT(args.vocab, d_model, layers, heads, args.seq)
    count = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    config = parallel.ParallelConfig(enable_parallel_optimizer=True, optimizer_level="level3",
                                     parallel_optimizer_threshold=0)
    start = time.perf_counter()
    with PeakRSS() as setup:
        model = parallel.parallelize(model, config, init_seed=0).model
    setup_s = time.perf_counter() - start
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator().manual_seed(rank)
    start = time.perf_counter()
    with PeakRSS() as step:
        for _ in range(args.steps):
            x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
            _, loss = model(x, torch.roll(x, -1, dims=1))
            loss.backward()
            opt.step()
            opt.zero_grad()
    results.put((rank, {"params": count, "setup": setup.base + setup.bytes,
                        "setup_above": setup.bytes, "largest": largest,
                        "step": step.base + step.bytes, "setup_s": setup_s,
                        "step_s": (time.perf_counter() - start) / args.steps,
                        "shape": (d_model, layers, heads)}))
    parallel.destroy()


def spawn(args: argparse.Namespace, params: float) -> list[dict]:
    """``rank_main`` on ``args.ranks`` fresh processes; their reports in rank order. A rank that
    fails stops the others (they would wait for it until the store's timeout)."""
    port = free_port()  # not the kernel's bind(0): a port another job's gloo may take meanwhile
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited: one thread per rank
    # glibc keeps freed blocks under its (adaptive, up to 32 MB) mmap threshold in its arenas, so
    # RSS would count memory the ranks freed long ago; a fixed threshold returns large tensors'
    # pages at once, as an accelerator's caching allocator would report them
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=rank_main, args=(r, args.ranks, port, args, params, results))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    while any(p.exitcode is None for p in procs):
        if any(p.exitcode for p in procs):
            for p in procs:
                p.terminate()
        time.sleep(0.1)
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    return [report for _, report in sorted(results.get() for _ in procs)]


def activations(modes: tuple[str, ...] = ("none", "selective", "full")) -> dict[str, int]:
    """Bytes the recipe GPT's forward leaves for backward, per recompute mode (one process)."""
    held = {}
    for mode in modes:
        torch.manual_seed(0)
        model = GPT(65, 192, 4, 6, 64)
        parallel.recompute_layers(model, "blocks.*", mode)
        x = torch.randint(0, 65, (32, 64), generator=torch.Generator().manual_seed(1))
        with HeldBytes() as tracker:
            _, loss = model(x, torch.roll(x, -1, dims=1))
        held[mode] = tracker.held()
        loss.backward()
    return held


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    tiny = spawn(args, TINY)
    overhead = max(r["step"] for r in tiny)
    reports = spawn(args, args.params)
    count, (d_model, layers, heads) = reports[0]["params"], reports[0]["shape"]
    share = 16 * count / args.ranks
    print(f"GPT {count / 1e6:.0f} M parameters (d_model {d_model}, {layers} blocks, {heads} "
          f"heads, vocab {args.vocab}), optimizer parallel level3, deferred init, "
          f"{args.ranks} gloo ranks, {args.steps} steps of {args.batch}x{args.seq} per rank")
    print(f"full training state {16 * count / GIB:.2f} GiB; state / N = {share / GIB:.2f} GiB; "
          f"runtime overhead = {overhead / GIB:.2f} GiB (the step peak of a "
          f"{tiny[0]['params'] / 1e6:.1f} M-parameter GPT, same vocab and batch)")
    print(f"{'rank':>4} {'set-up peak':>12} {'step peak':>10} {'(step-ovh)/(state/N)':>21} "
          f"{'set-up s':>9} {'s/step':>7}")
    for rank, r in enumerate(reports):
        print(f"{rank:>4} {r['setup'] / GIB:>10.2f} G {r['step'] / GIB:>8.2f} G "
              f"{(r['step'] - overhead) / share:>21.2f} {r['setup_s']:>9.1f} {r['step_s']:>7.1f}")
    setup = max(r["setup_above"] for r in reports)
    print(f"set-up (parallelize): at most {setup / GIB:.2f} GiB above a rank's RSS before it; "
          f"its weights / N = {4 * count / args.ranks / GIB:.2f} GiB, one (largest) tensor "
          f"{reports[0]['largest'] / GIB:.2f} GiB")
    worst = max((r["step"] - overhead) / share for r in reports)
    print(f"goal step peak <= 1.3 x state/N + overhead: {'met' if worst <= 1.3 else 'MISSED'} "
          f"(worst {worst:.2f})")
    held = activations()
    print("\nrecipe GPT activations held for backward (d_model 192, 4 blocks, batch 32 x 64)")
    print(f"{'recompute':>10} {'MiB':>8} {'x none':>7}")
    for mode, n in held.items():
        print(f"{mode:>10} {n / 2**20:>8.2f} {n / held['none']:>7.2f}")


if __name__ == "__main__":
    main()
