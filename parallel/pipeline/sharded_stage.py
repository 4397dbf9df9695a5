"""``ShardedStage``: a pipeline stage whose FSDP2 units are gathered for each split-backward pass.

Optimizer parallel wraps every stage a rank holds as its own FSDP2 root (``parallel.
optimizer_parallel``); torch's multi-stage runtime gathers a stage before its compute and reshards
it when it leaves the active stages. At ``level3`` the units also reshard right after their
forward (weights sharded between uses). A full backward gathers them again through FSDP2's
backward hooks, but ``zbv``'s split backward finds the stage's weights as
``submod.parameters()`` *before* it runs: a resharded unit then lists its sharded parameters,
not the gathered ones its forward used, so the input pass keeps no weight-gradient state and the
weight pass computes nothing for it (silently: the update skips those gradients). Gathering
every unit of the stage before the input and the weight passes is level3's own rule (gather for
backward) and makes ``parameters()`` the ones the graph holds; a unit already gathered is left
as it is.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage


class ShardedStage(PipelineStage):
    """A ``PipelineStage`` over an FSDP2-wrapped stage (see the module docstring)."""

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict,
                                   last_backward: bool = False) -> Any:
        if backward_type in ("input", "weight"):
            for module in self.submod.modules():
                if isinstance(module, FSDPModule):
                    module.unshard()
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
