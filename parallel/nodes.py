"""Which node each rank runs on, and which of a layout's groups stay inside one.

torchrun numbers ranks node by node: the agent of node ``g`` (``GROUP_RANK``) runs ranks
``g·L … g·L + L − 1``, where ``L`` is its ``LOCAL_WORLD_SIZE`` (every agent given the same
``--nproc-per-node``; Slurm's and Kubernetes' launchers in ``launch/`` start one agent per
node). The world mesh lays ranks out ``(pp, dp, ep, cp, tp)`` row-major (``parallel.dims``), so a
tensor group is ``t`` consecutive ranks and an expert group spans ``ep × tp`` consecutive ranks:
with ``t`` and ``ep × t`` dividing ``L`` both stay inside a node, on its fast links (NVLink,
HCCS), while data and pipeline groups cross nodes — Megatron-LM's and torchtitan's placement,
and the one ``parallel.auto.plan_cluster`` prices. A layout that puts a tensor or expert group
across nodes runs, with a warning naming a layout that would not (``ParallelConfig
(strict_nodes=True)`` refuses it instead): its per-layer all-reduces or all-to-alls would cross
the slowest link.

Nothing here is collective: the layout follows from torchrun's environment, and every rank
computes the same answer.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

#: dimensions whose collectives run inside every layer (tensor, context, expert): they belong in
#: a node
INSIDE = {"tp": "tensor", "cp": "context", "ep": "expert"}
#: what crosses nodes when a context or expert group spans them (its words in the warning)
_TRAFFIC = {"cp": ("attention layer's key/value passes", "cross", "them"),
            "ep": ("MoE layer's all-to-all", "crosses", "it")}


@dataclasses.dataclass(frozen=True)
class Nodes:
    """``count`` nodes of ``size`` consecutive ranks each."""

    size: int
    count: int

    def node_of(self, rank: int) -> int:
        return rank // self.size


def job_nodes(world: int) -> Nodes:
    """The nodes of a ``world``-rank job, from torchrun's ``LOCAL_WORLD_SIZE`` (one node when it
    is unset, as in a plain process, or does not divide the world: agents of different sizes,
    whose boundaries no single rank knows)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "")
    size = int(raw) if raw.isdigit() and int(raw) > 0 else world
    if world % size:
        size = world
    return Nodes(size, world // size)


def nodes_spanned(shape: Sequence[int], dim: int, nodes: Nodes) -> int:
    """The most nodes any group of dimension ``dim`` of the row-major ``shape`` touches."""
    stride, world = math.prod(shape[dim + 1:]), math.prod(shape)
    widest = 1
    for start in range(world):
        if (start // stride) % shape[dim]:
            continue  # not the first rank of its group
        members = {nodes.node_of(start + k * stride) for k in range(shape[dim])}
        widest = max(widest, len(members))
    return widest


def describe(shape: Sequence[int], names: Sequence[str], nodes: Nodes) -> str:
    """One line: the nodes, and which dimensions' groups stay inside one."""
    if nodes.count == 1:
        return f"1 node of {nodes.size} ranks"
    spans = {name: nodes_spanned(shape, i, nodes) for i, name in enumerate(names)
             if shape[i] > 1}
    inside = [n for n, k in spans.items() if k == 1]
    across = [f"{n} ({k} nodes)" for n, k in spans.items() if k > 1]
    return (f"{nodes.count} nodes × {nodes.size} ranks; inside a node: "
            f"{', '.join(inside) or 'none'}; across nodes: {', '.join(across) or 'none'}")


def _divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def spanning_problems(shape: Sequence[int], names: Sequence[str], nodes: Nodes) -> list[str]:
    """For each tensor, context or expert dimension whose groups cross nodes: what crosses, and a
    layout that would keep it inside a node."""
    problems = []
    degree = dict(zip(names, shape, strict=True))
    for i, name in enumerate(names):
        if name not in INSIDE or shape[i] == 1:
            continue
        spans = nodes_spanned(shape, i, nodes)
        if spans == 1:
            continue
        if name == "tp":
            fit = _divisor_at_most(nodes.size, degree["tp"])
            problems.append(
                f"tensor_degree={degree['tp']} spans {spans} nodes of {nodes.size} ranks: every "
                f"layer's tensor-parallel collectives cross the link between nodes; a tensor "
                f"degree dividing {nodes.size} (tensor_degree={fit}, the other "
                f"{degree['tp'] // fit}× on data_degree or pipeline_degree) keeps them inside "
                f"a node")
        else:  # context or expert groups, with the tensor ranks inside them
            field, (traffic, crosses, them) = f"{INSIDE[name]}_degree", _TRAFFIC[name]
            tensor = degree.get("tp", 1)
            fit = _divisor_at_most(max(1, nodes.size // tensor), degree[name])
            problems.append(
                f"{field}={degree[name]} × tensor_degree={tensor} = {degree[name] * tensor} "
                f"ranks span {spans} nodes of {nodes.size} ranks: every {traffic} {crosses} "
                f"the link between nodes; {field}={fit} keeps {them} inside a node")
    return problems
