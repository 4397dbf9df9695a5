"""Where the recipe's model is first given values: ``model.init_device=auto`` (the default) keeps
the whole model off every rank wherever the layout allows it.

* ``meta``: built without storage; ``parallelize`` allocates and fills each rank's share after the
  split and sharding (deferred init, docs/deferred-init.md). Refused by name where not built.
* ``device``: built whole on each rank (``torch.manual_seed`` then the modules' own init), then
  split and sharded: every rank holds the whole model for a moment.
* ``auto``: the recipe GPT (``gpt``, ``gpt_moe``) is built on the meta device and initialized
  from ``trainer.seed`` tensor by tensor (``GPT.init_parameter``) in every layout: deferred
  where ``meta`` would be accepted, else materialized whole on the device (on the host under
  parameter offload) before the rest of set-up. Deferred init gives each rank the same values
  as the whole model materialized from the seed, so a run starts from the same model whichever
  way its layout takes: ``parallel=none`` and any layout stay comparable. Other models (``hf``,
  ``custom``), whose init is not replayed per tensor, take ``device``.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from recipes.parallel_mode import check_deferred_recipe


def deferred_init(cfg: DictConfig, device: torch.device) -> bool:
    """Whether ``parallelize`` initializes the model after the split (``model.init_device``
    ``meta``, or ``auto`` where meta is accepted); an explicit ``meta`` that cannot be applied
    is refused by name (ValueError)."""
    choice = cfg.model.init_device
    if choice == "meta":
        check_deferred_recipe(cfg, device)
        return True
    if choice == "device" or not seeded_init(cfg):
        return False
    try:
        check_deferred_recipe(cfg, device)
    except ValueError:
        return False
    return True


def seeded_init(cfg: DictConfig) -> bool:
    """Whether the model is built on the meta device and takes its values from ``trainer.seed``
    tensor by tensor (deferred, or materialized whole when the layout needs the whole model)."""
    return cfg.model.init_device == "meta" or (cfg.model.init_device == "auto"
                                               and cfg.model.name not in ("hf", "custom"))
