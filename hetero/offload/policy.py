"""``OffloadPolicy``: where each kind of training state lives, said once.

=============  =====================  ====================================================
state          where                  what moves
=============  =====================  ====================================================
parameters     ``device`` / ``host``  host: weights rest in host memory (FP32) and visit the
               / ``disk``             device one layer at a time; gradients land on the host
               (+ gradients)          (:class:`hetero.offload.ParamOffload`); disk: both rest
                                      in a file under ``path``, paged in a layer at a time
optimizer      ``device`` / ``host``  host: FP32 master weights, both Adam moments and the
               / ``disk``             update in host memory (:class:`hetero.optim.OffloadAdamW`);
                                      disk: master and moments in files under ``path``,
                                      streamed a chunk at a time (:class:`DiskAdamW`)
               ``ratio``              the share of the state (and of the update) kept on the
                                      host; the rest stays on the device
activations    ``none`` / ``host``    host: what each layer saves for backward waits in host
                                      memory (``parallel.recompute(module, "offload")``)
=============  =====================  ====================================================

One object for MindSpore's ``set_offload_context(offload_param=..., offload_checkpoint=...)``,
DeepSpeed's ``offload_param`` / ``offload_optimizer`` and Megatron's optimizer offload fraction.
The recipes' ``offload`` config group has the same fields. Every value is checked when the policy
is made, so a bad one is refused by name before any model changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

PARAM_PLACES = ("device", "host", "disk")
OPTIMIZER_PLACES = ("device", "host", "disk")
ACTIVATION_PLACES = ("none", "host")


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """Where parameters (with their gradients), optimizer state and activations live.

    Args:
        params: ``"device"`` (every weight and gradient of this rank's share on the device),
            ``"host"`` (weights rest in host memory; the device holds ``prefetch`` + 1 layers)
            or ``"disk"`` (as host, but weights and gradients rest in a file under ``path``,
            paged in a layer at a time).
        optimizer: ``"device"``, ``"host"`` (FP32 master and moments in host memory) or
            ``"disk"`` (in scratch files under ``path``, a chunk at a time in memory).
        ratio: with ``optimizer="host"``, the share of the optimizer state and of its step kept
            on the host (1.0: all of it; 0.5: the first half of the parameters by elements).
        activations: ``"none"`` (kept where they are made) or ``"host"`` (every layer's saved
            tensors wait in host memory between forward and backward).
        prefetch: layers whose weights start their way to the device ahead of use.
        path: with ``params="disk"`` or ``optimizer="disk"``, the directory of their files
            (one per rank, created and removed by the run).
    """

    params: str = "device"
    optimizer: str = "device"
    ratio: float = 1.0
    activations: str = "none"
    prefetch: int = 1
    path: str | None = None

    def __post_init__(self) -> None:
        for name, allowed in (("params", PARAM_PLACES), ("optimizer", OPTIMIZER_PLACES),
                              ("activations", ACTIVATION_PLACES)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"OffloadPolicy.{name} {value!r} is not one of {allowed}")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) \
                or not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"OffloadPolicy.ratio is the share of the optimizer state kept on "
                             f"the host, a number from 0.0 to 1.0, got {self.ratio!r}")
        on_disk = [name for name in ("params", "optimizer") if getattr(self, name) == "disk"]
        if on_disk and not self.path:
            raise ValueError(f"OffloadPolicy.{on_disk[0]}='disk' keeps its state in files: "
                             f"give path= (a directory on a local disk)")
        if self.path is not None and not on_disk:
            raise ValueError(f"OffloadPolicy.path={self.path!r} is where params='disk' and "
                             f"optimizer='disk' keep their files, but params={self.params!r} "
                             f"and optimizer={self.optimizer!r}")
        if self.optimizer == "disk" and self.ratio != 1.0:
            raise ValueError(f"OffloadPolicy.ratio={self.ratio} splits the state between host "
                             f"and device; optimizer='disk' keeps all of it on disk")
        if self.optimizer == "device" and self.ratio != 1.0:
            raise ValueError(f"OffloadPolicy.ratio={self.ratio} is the host's share of the "
                             f"optimizer state, but optimizer='device' keeps none there; set "
                             f"optimizer='host' for a share")
        if self.params != "device" and (self.optimizer == "device" or self.ratio != 1.0):
            raise ValueError(
                f"OffloadPolicy.params={self.params!r} keeps the weights (their FP32 values) "
                f"off the device, where the optimizer must update them: it needs "
                f"optimizer='host' (or 'disk') with ratio=1.0, got optimizer="
                f"{self.optimizer!r}, ratio={self.ratio}")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) \
                or self.prefetch < 0:
            raise ValueError(f"OffloadPolicy.prefetch must be an int >= 0, got "
                             f"{self.prefetch!r}")

    @classmethod
    def from_mapping(cls, values: Any) -> OffloadPolicy:
        """A policy from a mapping (a recipe's ``offload`` group); unknown keys are refused by
        name (``name``, a preset's label, is ignored)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        given = {k: v for k, v in dict(values).items() if k != "name"}
        unknown = sorted(set(given) - fields)
        if unknown:
            raise ValueError(f"OffloadPolicy: unknown field(s) {unknown}; the fields are "
                             f"{sorted(fields)}")
        return cls(**given)

    @property
    def any(self) -> bool:
        """Whether anything leaves the device."""
        return (self.params != "device" or self.optimizer != "device"
                or self.activations != "none")

    def describe(self) -> str:
        """One line for a log: where each kind of state lives."""
        optimizer = self.optimizer if self.optimizer != "host" or self.ratio == 1.0 else \
            f"host {self.ratio:.0%} / device {1 - self.ratio:.0%}"
        if self.optimizer == "disk":
            optimizer = f"disk ({self.path})"
        params = f"disk ({self.path})" if self.params == "disk" else self.params
        return (f"params+grads: {params}, optimizer: {optimizer}, "
                f"activations: {self.activations}")
