"""Pipeline parallel: step time and measured bubble per schedule, next to theory and to torch's
pipelining driven by hand; with 4 ranks also pp × dp against the sum of its parts.

For each schedule and m micro-batches (of 4 samples each), on a GPT of 8 blocks (d_model 256,
sequence 64): our ``parallel.parallelize(..., ParallelConfig(pipeline_degree=P))`` step (median
ms), the
measured bubble (1 - the time a rank spends inside stage forward/backward computations over the
step time, until every rank is done, averaged over ranks), the theoretical bubble of GPipe/1F1B
(p - 1) / (m + p - 1) (interleaved: v·m in place of m), and a hand-written torch pipeline of the
same stages (``PipelineStage`` + the same schedule class, modules deleted by hand) as the peer:
``ours/torch`` is the cost of what we add (tied-weight sums, loss broadcast, checks).

With 4 ranks and pp = 2, also pp × dp: the full step against (the step with the data-parallel
gradient sync skipped + that sync alone).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/pipeline.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/pipeline.py

On a machine with fewer cores than ranks the ranks share cores, so the bubble measured there
includes waiting for a core; the figures in the README say which machine made them.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.distributed.pipelining import PipelineStage

import foundation.device as hd
import parallel
from parallel import ParallelConfig
from parallel.pipeline.schedule import SINGLE, rank_stages, schedule_class

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: recipes
from recipes.gpt import GPT, lm_loss  # noqa: E402

STEPS = int(os.environ.get("BENCH_STEPS", 8))
VOCAB, SEQ, MICRO = 256, 64, 4


def model() -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, d_model=256, n_layer=8, n_head=8, block_size=SEQ)


def data(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of ``m`` micro-batches (inputs, targets), on the device the stages compute on
    (the first stage reads the inputs, the last the targets): host batches fed to device stages
    would be copied inside every timed step."""
    device = hd.resolve("device")
    x = torch.randint(0, VOCAB, (m * MICRO, SEQ))
    return x.to(device), torch.roll(x, -1, 1).to(device)


def _busy_timer(stages: list) -> list[float]:
    """Wrap each stage's compute calls to add their time to the returned cell."""
    busy = [0.0]
    for stage in stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            inner = getattr(stage, name)

            def timed(*args, inner=inner, **kwargs):
                start = time.perf_counter()
                try:
                    return inner(*args, **kwargs)
                finally:
                    busy[0] += time.perf_counter() - start
            setattr(stage, name, timed)
    return busy


def _time(step, busy: list[float]) -> tuple[float, float]:
    """(median step ms, mean bubble over ranks). A step ends when every rank's device work is
    done (synchronize, then the barrier), so a rank that finishes early counts its wait as bubble,
    in ours and torch's alike. On an accelerator the busy time is the host's time issuing stage
    work, so the bubble there is an upper bound."""
    for _ in range(2):
        step()
    hd.synchronize()
    times, bubbles = [], []
    for _ in range(STEPS):
        parallel.barrier()
        busy[0] = 0.0
        start = time.perf_counter()
        step()
        hd.synchronize()  # the step's queued device work is part of the step
        parallel.barrier()
        elapsed = time.perf_counter() - start
        times.append(elapsed * 1e3)
        bubbles.append(1 - busy[0] / elapsed)
    bubble = parallel.collectives.all_reduce(torch.tensor(statistics.median(bubbles)),
                                             op="mean").item()
    return statistics.median(times), bubble


def ours(schedule: str, m: int, pp: int) -> tuple[float, float]:
    pipe = parallel.parallelize(model(), ParallelConfig(pipeline_degree=pp, micro_batches=m,
                                                        schedule=schedule), loss_fn=lm_loss).model
    busy = _busy_timer(pipe.stages)
    x, y = data(m)
    return _time(lambda: pipe.step(x, target=y), busy)


