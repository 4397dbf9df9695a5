"""``trainer.compile=true``: ``torch.compile`` of the model, in the parallel modes where it works.

The model is compiled in place (``nn.Module.compile``): the module object, its parameters and its
``state_dict`` keys stay the same, so checkpoints move freely between compiled and eager runs and
the data-parallel wrapper's gradient hooks still see the same parameters. Tried and working (2
gloo ranks, losses equal to eager to float rounding): ``parallel=none``, ``parallel=data`` and
``parallel=semi_auto`` (DTensor weights); ``offload=optimizer`` in one process. Refused by name, as
tried: pipeline stages (the schedule runs stage modules split off the model, so compiling the
model compiles nothing that runs), ``hetero.cpu_modules`` placement (the placed model runs as a
captured graph of host and device parts, not through the module's own call: the run is eager
whatever the flag says), and, untried, the expert/hybrid/auto/context modes, optimizer parallel
and MoE.
"""

from __future__ import annotations

import logging

from omegaconf import DictConfig
from torch import nn

import foundation.device as hd

log = logging.getLogger(__name__)

#: ``parallel`` group options under which the recipe compiles its model
COMPILE_MODES = ("none", "data", "semi_auto")


def check_compile(cfg: DictConfig) -> list[str]:
    """Why ``trainer.compile=true`` cannot run with this config (empty: it can)."""
    if not cfg.trainer.get("compile", False):
        return []
    problems = []
    p = cfg.parallel
    if p.name not in COMPILE_MODES or p.get("pipeline_degree", 1) > 1 or \
            p.get("expert_degree", 1) > 1 or p.get("context_degree", 1) > 1 or \
            p.get("enable_parallel_optimizer", False):
        problems.append(f"trainer.compile=true works with parallel={'|'.join(COMPILE_MODES)} "
                        f"(without pipeline, expert, context or optimizer-parallel degrees); "
                        f"parallel={p.name} is not supported: drop trainer.compile")
    if cfg.hetero.get("cpu_modules"):
        problems.append(f"trainer.compile=true with hetero.cpu_modules="
                        f"{list(cfg.hetero.cpu_modules)}: the placed model runs as a captured "
                        f"graph of host and device parts, which compiling the module would not "
                        f"reach; use hetero=none or offload=optimizer")
    if not hd.inductor_compiles():
        problems.append(f"trainer.compile=true on {hd.resolve('device')}: torch.compile's "
                        f"default backend (Inductor) generates no kernels for it; drop "
                        f"trainer.compile")
    if cfg.model.get("num_experts", 0):
        problems.append("trainer.compile=true with MoE layers (model.num_experts > 0) is not "
                        "supported: drop trainer.compile")
    return problems


def compile_model(model: nn.Module) -> nn.Module:
    """Compile ``model`` in place (the wrapped ``.module`` of a data-parallel wrapper)."""
    inner = getattr(model, "module", model)
    inner.compile()
    log.info("trainer.compile: %s compiled with torch.compile (the first step compiles)",
             type(inner).__name__)
    return model
