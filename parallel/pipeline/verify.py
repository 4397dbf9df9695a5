"""Check a stage plan against the model's forward before anything is split: a dry run on fake
tensors (no compute, no memory) of each stage on its own, in order, each fed the previous one's
output.

A module-deletion split is only as good as the model's forward: a stage must run with the other
stages' parts missing, and must run every part it holds. A forward that calls a missing part
crashes on one rank while the others wait for its activations; one that skips a held part (a
position embedding computed only beside the token embedding) trains without it, silently. Both
are found here and named, with the stage.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from foundation.compat import fake_tensor_mode
from parallel.pipeline.carve import carve
from parallel.pipeline.dry_run import fake_inputs, tensor_attributes_kept
from parallel.pipeline.partition import StagePlan


def _as_args(output: Any) -> tuple:
    """A stage's output as the next stage's positional inputs (``None`` entries dropped, as the
    runtime's ``StageRunner`` does)."""
    if isinstance(output, (tuple, list)):
        return tuple(o for o in output if o is not None)
    return (output,)


def check_stages_run(model: nn.Module, plan: StagePlan, example_inputs: tuple) -> None:
    """ValueError naming the stage and unit when a stage cannot run alone or skips a unit."""
    units = {u.path for u in plan.units}
    modules = dict(model.named_modules())
    with tensor_attributes_kept(model), fake_tensor_mode() as mode, torch.no_grad():
        args = fake_inputs(model, mode, tuple(example_inputs))
        for s in range(plan.num_stages):
            held = plan.stage_units(s)
            ran: set[str] = set()
            handles = [modules[p].register_forward_pre_hook(lambda *_, p=p, ran=ran: ran.add(p))
                       for p in held]
            try:
                output = carve(model, set(held), units, in_place=False)(*args)
            except Exception as err:
                raise ValueError(
                    f"pipeline stage {s} ({held[0]} .. {held[-1]}) cannot run on its own: "
                    f"{type(err).__name__}: {err}. The model's forward must skip parts another "
                    f"stage holds (x = self.embed(x) if self.embed is not None else x), or tag "
                    f"the parts it needs into this stage") from err
            finally:
                for handle in handles:
                    handle.remove()
            idle = [p for p in held if p not in ran]
            if idle:
                raise ValueError(
                    f"pipeline stage {s} holds {idle} but its forward never runs them: the "
                    f"model's forward skips them when a part another stage holds is missing; "
                    f"tag them into the same stage as that part (parallel.pipeline_stage / "
                    f"ParallelConfig.stages)")
            args = _as_args(output)
            if s < plan.num_stages - 1 and not all(isinstance(a, torch.Tensor) for a in args):
                raise ValueError(f"pipeline stage {s} returns {[type(a).__name__ for a in args]}"
                                 f"; a stage that feeds another must return tensors")
