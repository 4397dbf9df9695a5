"""hetero-parallel's heterogeneous training: CPU and accelerator in one model.

``hetero.device`` is the one module that knows concrete device names; ask it what "cpu" and
"device" mean on this machine and which collective backend serves each.
"""

from hetero import device

__all__ = ["device"]
