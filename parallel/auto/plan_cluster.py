"""``python -m parallel.auto.plan_cluster``: the planner's layout for a transformer on a cluster,
next to a hand-written one, as a table.

    python -m parallel.auto.plan_cluster --layers 128 --hidden 25600 --heads 160 --seq 2048 \\
        --vocab 51200 --cluster a100-80gb --nodes 384 --global-batch 3072 --tensor 8 --pipeline 64

``--model conf/model/gpt.yaml`` reads the sizes of a recipe model config instead; ``--tensor`` and
``--pipeline`` (optional) price that layout beside the plan; ``--png FILE`` draws the predicted
throughput of the best layout for every (tensor, pipeline) pair.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from parallel.auto.cluster import ClusterSpec, preset_names
from parallel.auto.cluster_planner import (
    ClusterPlan,
    layouts,
    plan_cluster,
    price,
    price_cluster_plan,
)
from parallel.auto.transformer_shape import TransformerShape


def _shape(args: argparse.Namespace) -> TransformerShape:
    if args.model:
        cfg = yaml.safe_load(Path(args.model).read_text())
        experts = int(cfg.get("num_experts", 0))  # model=gpt_moe: every moe_every-th block
        return TransformerShape(cfg["n_layer"], cfg["d_model"], cfg["n_head"],
                                args.seq or int(cfg.get("block_size", 64)), args.vocab,
                                experts=experts, top_k=int(cfg.get("top_k", 2)) if experts else 0,
                                moe_layers=cfg["n_layer"] // int(cfg.get("moe_every", 1))
                                if experts else 0)
    missing = [k for k in ("layers", "hidden", "heads", "seq") if getattr(args, k) is None]
    if missing:
        raise SystemExit(f"give --model or all of --layers --hidden --heads --seq "
                         f"(missing {missing})")
    return TransformerShape(args.layers, args.hidden, args.heads, args.seq, args.vocab,
                            experts=args.experts, top_k=args.top_k, moe_layers=args.moe_layers)


def _row(name: str, plan: ClusterPlan) -> str:
    lay = plan.layout
    chunks = f" v={lay.virtual_stages}" if lay.virtual_stages > 1 else ""
    return (f"| {name} | {lay.tensor} | {lay.pipeline} | {lay.data} | {lay.expert} | "
            f"{lay.micro_batch_size} × "
            f"{lay.micro_batches} | {lay.schedule}{chunks} | "
            f"{lay.optimizer_level or '-'} | {lay.recompute} | {plan.step_time:.3f} | "
            f"{plan.tflops_per_device:.0f} | {plan.mfu:.0%} | {plan.memory / 2**30:.1f} |")


def _grid_png(shape: TransformerShape, cluster: ClusterSpec, batch: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best: dict[tuple[int, int], float] = {}
    for lay in layouts(shape, cluster, batch):
        plan = price(shape, lay, cluster, batch)
        if plan.fits:
            key = (lay.tensor, lay.pipeline)
            best[key] = max(best.get(key, 0.0), plan.mfu)
    tensors = sorted({t for t, _ in best})
    pipes = sorted({p for _, p in best})
    grid = [[best.get((t, p), float("nan")) for p in pipes] for t in tensors]
    fig, ax = plt.subplots(figsize=(1 + 0.6 * len(pipes), 1 + 0.5 * len(tensors)))
    image = ax.imshow(grid, origin="lower", aspect="auto")
    ax.set_xticks(range(len(pipes)), [str(p) for p in pipes])
    ax.set_yticks(range(len(tensors)), [str(t) for t in tensors])
    ax.set_xlabel("pipeline degree")
    ax.set_ylabel("tensor degree")
    fig.colorbar(image, label="predicted MFU (best layout)")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("layers", "hidden", "heads", "seq"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--vocab", type=int, default=51200)
    parser.add_argument("--experts", type=int, default=0, help="experts of an MoE layer")
    parser.add_argument("--top-k", type=int, default=0, help="experts each token uses")
    parser.add_argument("--moe-layers", type=int, default=0,
                        help="layers that are MoE (default: all, with --experts)")
    parser.add_argument("--model", help="a recipe model config (conf/model/*.yaml)")
    parser.add_argument("--cluster", default="a100-80gb",
                        help=f"a preset ({', '.join(preset_names())}) or a YAML file")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--tensor", type=int)
    parser.add_argument("--pipeline", type=int)
    parser.add_argument("--expert", type=int, default=1, help="the given layout's expert degree")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="price tensor-parallel layouts with Megatron's sequence parallel")
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    shape = _shape(args)
    cluster = (ClusterSpec.from_yaml(args.cluster).with_nodes(args.nodes)
               if args.cluster.endswith((".yaml", ".yml"))
               else ClusterSpec.preset(args.cluster, nodes=args.nodes))
    plan = plan_cluster(cluster=cluster, global_batch=args.global_batch, shape=shape,
                        sequence_parallel=args.sequence_parallel)
    print(plan.explain(), end="\n\n")
    print("| layout | tensor | pipeline | data | expert | micro-batches | schedule | optimizer "
          "| recompute | step s | TFLOP/s | MFU | GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(_row("plan", plan))
    if args.tensor or args.pipeline:
        given = price_cluster_plan(cluster=cluster, global_batch=args.global_batch,
                                   tensor=args.tensor or 1, pipeline=args.pipeline or 1,
                                   micro_batch_size=args.micro_batch_size, shape=shape,
                                   sequence_parallel=args.sequence_parallel
                                   and (args.tensor or 1) > 1, expert=args.expert)
        print(_row("given", given))
    if args.png:
        _grid_png(shape, cluster, args.global_batch, args.png)
        print(f"\nwrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
