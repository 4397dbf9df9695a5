"""hetero-parallel's heterogeneous training: CPU and accelerator in one model.

``hetero.device`` (:mod:`foundation.device`, the layer beneath hetero and parallel) is the one
module that knows concrete device names; ask it what "cpu" and "device" mean on this machine and
which collective backend serves each. ``set_device`` and
``device_scope`` tag modules, ops and regions; ``place`` splits a tagged model into CPU and
accelerator partitions; ``auto_place`` chooses the CPU share itself under a memory budget.
"""

from foundation.model_view import ModelView
from hetero import device, nn, optim
from hetero.placement import CaptureError, PlacedModule, Plan, auto_place, explain, place
from hetero.tags import device_scope, set_device

__all__ = [
    "CaptureError",
    "ModelView",
    "PlacedModule",
    "Plan",
    "auto_place",
    "device",
    "device_scope",
    "explain",
    "nn",
    "optim",
    "place",
    "set_device",
]
