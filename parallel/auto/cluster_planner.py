"""``plan_cluster`` / ``price_cluster_plan``: the 3-D layout of a transformer job on a cluster —
tensor degree inside a node, pipeline degree and schedule, micro-batch size and count, data
degree, context and expert degrees, optimizer sharding and activation recompute — priced on a
two-level machine.

The price of one layout (:func:`price`), per training step:

* **compute**: the FLOPs the devices execute (forward, backward = 2× forward, plus what recompute
  runs again: the layers' forward for ``full``, attention's core for ``selective``) at
  ``matmul_efficiency`` × peak, plus the memory-bound operators (norms, activations, softmax,
  dropout: the activation bytes they read and write, at the device's memory bandwidth), per
  micro-batch and pipeline stage;
* **tensor parallel**: 2 all-reduces of the ``[b, s, h]`` activations per layer in forward, 2 in
  backward, 2 more when ``full`` recompute runs the forward again (Megatron's layer), inside a
  node; exposed (they sit between the layer's matrix products); with sequence parallel each is an
  all-gather and a reduce-scatter of the same bytes (Korthikanti et al. 2022), the norms,
  dropouts and residuals run on ``1/t`` of the tokens, and a stage boundary sends the sharded
  activation without gathering it;
* **pipeline**: the stage's micro-batch time × ``(m + (p - 1) / v)`` (1F1B: ``v = 1``;
  interleaved: ``v`` chunks per device shrink the bubble), plus a forward and a backward
  point-to-point transfer per micro-batch and chunk, across nodes once the job spans them (each
  tensor-parallel rank sends ``1/t`` of the activation and the next stage all-gathers it inside
  its node, as Megatron-LM does); the last stage also computes the logits;
* **data parallel / optimizer parallel**: the gradient all-reduce over the data ranks (hierarchical
  across nodes) after the last micro-batch; optimizer parallel level1 replaces it with a
  reduce-scatter and an all-gather of the updated weights, level2 reduce-scatters every
  micro-batch, level3 also gathers each stage's weights for every micro-batch's forward and
  backward (what ``ShardedDataParallel`` does);
* **expert parallel** (a mixture of experts, ``expert_price.py``): each rank keeps ``1/e`` of
  the experts; the token exchange per MoE layer is priced by where the expert group sits, and
  the experts' gradients average over their own replicas;
* **optimizer step**: the state the device streams through its memory (bf16 weights, fp32 grads,
  master weights and Adam moments);
* **the host tier** (only when no layout fits the devices alone, and the cluster states its host
  memory and links): a share of the optimizer state, the weights, or the activations
  (``recompute="offload"``) kept in host memory — device bytes traded for host bytes, the host's
  update and the link transfers that do not hide behind compute (``offload_price.py``);
  :attr:`ClusterPlan.offload_policy` is the ``hetero.offload.OffloadPolicy`` to train with.

Memory of the fullest device: weights 2 B, fp32 gradients 4 B and Adam state 12 B per parameter
(divided over the data ranks by the optimizer level), the embedding on the first stage, the
logits on the last, and activations per layer and micro-batch as Korthikanti et al. (2022)
count them — ``s b h (10 + 24/t + 5 a s / (h t))`` bytes without recompute, ``s b h (10 + 24/t)``
with selective recompute, ``2 s b h`` (the layer input) plus one layer's working set with full;
sequence parallel divides the ``10`` and the layer input by ``t`` too (``34 s b h / t`` selective) —
for the micro-batches 1F1B keeps in flight on the first stage (``min(p, m)``; interleaving adds
``(p - 1) / (p v)``).

Throughput is reported as Megatron-LM reports it (Narayanan et al., SC21): model FLOPs with
recompute counted (``96 B s l h² (1 + s/6h + V/16lh)`` for full recompute with ``ffn = 4h``) per
device per second; ``mfu`` counts the model's FLOPs without recompute against peak.

The search (:func:`plan_cluster`) walks every layout that fits: tensor degrees that divide a node
(and the heads), pipeline degrees up to the layers (an uneven split priced by its fullest stage;
any device count: 1536 = 192 × 8), micro-batch sizes that divide the data ranks' share of the
batch, 1F1B and interleaved schedules, optimizer levels and recompute modes, and context degrees
inside a node with the tensor ranks (the sequence split, ``context_price.py``: where
``parallelize`` builds it, without pipeline parallel, and with tensor parallel only without
optimizer shards); each is priced in microseconds, so 3072 devices plan in
well under a second. Per-operator strategies inside a layer are Megatron's (column-parallel QKV
and first MLP matrix, row-parallel output projections); the layout converts to the
``ParallelConfig`` that ``parallelize`` applies (:meth:`ClusterPlan.to_config`).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hetero.offload.policy import OffloadPolicy
from parallel.auto import context_price, expert_price, offload_price
from parallel.auto.cluster import ClusterSpec, divisors
from parallel.auto.plan import StrategyPlan, plan_auto_parallel
from parallel.auto.transformer_shape import TransformerShape, shape_of

RECOMPUTE = ("none", "selective", "full", "offload")  # offload: activations to the host
LEVELS = (None, "level1", "level2", "level3")
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
VIRTUAL_STAGES = (1, 2, 4)
OVERHEAD_BYTES = 2 * 2**30  # runtime context, workspaces, fragmentation
#: how the per-operator strategies on the tensor group are searched (None: not searched)
OPERATOR_SEARCHES = ("recursive_programming", "dynamic_programming", None)


@dataclasses.dataclass(frozen=True)
class Layout:
    tensor: int
    pipeline: int
    data: int
    micro_batch_size: int
    micro_batches: int
    virtual_stages: int = 1
    optimizer_level: str | None = None
    recompute: str = "full"
    optimizer_offload: float = 0.0  # the share of the optimizer state on the host
    params_offload: bool = False  # the weights at rest on the host (offload_price.py)
    context: int = 1  # ranks each sequence is split over (context_price.py)
    #: Megatron's sequence parallel inside the tensor group (Korthikanti et al. 2022)
    sequence_parallel: bool = False
    expert: int = 1  # ranks each MoE layer's experts are sharded over (expert_price.py)

    @property
    def replicas(self) -> int:
        """Ranks averaging the gradients of the layers outside the experts and sharing their
        optimizer shards: data × expert × context."""
        return self.data * self.expert * self.context

    @property
    def devices(self) -> int:
        return self.tensor * self.pipeline * self.replicas

    @property
    def offloads(self) -> bool:
        return bool(self.optimizer_offload or self.params_offload or self.recompute == "offload")

    @property
    def schedule(self) -> str:
        return "1f1b" if self.virtual_stages == 1 or self.pipeline == 1 else "interleaved_1f1b"


@dataclasses.dataclass(frozen=True)
class ClusterPlan:
    """A priced layout (module docstring); ``breakdown`` holds seconds per part of a step."""

    layout: Layout
    shape: TransformerShape
    cluster: ClusterSpec
    global_batch: int
    step_time: float
    memory: float
    tflops_per_device: float
    mfu: float
    breakdown: dict[str, float]
    fits: bool
    search_seconds: float = 0.0
    candidates: int = 1
    operators: StrategyPlan | None = None  # the per-operator search on the tensor group
    host_memory: float = 0.0  # bytes one device keeps in host memory (offload_price.py)

    @property
    def offload_policy(self) -> OffloadPolicy:
        """The ``hetero.offload.OffloadPolicy`` this layout trains with."""
        lay = self.layout
        params = lay.params_offload
        share = 1.0 if params else lay.optimizer_offload
        return OffloadPolicy(params="host" if params else "device",
                             optimizer="host" if share else "device", ratio=share or 1.0,
                             activations="host" if lay.recompute == "offload" else "none")

    @property
    def strategies(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """The searched per-operator strategies for the whole job: the tensor group's (module
        path -> in_strategy, ``operators``) with each batch split over the data ranks too (the
        first entry's first dimension, as the recipe's strategy files write ``dp``); empty
        without a per-operator search."""
        if self.operators is None:
            return {}
        batch_ranks = self.layout.data * self.layout.expert
        return {key: ((entry[0] * batch_ranks, *entry[1:]), *rest) if entry else
                (entry, *rest) for key, (entry, *rest) in self.operators.strategies.items()}

    def __getattr__(self, name: str) -> Any:  # tensor, pipeline, ... read through the layout
        layout = self.__dict__.get("layout")
        if layout is not None and name in {f.name for f in dataclasses.fields(Layout)} | {
                "schedule"}:
            return getattr(layout, name)
        raise AttributeError(name)

    def explain(self) -> str:
        lay, b = self.layout, self.breakdown
        lines = [
            f"cluster {self.cluster.name}: {self.cluster.nodes} nodes × "
            f"{self.cluster.devices_per_node} = {self.cluster.devices} devices; model "
            f"{self.shape.params / 1e9:.1f} B parameters ({self.shape.layers} layers, hidden "
            f"{self.shape.hidden}, {self.shape.heads} heads, seq {self.shape.seq}); global batch "
            f"{self.global_batch}",
            f"layout: tensor {lay.tensor} × pipeline {lay.pipeline} × data {lay.data}"
            + (f" × context {lay.context}" if lay.context > 1 else "")
            + (f" × expert {lay.expert}" if lay.expert > 1 else "") + "; "
            f"micro-batch {lay.micro_batch_size} × {lay.micro_batches}; {lay.schedule}"
            + (f" (v={lay.virtual_stages})" if lay.virtual_stages > 1 else "")
            + f"; optimizer {lay.optimizer_level or 'replicated'}; recompute {lay.recompute}"
            + ("; sequence parallel" if lay.sequence_parallel else "")
            + (f"; offload {self.offload_policy.describe()}" if lay.offloads else ""),
            f"step {self.step_time:.3f} s: " + ", ".join(f"{k} {v:.3f}" for k, v in b.items()),
            f"{self.tflops_per_device:.0f} TFLOP/s per device (MFU {self.mfu:.0%}); memory "
            f"{self.memory / 2**30:.1f} GiB of {self.cluster.memory / 2**30:.0f} per device"
            + (f"; host {self.host_memory / 2**30:.1f} GiB per device, "
               f"{self.host_memory * self.cluster.devices_per_node / 2**30:.0f} GiB of "
               f"{self.cluster.host_memory / 2**30:.0f} per node" if self.host_memory else "")
            + ("" if self.fits else " — does NOT fit"),
        ]
        if self.candidates > 1:
            lines.append(f"searched {self.candidates} layouts in {self.search_seconds:.2f} s")
        if self.operators is not None:
            ops = self.operators
            split = sum(1 for s in ops.strategies.values() if any(max(e) > 1 for e in s))
            lines.append(f"per-operator strategies: {ops.search_mode} on the tensor group's "
                         f"{ops.device_num} devices priced on the cluster (capture "
                         f"{ops.seconds['capture']:.2f} s, search {ops.seconds['search']:.2f} "
                         f"s): {split} of {len(ops.strategies)} modules tensor-sharded; one "
                         f"micro-batch through every layer on those devices modelled at "
                         f"{ops.cost * 1e3:.1f} ms (the step above prices Megatron's layer)")
        return "\n".join(lines)

    def to_config(self, strategies: Mapping[str, Any] | None = None) -> Any:
        """The ``ParallelConfig`` ``parallelize`` applies: semi-auto with ``strategies`` (the
        per-operator layout inside a layer, e.g. ``conf/strategy/gpt_megatron.yaml`` loaded for
        the plan's degrees; default: the searched ones, :attr:`strategies`) when the tensor
        degree is above 1, else data parallel. A plan priced with sequence parallel needs
        strategies that split the sequence (``conf/strategy/gpt_megatron_sp.yaml``) given."""
        from parallel.config import ParallelConfig

        lay = self.layout
        given = bool(strategies)
        strategies = strategies or self.strategies
        fields: dict[str, Any] = dict(
            data_degree=lay.data, pipeline_degree=lay.pipeline,
            micro_batches=lay.micro_batches if lay.pipeline > 1 else 1,
            schedule=lay.schedule if lay.pipeline > 1 else "1f1b",
            virtual_stages=max(2, lay.virtual_stages),
            enable_parallel_optimizer=lay.optimizer_level is not None,
            optimizer_level=lay.optimizer_level or "level1", context_degree=lay.context,
            expert_degree=lay.expert)
        if lay.tensor > 1:
            preset = "gpt_megatron_sp" if lay.sequence_parallel else "gpt_megatron"
            if not strategies or (lay.sequence_parallel and not given):
                need = ("sequence-parallel strategies (norms and residuals split on the "
                        "sequence; the per-operator search does not choose them)"
                        if lay.sequence_parallel else "the per-operator strategies of a layer")
                raise ValueError(f"ClusterPlan.to_config: tensor degree {lay.tensor} needs "
                                 f"{need}, e.g. load_strategy_file('conf/strategy/{preset}"
                                 f".yaml', dp={lay.data}, mp={lay.tensor})")
            # each data rank feeds its slice (the dataset strategy), except under a sequence
            # split, whose positions that strategy cannot take yet: every rank reads the batch
            fields.update(tensor_degree=lay.tensor,
                          strategies=dict(strategies), full_batch=lay.context > 1)
        return ParallelConfig(**fields)


# ---------------------------------------------------------------- pricing
def _activation_bytes(shape: TransformerShape, lay: Layout, recompute: str) -> float:
    """Bytes one layer keeps for backward per micro-batch (module docstring)."""
    s, b, h, a, t = shape.seq, lay.micro_batch_size, shape.hidden, shape.heads, lay.tensor
    ffn_scale = shape.ffn_hidden / (4 * h)  # Korthikanti's 24/t assumes ffn = 4h
    # sequence parallel keeps the norms', dropouts' and layer input's 10 s b h sharded too
    split = t if lay.sequence_parallel else 1
    linear = 10 / split + 24 * ffn_scale / t
    b = b / lay.context  # a context rank keeps its share of the tokens
    if recompute == "none":
        return s * b * h * (linear + 5 * a * s / (h * t))
    if recompute == "selective":
        return s * b * h * linear
    if recompute == "offload":  # every saved tensor waits on the host
        return 0.0
    return 2 * s * b * h / split


def _memory(shape: TransformerShape, lay: Layout, cluster: ClusterSpec) -> float:
    h, t, p = shape.hidden, lay.tensor, lay.pipeline
    embed = shape.vocab * h / t  # the first stage's table (the last's head, when untied)
    level = lay.optimizer_level

    def per_param(d: int) -> float:  # over ``d`` ranks holding the same parameters
        return (2 / (d if level == "level3" else 1) + 4 / (d if level in ("level2", "level3")
                                                           else 1)
                + 12 * (1 - lay.optimizer_offload) / (d if level else 1))
    weights = ((expert_price.stage_dense_params(shape, lay) + embed) * per_param(lay.replicas)
               + expert_price.stage_expert_params(shape, lay) * per_param(lay.data * lay.context))
    if lay.params_offload:  # two layers and the root on the device, the rest on the host
        weights = offload_price.device_weights(shape, lay)
    layers = shape.stage_layers(p)
    working = {"full": 1, "offload": offload_price.RESIDENT_LAYERS}.get(lay.recompute, 0) * \
        _activation_bytes(shape, lay, "none")  # what a recomputed / offloaded layer holds
    act = _activation_bytes(shape, lay, lay.recompute) * layers * _in_flight(lay) + working
    first = weights + act
    logits = 4 * shape.seq * lay.micro_batch_size * shape.vocab / t / lay.context  # fp32
    last = weights + logits + _activation_bytes(shape, lay, lay.recompute) * layers + working
    return max(first, last if p > 1 else first + logits) + OVERHEAD_BYTES


def _in_flight(lay: Layout) -> float:
    """Micro-batches whose activations the first stage holds at once under 1F1B."""
    p = lay.pipeline
    return min(p, lay.micro_batches) * (1 + (p - 1) / (p * lay.virtual_stages)
                                        if lay.virtual_stages > 1 else 1)


def _elementwise(shape: TransformerShape, lay: Layout) -> float:
    """Bytes the memory-bound operators of one stage (norms, activations, softmax, dropout,
    residuals) stream per micro-batch: the activations a layer produces, read and written in
    forward and twice in backward, once more per recomputed forward."""
    passes = 4 + {"none": 0, "selective": 1, "full": 2, "offload": 0}[lay.recompute]
    return passes * _activation_bytes(shape, lay, "none") * shape.stage_layers(lay.pipeline)


def _flops(shape: TransformerShape, tokens: float, recompute: str) -> tuple[float, float]:
    """(executed FLOPs counting recompute as Megatron does, model FLOPs without recompute)."""
    h, s, layers = shape.hidden, shape.seq, shape.layers
    layer_fwd = 2 * shape.matmul_params + 4 * s * h  # per token
    logits_fwd = 2 * h * shape.vocab
    model = 3 * tokens * (layers * layer_fwd + logits_fwd)
    extra = {"none": 0.0, "selective": tokens * layers * 4 * s * h,
             "full": tokens * layers * layer_fwd, "offload": 0.0}[recompute]
    return model + extra, model


def price(shape: TransformerShape, lay: Layout, cluster: ClusterSpec, global_batch: int,
          dtype: torch.dtype = torch.bfloat16, memory_limit: float | None = None,
          grad_bytes: int = 4) -> ClusterPlan:
    """The :class:`ClusterPlan` of one layout (module docstring)."""
    t, p, d, b, m, v = (lay.tensor, lay.pipeline, lay.data, lay.micro_batch_size,
                        lay.micro_batches, lay.virtual_stages)
    c = lay.context
    n = lay.devices
    rate = cluster.peak_flops(dtype) * cluster.matmul_efficiency
    s, h = shape.seq, shape.hidden
    tokens_mb = b * s / c  # a rank's tokens of a micro-batch
    executed_mb, _ = _flops(shape, tokens_mb, lay.recompute)
    logits_mb = 3 * tokens_mb * 2 * h * shape.vocab
    layers_mb = executed_mb - logits_mb
    fullest = shape.stage_layers(p) / shape.layers  # the slowest stage sets the pace
    in_experts = expert_price.stage_expert_flops(shape, lay, tokens_mb)  # not split by t
    stage_compute = ((layers_mb * fullest - in_experts) / t + in_experts) / rate \
        + _elementwise(shape, lay) / cluster.hbm_bandwidth
    last_extra = logits_mb / t / rate
    act_bytes = tokens_mb * h * 2
    tp_group = cluster.group(t, 1)
    all_reduces = 6 if lay.recompute == "full" else 4
    # sequence parallel: an all-gather and a reduce-scatter in place of each all-reduce
    one = (cluster.all_gather(act_bytes, tp_group) + cluster.reduce_scatter(act_bytes, tp_group)
           if lay.sequence_parallel
           else cluster.all_reduce(act_bytes, tp_group))
    stage_tp = shape.stage_layers(p) * all_reduces * one
    spans_nodes = n > cluster.devices_per_node
    # each of the stage's t ranks sends 1/t of the (replicated) activation and the receiving
    # stage all-gathers it inside its node (Megatron's scatter/gather optimisation); under
    # sequence parallel the boundary activation is already each rank's 1/t
    boundary = cluster.send(act_bytes / t, spans_nodes) + (
        0.0 if lay.sequence_parallel else cluster.all_gather(act_bytes, tp_group))
    stage_p2p = 2 * v * boundary if p > 1 else 0.0
    layer_acts = _activation_bytes(shape, lay, "none")
    link = offload_price.per_micro_batch_link(shape, lay, cluster, layer_acts)
    exposed = max(0.0, link - stage_compute)  # transfers overlap the stage's compute
    attention = 3 * tokens_mb * 4 * s * h / t / rate  # one layer's scores, fwd + bwd
    stage_ring = shape.stage_layers(p) * context_price.exposed_ring(shape, lay, cluster,
                                                                    attention)
    stage_experts = expert_price.exchange_seconds(shape, lay, cluster)
    per_mb = stage_compute + stage_tp + stage_p2p + exposed + stage_ring + stage_experts
    pipe = (m + (p - 1) / v) * per_mb + m * last_extra
    bubble = (p - 1) / v * per_mb
    experts = shape.expert_params / p / lay.expert  # a rank's share of its stage's experts
    dense = (shape.params - shape.expert_params) / p / t
    level = lay.optimizer_level
    # the context (and expert) ranks are replicas too
    data = (_gradient_sync(dense, cluster.group(lay.replicas, t), lay, cluster, grad_bytes)
            + _gradient_sync(experts, expert_price.expert_replica_group(lay, cluster), lay,
                             cluster, grad_bytes))
    state = dense / (lay.replicas if level else 1) + experts / (d * c if level else 1)
    on_device = 0.0 if lay.params_offload else 1 - lay.optimizer_offload
    optimizer = state * on_device * (2 + grad_bytes + 12) * 2 / cluster.hbm_bandwidth
    host_step = offload_price.host_step(lay, cluster, state, grad_bytes)
    step = pipe + data + optimizer + host_step
    executed, model = _flops(shape, global_batch * s, lay.recompute)
    memory = _memory(shape, lay, cluster)
    host = offload_price.host_bytes(shape, lay, state, _in_flight(lay), layer_acts)
    limit = memory_limit if memory_limit is not None else cluster.memory
    breakdown = {"compute": m * (stage_compute + last_extra), "tensor": m * stage_tp,
                 "bubble": bubble, "p2p": m * stage_p2p, "data": data,
                 "optimizer": optimizer}
    if lay.offloads:
        breakdown["offload"] = m * exposed + host_step
    if c > 1:
        breakdown["context"] = m * stage_ring
    if lay.expert > 1:
        breakdown["experts"] = m * stage_experts
    fits = memory <= limit and host * cluster.devices_per_node <= (
        cluster.host_memory if lay.offloads else float("inf"))
    return ClusterPlan(lay, shape, cluster, global_batch, step, memory,
                       executed / step / n / 1e12, model / step / n / cluster.peak_flops(dtype),
                       breakdown, fits, host_memory=host)


def _gradient_sync(params: float, group: Any, lay: Layout, cluster: ClusterSpec,
                   grad_bytes: int) -> float:
    """Seconds to average ``params``' gradients over ``group`` (the ranks holding them) by the
    layout's optimizer level (module docstring)."""
    level, m = lay.optimizer_level, lay.micro_batches
    if group.size == 1 or not params:
        return 0.0
    if level is None:
        return cluster.all_reduce(params * grad_bytes, group)
    if level == "level1":
        return cluster.reduce_scatter(params * grad_bytes, group) + \
            cluster.all_gather(params * 2, group)
    # level2/3 reduce-scatter every micro-batch; level3 also gathers weights twice
    seconds = m * cluster.reduce_scatter(params * grad_bytes, group) + \
        cluster.all_gather(params * 2, group)
    if level == "level3":
        seconds += 2 * m * cluster.all_gather(params * 2, group)
    return seconds


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
