"""What sharding a mixture of experts over ``expert`` ranks costs and saves in the cluster planner.

Expert parallel (``ParallelConfig.expert_degree``, ``parallel.nn.MoE``) gives each of ``e`` ranks
``experts / e`` of every MoE layer's experts; the batch is split over ``data × expert`` ranks, so
the layers outside the experts are data-parallel over ``data × expert × context`` ranks and each
expert shard over ``data × context`` (the ranks holding the same experts). What it saves is the
experts' weights, gradients and optimizer state: ``1/e`` of them on a rank. Tensor parallel does
not split the experts (``parallelize`` keeps each whole; every rank of a tensor group runs them
on the group's tokens), so their FLOPs and weights are priced undivided by ``t``. What it adds,
per MoE layer and micro-batch, is the token exchange: the routed rows (``top_k`` per token,
bf16) dispatched to their experts' ranks and combined back in forward,
both again in backward, once more each under full recompute; it sits between the router and
the experts, so none of it hides. Where the expert group sits follows the mesh
(``parallel.dims``: ``dp × ep × cp × tp`` with ``tp`` innermost): its ranks are
``context × tensor`` apart, inside a node while ``expert × context × tensor`` fits one, across
nodes otherwise, where the all-to-all's share for other nodes goes over each device's adapter.
"""

from __future__ import annotations

from typing import Any

from parallel.auto.cluster import ClusterSpec, Group
from parallel.auto.transformer_shape import TransformerShape

ACTIVATION_BYTES = 2  # bf16 rows


def stage_expert_params(shape: TransformerShape, lay: Any) -> float:
    """The experts' parameters one rank holds in the fullest stage: its ``1/e`` of them."""
    if not shape.experts:
        return 0.0
    return shape.expert_params * shape.stage_layers(lay.pipeline) / shape.layers / lay.expert


def stage_expert_flops(shape: TransformerShape, lay: Any, tokens: float) -> float:
    """FLOPs one rank of the fullest stage spends in experts on ``tokens`` (forward, backward,
    the forward again under full recompute): each token through ``top_k`` expert MLPs."""
    if not shape.experts:
        return 0.0
    moe = shape.stage_layers(lay.pipeline) * shape.moe_count / shape.layers
    passes = 3 + (1 if lay.recompute == "full" else 0)
    return passes * tokens * moe * shape.top_k * 2 * shape.mlp_params


def stage_dense_params(shape: TransformerShape, lay: Any) -> float:
    """Everything else one rank of the fullest stage holds: ``1/t`` of its layers' attention,
    MLPs, routers and norms (the experts taken out)."""
    layers = shape.stage_layers(lay.pipeline)
    experts = shape.expert_params * layers / shape.layers
    return (shape.layer_params * layers - experts) / lay.tensor


def expert_group(lay: Any, cluster: ClusterSpec) -> Group:
    """Where the ranks exchanging tokens sit: ``context × tensor`` apart."""
    return cluster.group(lay.expert, lay.context * lay.tensor)


def expert_replica_group(lay: Any, cluster: ClusterSpec) -> Group:
    """Where the ranks holding the same experts sit (they average the experts' gradients):
    the data ranks, ``expert × context × tensor`` apart, with the context ranks."""
    return cluster.placed(lay.data * lay.context,
                          ((lay.data, lay.expert * lay.context * lay.tensor),
                           (lay.context, lay.tensor)))


def exchange_seconds(shape: TransformerShape, lay: Any, cluster: ClusterSpec) -> float:
    """Seconds of the fullest stage's token exchanges per micro-batch (module docstring)."""
    if lay.expert == 1 or not shape.experts:
        return 0.0
    tokens = lay.micro_batch_size * shape.seq / lay.context
    rows = tokens * shape.top_k * shape.hidden * ACTIVATION_BYTES
    passes = 6 if lay.recompute == "full" else 4
    moe = shape.stage_layers(lay.pipeline) * shape.moe_count / shape.layers
    return moe * passes * cluster.all_to_all(rows, expert_group(lay, cluster))
