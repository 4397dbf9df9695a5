"""The memory hierarchy: where parameters, gradients, optimizer state and activations live.

* :class:`OffloadPolicy` — one object saying, for each kind of state, device or host.
* :class:`ParamOffload` — parameters at rest in host memory, brought to the device one layer
  at a time (the next layer's copy overlapping the current layer's compute).
* :class:`ActivationOffload` — what a module saves for backward kept in host memory
  (``parallel.recompute(module, mode="offload")``).
* :class:`DiskAdamW` — the optimizer state in files, streamed a chunk at a time (the disk tier).
* :func:`apply_offload` — applies a policy to a model (and builds its optimizer).
"""

from hetero.offload.activations import ActivationOffload, offload_activations
from hetero.offload.apply import Offloaded, apply_offload
from hetero.offload.disk_adam import DiskAdamW
from hetero.offload.params import ParamOffload
from hetero.offload.policy import OffloadPolicy

__all__ = ["ActivationOffload", "DiskAdamW", "OffloadPolicy", "Offloaded", "ParamOffload",
           "apply_offload", "offload_activations"]
