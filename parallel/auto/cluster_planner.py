"""``plan_cluster`` / ``price_cluster_plan``: the 3-D layout of a transformer job on a cluster —
tensor degree inside a node, pipeline degree and schedule, micro-batch size and count, data
degree, context and expert degrees, optimizer sharding and activation recompute — priced on a
two-level machine.

Each layout is priced by ``layout_price.price`` (what it computes, sends, holds and stores, per
training step); ``Layout`` and ``ClusterPlan`` live in ``cluster_layout.py``.

The search (:func:`plan_cluster`) walks every layout that fits: tensor degrees that divide a node
(and the heads), pipeline degrees up to the layers (an uneven split priced by its fullest stage;
any device count: 1536 = 192 × 8), micro-batch sizes that divide the data ranks' share of the
batch, 1F1B and interleaved schedules, optimizer levels and recompute modes, and context degrees
inside a node with the tensor ranks (the sequence split, ``context_price.py``: where
``parallelize`` builds it, without pipeline parallel, and with tensor parallel only without
optimizer shards), expert degrees that divide an MoE model's experts (``expert_price.py``), and,
with ``sequence_parallel=True``, Megatron's sequence parallel in every tensor group; each is
priced in microseconds, so 3072 devices plan in well under a second. Per-operator strategies
inside a layer are Megatron's (column-parallel QKV and first MLP matrix, row-parallel output
projections); the layout converts to the ``ParallelConfig`` that ``parallelize`` applies
(:meth:`ClusterPlan.to_config`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time

import torch
from torch import nn

from parallel.auto.cluster import ClusterSpec, divisors
from parallel.auto.cluster_layout import ClusterPlan, Layout
from parallel.auto.layout_price import price
from parallel.auto.plan import StrategyPlan, plan_auto_parallel
from parallel.auto.transformer_shape import TransformerShape, shape_of

__all__ = ["ClusterPlan", "Layout", "layouts", "plan_cluster", "price", "price_cluster_plan"]

RECOMPUTE = ("none", "selective", "full", "offload")  # offload: activations to the host
LEVELS = (None, "level1", "level2", "level3")
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
VIRTUAL_STAGES = (1, 2, 4)
#: how the per-operator strategies on the tensor group are searched (None: not searched)
OPERATOR_SEARCHES = ("recursive_programming", "dynamic_programming", None)


# ---------------------------------------------------------------- search
#: (optimizer share on the host, weights on the host) the search tries when nothing fits
OFFLOADS = ((0.0, False), (0.5, False), (1.0, False), (1.0, True))


def layouts(shape: TransformerShape, cluster: ClusterSpec, global_batch: int,
            offload: bool = False, sequence_parallel: bool = False):
    """Every layout the search considers (module docstring); ``offload``: those that keep
    something on the host (``offload_price.py``) instead; ``sequence_parallel``: every
    tensor-parallel one with Megatron's sequence parallel."""
    n, node = cluster.devices, cluster.devices_per_node
    for t in divisors(node):
        if shape.heads % t or n % t:
            continue
        for (p, c), e in itertools.product(_pipeline_and_context(shape, n // t, node // t),
                                           _expert_degrees(shape)):
            if (n // t // p // c) % e or (e > 1 and (offload or c > 1 and t > 1)):
                continue  # (context × expert runs without split operators; no expert offload)
            d = n // t // p // c // e
            modes = RECOMPUTE if offload else RECOMPUTE[:-1]
            for b, v, level, recompute, (share, params) in itertools.product(
                    MICRO_BATCH_SIZES, VIRTUAL_STAGES, LEVELS, modes,
                    OFFLOADS if offload else OFFLOADS[:1]):
                if global_batch % (d * e * b):
                    continue
                m = global_batch // (d * e * b)
                if (p > 1 and m < p) or (level is not None and (
                        d * c * e == 1 or (c > 1 and (t > 1 or e > 1)))):
                    continue  # (context × tensor or expert runs without optimizer shards)
                if v > 1 and (p == 1 or m % p or shape.layers % (p * v)):
                    continue
                lay = Layout(t, p, d, b, m, v, level, recompute, share, params, c,
                             sequence_parallel and t > 1, e)
                if offload and not lay.offloads or params and level is not None:
                    continue  # the weights' host copy is each data rank's whole stage
                yield lay


def _expert_degrees(shape: TransformerShape) -> list[int]:
    """Expert degrees for an MoE model: those dividing its experts (1 for a dense one)."""
    return divisors(shape.experts) if shape.experts else [1]


def _pipeline_and_context(shape: TransformerShape, ranks: int,
                          node_ranks: int) -> list[tuple[int, int]]:
    """Pipeline and context degrees for ``ranks`` per tensor group: pipelines up to the layers
    (uneven splits priced by their fullest stage); a context split inside a node with the
    tensor ranks (``node_ranks`` per tensor group there), of a sequence it divides into
    balanced chunks, where ``parallelize`` builds it (without pipeline parallel)."""
    found = [(p, 1) for p in divisors(ranks) if p <= shape.layers]
    found += [(1, c) for c in divisors(min(ranks, node_ranks))
              if c > 1 and ranks % c == 0 and shape.seq % (2 * c) == 0]
    return found


def _shape(model: nn.Module | None, example_inputs: tuple | None,
           shape: TransformerShape | None) -> TransformerShape:
    if shape is not None:
        return shape
    if model is None:
        raise ValueError("plan_cluster: give a model (on the meta device is fine) with "
                         "example_inputs, or shape=TransformerShape(...)")
    return shape_of(model, example_inputs or ())


def _check(cluster: ClusterSpec, global_batch: int) -> None:
    if not isinstance(cluster, ClusterSpec):
        raise TypeError(f"cluster must be a ClusterSpec (e.g. ClusterSpec.preset('a100-80gb', "
                        f"nodes=4)), got {type(cluster).__name__}")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch must be a positive int (samples per step), got "
                         f"{global_batch!r}")


def _operators(model: nn.Module, example_inputs: tuple, lay: Layout, cluster: ClusterSpec,
               dtype: torch.dtype, operator_search: str) -> StrategyPlan | None:
    """The per-operator strategies of one micro-batch on the layout's tensor group (``tensor``
    consecutive ranks, inside one node) by ``operator_search``, priced on ``cluster``; None
    when the tensor degree is 1 or not a power of two (the searches split by halves)."""
    t = lay.tensor
    if t == 1 or t & (t - 1):
        return None
    first, *rest = example_inputs
    micro = (first.expand(lay.micro_batch_size, *first.shape[1:]), *rest)
    return plan_auto_parallel(model, micro, device_num=t, search_mode=operator_search,
                              cluster=cluster, dtype=dtype)


def _check_offload(cluster: ClusterSpec, share: float, params: bool, recompute: str,
                   level: str | None) -> None:
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise ValueError(f"optimizer_offload is the share of the optimizer state on the host, "
                         f"from 0.0 to 1.0, got {share!r}")
    if params and level is not None:
        raise ValueError(f"params_offload keeps each data rank's whole stage on its host; it is "
                         f"priced without optimizer parallel, got optimizer_level={level!r}")
    if (share or params or recompute == "offload") and not cluster.has_host_tier:
        raise ValueError(f"cluster {cluster.name} has no host tier (host_memory, "
                         f"host_bandwidth, host_memory_bandwidth): offloading cannot be priced")


def _check_operator_search(operator_search: str | None) -> None:
    if operator_search not in OPERATOR_SEARCHES:
        raise ValueError(f"plan_cluster: operator_search {operator_search!r} is not one of "
                         f"{list(OPERATOR_SEARCHES)}")


def plan_cluster(model: nn.Module | None = None, example_inputs: tuple | None = None, *,
                 cluster: ClusterSpec, global_batch: int, dtype: torch.dtype = torch.bfloat16,
                 max_device_memory: float | None = None, search_mode: str = "exhaustive",
                 shape: TransformerShape | None = None,
                 operator_search: str | None = "recursive_programming",
                 sequence_parallel: bool = False) -> ClusterPlan:
    """The fastest layout of the model on ``cluster`` that fits (module docstring). ValueError
    naming the smallest memory found when none fits.

    With a model, ``operator_search`` ("recursive_programming", "dynamic_programming"; None:
    skip) then chooses every operator's strategy on the layout's tensor group, priced on the
    cluster (``plan_auto_parallel(..., cluster=)``): the plan's ``strategies`` and
    ``to_config()``. The model's repeated layers are captured once (``repeated.py``).

    ``sequence_parallel``: price every tensor-parallel layout with Megatron's sequence parallel
    (Korthikanti et al. 2022: a layer's activations all ``1/t``, all-gather / reduce-scatter in
    place of all-reduce); such a plan trains with a sequence-parallel strategy file given to
    ``to_config`` (``conf/strategy/gpt_megatron_sp.yaml``)."""
    if search_mode != "exhaustive":
        raise ValueError(f"plan_cluster: search_mode {search_mode!r} is not one of "
                         f"['exhaustive'] (every layout is priced; there are few)")
    _check_operator_search(operator_search)
    _check(cluster, global_batch)
    start = time.perf_counter()
    shape = _shape(model, example_inputs, shape)
    best, smallest, count = None, None, 0
    # the host tier only when nothing fits the devices alone: offloading costs link time
    for offload in (False, True) if cluster.has_host_tier else (False,):
        if best is not None:
            break
        for lay in layouts(shape, cluster, global_batch, offload, bool(sequence_parallel)):
            count += 1
            plan = price(shape, lay, cluster, global_batch, dtype, max_device_memory)
            if plan.fits and (best is None or plan.step_time < best.step_time):
                best = plan
            if smallest is None or plan.memory < smallest.memory:
                smallest = plan
    if smallest is None:
        raise ValueError(f"plan_cluster: no layout of {cluster.devices} devices divides a global "
                         f"batch of {global_batch} with {shape.layers} layers and "
                         f"{shape.heads} heads")
    if best is None:
        raise ValueError(f"plan_cluster: no layout fits {cluster.memory / 2**30:.0f} GiB per "
                         f"device; the smallest needs {smallest.memory / 2**30:.1f} GiB "
                         f"({smallest.layout})")
    operators = _operators(model, tuple(example_inputs), best.layout, cluster, dtype,
                           operator_search) if model is not None and operator_search else None
    return dataclasses.replace(best, operators=operators,
                               search_seconds=time.perf_counter() - start,
                               candidates=count)


def price_cluster_plan(model: nn.Module | None = None, example_inputs: tuple | None = None, *,
                       cluster: ClusterSpec, global_batch: int, tensor: int, pipeline: int,
                       micro_batch_size: int = 1, recompute: str = "full",
                       schedule: str = "1f1b", virtual_stages: int = 1,
                       optimizer_level: str | None = None, dtype: torch.dtype = torch.bfloat16,
                       max_device_memory: float | None = None,
                       shape: TransformerShape | None = None,
                       operator_search: str | None = None, optimizer_offload: float = 0.0,
                       params_offload: bool = False, context: int = 1,
                       sequence_parallel: bool = False, expert: int = 1) -> ClusterPlan:
    """The price of a hand-written layout, to compare with :func:`plan_cluster`'s; with a model
    and ``operator_search``, its per-operator strategies searched as :func:`plan_cluster`
    does (default: none, the layer is priced as Megatron's)."""
    _check_operator_search(operator_search)
    _check(cluster, global_batch)
    shape = _shape(model, example_inputs, shape)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r} is not one of {RECOMPUTE}")
    if optimizer_level not in LEVELS:
        raise ValueError(f"optimizer_level {optimizer_level!r} is not one of {LEVELS}")
    n = cluster.devices
    for name, degree in (("context", context), ("expert", expert)):
        if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
            raise ValueError(f"{name} must be a positive int, got {degree!r}")
    if expert > 1 and (not shape.experts or shape.experts % expert):
        raise ValueError(f"expert={expert} shards each MoE layer's experts: it must divide "
                         f"them (the model has {shape.experts or 'no'} experts)")
    if n % (tensor * pipeline * context * expert):
        degrees = f"tensor={tensor} × pipeline={pipeline}" + (
            f" × context={context}" if context > 1 else "") + (
            f" × expert={expert}" if expert > 1 else "")
        raise ValueError(f"{degrees} must divide the {n} devices")
    if context > 1 and shape.seq % (2 * context):
        raise ValueError(f"context={context}: the sequence of {shape.seq} tokens must divide "
                         f"into 2 × context = {2 * context} balanced chunks")
    data = n // (tensor * pipeline * context * expert)
    if global_batch % (data * expert * micro_batch_size):
        raise ValueError(f"global_batch={global_batch} must divide into data={data} × "
                         + (f"expert={expert} × " if expert > 1 else "")
                         + f"micro_batch_size={micro_batch_size}")
    if schedule not in ("1f1b", "interleaved_1f1b"):
        raise ValueError(f"schedule {schedule!r} is not one of ['1f1b', 'interleaved_1f1b']")
    v = virtual_stages if schedule == "interleaved_1f1b" else 1
    if sequence_parallel and tensor == 1:
        raise ValueError("sequence_parallel splits the sequence inside the tensor-parallel "
                         "group: it needs tensor > 1, got tensor=1")
    _check_offload(cluster, optimizer_offload, params_offload, recompute, optimizer_level)
    if expert > 1 and (optimizer_offload or params_offload or recompute == "offload"):
        raise ValueError(f"expert={expert}: offloading is priced for dense layers only")
    lay = Layout(tensor, pipeline, data, micro_batch_size,
                 global_batch // (data * expert * micro_batch_size), v, optimizer_level,
                 recompute, 1.0 if params_offload else float(optimizer_offload), params_offload,
                 context, bool(sequence_parallel), expert)
    plan = price(shape, lay, cluster, global_batch, dtype, max_device_memory)
    if model is None or operator_search is None:
        return plan
    return dataclasses.replace(plan, operators=_operators(
        model, tuple(example_inputs), lay, cluster, dtype, operator_search))
