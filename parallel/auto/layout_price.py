"""What one cluster layout costs: ``price(shape, layout, cluster, global_batch)``.

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
"""

from __future__ import annotations

from typing import Any

import torch

from parallel.auto import context_price, expert_price, offload_price
from parallel.auto.cluster import ClusterSpec
from parallel.auto.cluster_layout import ClusterPlan, Layout
from parallel.auto.transformer_shape import TransformerShape

OVERHEAD_BYTES = 2 * 2**30  # runtime context, workspaces, fragmentation


def _activation_bytes(shape: TransformerShape, lay: Layout, recompute: str) -> float:
    """Bytes one layer keeps for backward per micro-batch (module docstring)."""
    s, h, a, t = shape.seq, shape.hidden, shape.heads, lay.tensor
    # Korthikanti's 24/t assumes one MLP of ffn = 4h a token (an MoE layer runs top_k of them)
    ffn_scale = shape.ffn_hidden / (4 * h) * shape.mlps_per_token
    # sequence parallel keeps the norms', dropouts' and layer input's 10 s b h sharded too
    split = t if lay.sequence_parallel else 1
    linear = 10 / split + 24 * ffn_scale / t
    b = lay.micro_batch_size / lay.context  # a context rank keeps its share of the tokens
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