def by_hand(schedule: str, m: int, pp: int) -> tuple[float, float]:
    """torch's pipelining as a user writes it: delete other stages' modules, wrap, schedule."""
    mesh = parallel.mesh.parallel_mesh(ParallelConfig(pipeline_degree=pp).resolve(pp))
    group, rank = mesh["pp"].get_group(), mesh["pp"].get_local_rank()
    virtual = 1 if schedule in SINGLE else 2
    n = pp * virtual
    stages = []
    for s in rank_stages(schedule, rank, pp, 2):
        net = model()
        keep = range(s * 8 // n, (s + 1) * 8 // n)
        net.blocks = torch.nn.ModuleList(net.blocks[i] for i in keep)
        if s > 0:
            net.tok_emb = net.pos_emb = None
        if s < n - 1:
            net.lm_head = net.ln_f = None

        class Logits(torch.nn.Module):
            def __init__(self, net: GPT) -> None:
                super().__init__()
                self.net = net

            def forward(self, x):
                out = self.net(x)
                return out[0] if isinstance(out, tuple) else out
        stages.append(PipelineStage(Logits(net), s, n, hd.resolve("device"), group=group))
    cls = schedule_class(schedule)
    sched = cls(stages[0] if schedule in SINGLE else stages, n_microbatches=m, loss_fn=lm_loss)
    busy = _busy_timer(stages)
    x, y = data(m)
    losses: list = []

    def step() -> None:
        if rank == 0:
            sched.step(x, target=y, losses=losses)
        else:
            sched.step(target=y, losses=losses)
    return _time(step, busy)


def theory(schedule: str, m: int, pp: int) -> float:
    v = 1 if schedule in SINGLE else 2
    return (pp - 1) / (v * m + pp - 1)


def pp_dp() -> tuple[float, float, float]:
    """(full pp×dp step, step without the dp sync, the dp sync alone), ms."""
    pipe = parallel.parallelize(model(), ParallelConfig(pipeline_degree=2, micro_batches=4),
                                loss_fn=lm_loss).model
    dp = pipe.data_parallel
    x, y = data(4)  # this replica's batch: 4 micro-batches of 4 samples
    full, _ = _time(lambda: pipe.step(x, target=y), [0.0])
    sync = dp.sync_gradients
    dp.sync_gradients = lambda: None
    alone, _ = _time(lambda: pipe.step(x, target=y), [0.0])
    dp.sync_gradients = sync
    reduce_only, _ = _time(sync, [0.0])
    return full, alone, reduce_only


def main() -> None:
    parallel.init()
    torch.set_num_threads(1)
    pp = parallel.get_world_size() if parallel.get_world_size() <= 2 else 2
    rows = []
    if parallel.get_world_size() == pp:
        for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zbv"):
            for m in (4, 8, 16):
                (t_ours, b_ours), (t_torch, b_torch) = ours(schedule, m, pp), by_hand(schedule,
                                                                                       m, pp)
                rows.append(f"| {pp} | {schedule} | {m} | {t_ours:.1f} | {100 * b_ours:.1f}% | "
                            f"{100 * theory(schedule, m, pp):.1f}% | {t_torch:.1f} | "
                            f"{100 * b_torch:.1f}% | {t_ours / t_torch:.2f}× |")
    else:
        full, alone, sync = pp_dp()
        rows.append(f"pp×dp (pp=2, dp=2): step {full:.1f} ms; without the dp sync {alone:.1f} ms "
                    f"+ the sync alone {sync:.1f} ms = {alone + sync:.1f} ms; ratio "
                    f"{full / (alone + sync):.2f}")
    if parallel.get_rank() == 0:
        if parallel.get_world_size() == pp:
            print("| ranks | schedule | m | ours ms | bubble | theory | torch by hand ms | "
                  "bubble | ours/torch |")
            print("|---|---|---|---|---|---|---|---|---|")
        print("\n".join(rows))
    parallel.destroy()


if __name__ == "__main__":
    main()
