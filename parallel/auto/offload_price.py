"""The host tier in the cluster planner: what offloading a layout's state saves and costs.

A layout (``cluster_planner.Layout``) may keep, per device, in host memory:

* **a share r of the optimizer state** (``optimizer_offload=r``; ``hetero.optim.OffloadAdamW``'s
  ``host_ratio``): the device keeps ``(1 - r)`` of the 12 B/param of master and moments; the host
  keeps ``r`` of them plus a 4 B landing buffer for each gradient, runs that share's update at
  its memory bandwidth (``32 B`` read and written per parameter, its share of the node's), and
  the link carries the gradients down and the 16-bit weights back once per step;
* **the weights** (``params_offload``; ``hetero.offload.ParamOffload``): the device keeps two
  layers (the one computing and the one prefetched) and the root (embeddings, head), weights
  and gradients; the host keeps FP32 weights, gradients and moments (16 B/param) and steps them;
  every micro-batch brings each layer's FP32 weights over the link twice (forward, backward)
  and sends its 16-bit gradients back;
* **the activations** (``recompute="offload"``; ``parallel.recompute(layer, "offload")``): the
  device keeps two layers' working sets; the host keeps every layer's saved tensors for the
  micro-batches in flight; each micro-batch sends them down and back.

Per-micro-batch transfers overlap the stage's compute (a side stream, one layer ahead), so only
what exceeds it is exposed; the optimizer's host work and its link traffic are not overlapped.
A layout fits the host when the devices of a node together need no more than its memory.
"""

from __future__ import annotations

from typing import Any

from parallel.auto.cluster import ClusterSpec
from parallel.auto.transformer_shape import TransformerShape

#: host optimizer: bytes read and written per parameter (master, moments, gradient; the 16-bit
#: weight sent back)
HOST_STEP_BYTES = 32
#: host optimizer share, weight and gradient landing: bytes per parameter kept on the host
STATE_HOST_BYTES = 12 + 4
PARAMS_HOST_BYTES = 4 + 4 + 8  # FP32 weight, gradient, both moments (the weight is the master)
RESIDENT_LAYERS = 2  # the layer computing and the one prefetched


def host_bytes(shape: TransformerShape, lay: Any, state_params: float, in_flight: float,
               layer_acts: float) -> float:
    """Bytes one device keeps in host memory under ``lay``: ``state_params``, the parameters
    whose optimizer state this device owns; ``layer_acts``, one layer's saved activations per
    micro-batch (without recompute)."""
    stage_params = shape.params / lay.pipeline / lay.tensor
    held = 0.0
    if lay.params_offload:
        held += stage_params * PARAMS_HOST_BYTES
    elif lay.optimizer_offload:
        held += state_params * lay.optimizer_offload * STATE_HOST_BYTES
    if lay.recompute == "offload":
        held += layer_acts * shape.stage_layers(lay.pipeline) * in_flight
    return held


def device_weights(shape: TransformerShape, lay: Any, grad_bytes: int = 4) -> float:
    """Under ``params_offload``: the weights and gradients one device holds (two layers and the
    root's embedding)."""
    resident = RESIDENT_LAYERS * shape.layer_params / lay.tensor
    embed = shape.vocab * shape.hidden / lay.tensor
    return (resident + embed) * (2 + grad_bytes)


def per_micro_batch_link(shape: TransformerShape, lay: Any, cluster: ClusterSpec,
                         layer_acts: float) -> float:
    """Seconds of device<->host transfer one micro-batch needs on one device (weights in twice
    and gradients out under ``params_offload``; activations down and back under activation
    offload); the caller exposes what exceeds the compute it overlaps."""
    moved = 0.0
    if lay.params_offload:
        moved += shape.params / lay.pipeline / lay.tensor * (2 * 4 + 2)
    if lay.recompute == "offload":
        moved += 2 * layer_acts * shape.stage_layers(lay.pipeline)
    return moved / cluster.host_bandwidth if moved else 0.0


def host_step(lay: Any, cluster: ClusterSpec, state_params: float, grad_bytes: int = 4
              ) -> float:
    """Seconds of the host's share of the optimizer step: the update at the host memory's
    bandwidth (this device's share of its node's) and, for an optimizer share alone, its
    gradients down and 16-bit weights back over the link."""
    share = 1.0 if lay.params_offload else lay.optimizer_offload
    if not share:
        return 0.0
    params = state_params * share
    per_device = cluster.host_memory_bandwidth / cluster.devices_per_node
    seconds = params * HOST_STEP_BYTES / per_device
    if not lay.params_offload:
        seconds += params * (grad_bytes + 2) / cluster.host_bandwidth
    return seconds
