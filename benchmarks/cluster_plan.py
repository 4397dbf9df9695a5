"""The cluster planner against the Megatron-LM weak-scaling table (Narayanan et al., SC21,
Table 1: A100 80 GB, 8 per node, seq 2048, vocab 51200, mixed precision, full activation
recompute).

For each row: the published layout priced by ``price_cluster_plan`` (its TFLOP/s per GPU against
the published figure, and whether it fits 80 GB), the layout ``plan_cluster`` chooses for the
same model, cluster and batch (its priced speed-up over the published layout), and the planning
time end to end — the recipe GPT of the row's size built on the meta device, its shape read,
every layout priced, then the per-operator strategies searched on the plan's tensor group (one
micro-batch captured, its repeated layers once; recursive programming priced on the cluster):
the modules it tensor-shards, and its capture and search seconds.

The second table is Korthikanti et al. (2022, "Reducing Activation Recomputation in Large
Transformer Models", Tables 3 and 5: A100 80 GB, seq 2048, vocab 51200, one pipeline of each
model): every model's iteration time with full recompute, and with selective recompute plus
sequence parallel ("present work"), each priced as published (the second with
``sequence_parallel=True``: at 530 B and 1 T the selective layout fits 80 GB only so), and the
layout ``plan_cluster(sequence_parallel=True)`` chooses, against the faster published one.

    python benchmarks/cluster_plan.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.auto import ClusterSpec, plan_cluster, price_cluster_plan  # noqa: E402
from recipes.gpt import GPT  # noqa: E402

#: billions of parameters, heads, hidden, layers, tensor, pipeline, GPUs, batch, TFLOP/s per GPU
MEGATRON_TABLE = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)
SEQ, VOCAB = 2048, 51200
#: billions, heads, hidden, layers, tensor, pipeline, GPUs, global batch, micro-batch size,
#: iteration seconds with full recompute, with selective recompute + sequence parallel
KORTHIKANTI_TABLE = (
    (22, 64, 6144, 48, 8, 1, 8, 4, 4, 1.42, 1.10),
    (175, 96, 12288, 96, 8, 8, 64, 64, 1, 18.13, 13.75),
    (530, 128, 20480, 105, 8, 35, 280, 280, 1, 49.05, 37.83),
    (1000, 160, 25600, 128, 8, 64, 512, 512, 1, 94.42, 71.49),
)


def _meta_gpt(heads: int, hidden: int, layers: int) -> tuple[torch.nn.Module, tuple]:
    with torch.device("meta"):
        model = GPT(VOCAB, hidden, layers, heads, block_size=SEQ)
    return model, (torch.zeros(1, SEQ, dtype=torch.long, device="meta"),)


def rows() -> list[dict]:
    out = []
    for size, heads, hidden, layers, tensor, pipeline, gpus, batch, published in MEGATRON_TABLE:
        cluster = ClusterSpec.preset("a100-80gb", nodes=gpus // 8)
        start = time.perf_counter()
        model, example = _meta_gpt(heads, hidden, layers)
        plan = plan_cluster(model, example, cluster=cluster, global_batch=batch)
        seconds = time.perf_counter() - start
        given = price_cluster_plan(model, example, cluster=cluster, global_batch=batch,
                                   tensor=tensor, pipeline=pipeline, recompute="full")
        out.append(dict(size=size, gpus=gpus, published=published, given=given, plan=plan,
                        seconds=seconds, tensor=tensor, pipeline=pipeline))
    return out


def korthikanti_rows() -> list[dict]:
    """Each Korthikanti et al. model: its two published runs priced, and the plan."""
    out = []
    for size, heads, hidden, layers, t, p, gpus, batch, micro, full, selective in \
            KORTHIKANTI_TABLE:
        cluster = ClusterSpec.preset("a100-80gb", nodes=gpus // 8)
        model, example = _meta_gpt(heads, hidden, layers)
        given = {mode: price_cluster_plan(model, example, cluster=cluster, global_batch=batch,
                                          tensor=t, pipeline=p, micro_batch_size=micro,
                                          recompute=mode, sequence_parallel=mode != "full")
                 for mode in ("full", "selective")}
        start = time.perf_counter()
        plan = plan_cluster(model, example, cluster=cluster, global_batch=batch,
                            sequence_parallel=True, operator_search=None)
        out.append(dict(size=size, gpus=gpus, layout=f"{t}×{p}", batch=batch,
                        published={"full": full, "selective": selective}, given=given,
                        plan=plan, seconds=time.perf_counter() - start))
    return out


def print_korthikanti() -> None:
    print("\n| model | GPUs | t×p, batch | run | published s | priced s | gap | fits | GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in korthikanti_rows():
        for mode, run in (("full", "full recompute"), ("selective", "selective + SP")):
            g, published = r["given"][mode], r["published"][mode]
            print(f"| {r['size']} B | {r['gpus']} | {r['layout']}, {r['batch']} | {run} | "
                  f"{published:.2f} | {g.step_time:.2f} | {published / g.step_time - 1:+.0%} | "
                  f"{'yes' if g.fits else 'NO'} | {g.memory / 2**30:.1f} |")
        lay, p = r["plan"].layout, r["plan"]
        print(f"| {r['size']} B | {r['gpus']} | plan {lay.tensor}×{lay.pipeline}×{lay.data}, "
              f"b {lay.micro_batch_size}, {lay.schedule}"
              f"{f' v={lay.virtual_stages}' if lay.virtual_stages > 1 else ''}, "
              f"{lay.optimizer_level or '-'}, {lay.recompute}"
              f"{' + SP' if lay.sequence_parallel else ''} | planned in {r['seconds']:.2f} s | "
              f"- | {p.step_time:.2f} | "
              f"{r['given']['selective'].step_time / p.step_time:.2f}x the faster run | "
              f"{'yes' if p.fits else 'NO'} | {p.memory / 2**30:.1f} |")


def main() -> None:
    print("| model | GPUs | published t×p | TFLOP/s published | priced | gap | fits | plan "
          "t×p×d, b, schedule, optimizer, recompute | plan speed-up | plan GiB | "
          "modules tensor-sharded | capture + operator search s | plan s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows():
        g, p = r["given"], r["plan"]
        lay = p.layout
        chunks = f" v={lay.virtual_stages}" if lay.virtual_stages > 1 else ""
        print(f"| {r['size']:.1f} B | {r['gpus']} | {r['tensor']}×{r['pipeline']} | "
              f"{r['published']} | {g.tflops_per_device:.0f} | "
              f"{g.tflops_per_device / r['published'] - 1:+.0%} | {'yes' if g.fits else 'NO'} | "
              f"{lay.tensor}×{lay.pipeline}×{lay.data}, {lay.micro_batch_size}, "
              f"{lay.schedule}{chunks}, {lay.optimizer_level or '-'}, {lay.recompute} | "
              f"{g.step_time / p.step_time:.2f}x | {p.memory / 2**30:.1f} | "
              f"{_operators(p)} | {r['seconds']:.2f} |")
    print_korthikanti()


def _operators(plan) -> str:
    ops = plan.operators
    if ops is None:
        return "- (tensor 1) | -"
    split = sum(1 for s in ops.strategies.values() if any(max(e) > 1 for e in s))
    return (f"{split} of {len(ops.strategies)} | {ops.seconds['capture']:.2f} + "
            f"{ops.seconds['search']:.2f}")


if __name__ == "__main__":
    main()
