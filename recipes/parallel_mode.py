"""Apply the ``parallel`` config group: build a ``parallel.ParallelConfig`` from Hydra and hand it
to ``parallel.parallelize`` explicitly (nothing goes through the global auto-parallel context)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

import foundation.device as hd
import parallel
from parallel import ParallelConfig
from parallel.config import FIELDS, OperatorSplit, mode_fields, operator_split
from parallel.mesh import batch_mesh
from parallel.semi_auto import load_strategy_file
from recipes.optim import PARAM_DTYPES
from recipes.parallel_schema import DEPRECATED_KEYS, FROM_ELSEWHERE

STRATEGY_DIR = Path(__file__).resolve().parents[1] / "conf" / "strategy"
log = logging.getLogger(__name__)


def config_fields(cfg: DictConfig) -> dict[str, Any]:
    """The ``ParallelConfig`` fields the ``parallel`` group sets (the previous release's keys
    renamed and its ``mode`` translated, with a DeprecationWarning)."""
    fields = {name: cfg[name] for name in FIELDS
              if name not in FROM_ELSEWHERE and name in cfg}
    for old, new in DEPRECATED_KEYS.items():
        if cfg.get(old) is not None:
            warnings.warn(f"parallel.{old} is deprecated, use parallel.{new}", DeprecationWarning,
                          stacklevel=2)
            fields[new] = cfg[old]
    if cfg.get("mode") is not None:
        warnings.warn("parallel.mode is deprecated: the degrees, parallel.strategy and "
                      "parallel.search_mode say it (AUTO_PARALLEL is parallel.search_mode="
                      "sharding_propagation, STAND_ALONE parallel.data_degree=1; the other "
                      "modes need nothing)", DeprecationWarning, stacklevel=2)
        fields.update(mode_fields(cfg.mode, fields, "parallel"))
    fields["stages"] = OmegaConf.to_container(cfg.stages) if "stages" in cfg else {}
    if fields.get("tensor_degree") is None:
        fields.pop("tensor_degree", None)
    return fields


def parallel_config(cfg: DictConfig, world_size: int, hetero: DictConfig | None = None,
                    accumulate: int = 1, offload: DictConfig | None = None) -> ParallelConfig:
    """The ``ParallelConfig`` the ``parallel`` group describes, resolved for ``world_size``.
    ``tensor_degree: null`` is the rest of a pipeline stage under semi_auto (1 otherwise);
    under ``offload.optimizer=host`` optimizer parallel holds the weights in
    ``offload.param_dtype`` (each rank offloads its slice), and under ``offload.params=host``
    at level2/3 each rank's shards of the weights rest on its host (``offload_params``).
    ``accumulate`` (``trainer.grad_accum_steps``): a pipeline accumulates over its
    micro-batches, so it runs that many times ``parallel.micro_batches``."""
    fields = config_fields(cfg)
    if fields.get("pipeline_degree", 1) > 1:
        fields["micro_batches"] = fields.get("micro_batches", 1) * accumulate
    split = group_split(cfg, fields)
    if cfg.name == "semi_auto" and not cfg.strategy:  # the preset is its strategy file
        raise ValueError("parallel=semi_auto needs parallel.strategy: a file name in "
                         f"{STRATEGY_DIR} (e.g. gpt_megatron) or a path to a YAML file")
    if stand_alone(cfg, fields) and world_size != 1:
        raise ValueError(
            f"parallel={cfg.name} (stand-alone: data_degree 1) trains in one process, but this job "
            f"has {world_size} ranks; use parallel=data to train data-parallel over all of them")
    pipeline, data = fields.get("pipeline_degree", 1), fields.get("data_degree")
    expert, context = fields.get("expert_degree", 1), fields.get("context_degree", 1)
    if world_size % (pipeline * expert * context):
        split = f" × context_degree={context}" if context > 1 else ""
        raise ValueError(f"parallel.pipeline_degree={pipeline} × expert_degree={expert}{split} "
                         f"must divide the world size {world_size}")
    stage_ranks = world_size // (pipeline * context)  # those a stage's strategies spread over
    if "tensor_degree" not in fields and split is OperatorSplit.STRATEGIES:
        fields["tensor_degree"] = stage_ranks // (expert * (data or 1))
    tensor = fields.get("tensor_degree", 1)
    if stage_ranks % (tensor * expert):
        raise ValueError(f"parallel.tensor_degree={tensor} must divide the {stage_ranks} ranks "
                         f"of a pipeline stage" + (" per context rank" if context > 1 else ""))
    if split is OperatorSplit.STRATEGIES:
        fields["strategies"] = _strategies(cfg, stage_ranks // tensor, tensor)
    elif split is OperatorSplit.SEARCH and cfg.strategy:  # annotations ("mp": all ranks)
        fields["strategies"] = _strategies(cfg, 1, stage_ranks)
    if offload is not None and host_shards(fields, offload):
        fields["offload_params"] = True
    elif fields.get("enable_parallel_optimizer") and hetero is not None and \
            hetero.get("offload_optimizer"):
        fields["param_dtype"] = PARAM_DTYPES[hetero.param_dtype]  # offload.param_dtype, mirrored
    return ParallelConfig(**fields).resolve(world_size)


def host_shards(fields: Mapping[str, Any], offload: DictConfig) -> bool:
    """Whether each rank's shards of the weights rest on its host: ``offload.params=host``
    under optimizer parallel level2/3 (which shard the weights; ``fields``: the ``parallel``
    group's, :func:`config_fields` or the group itself)."""
    return bool(offload.params == "host" and fields.get("enable_parallel_optimizer")
                and fields.get("optimizer_level", "level1") != "level1")


def group_split(cfg: DictConfig, fields: dict[str, Any] | None = None) -> OperatorSplit:
    """How the ``parallel`` group splits each stage's operators (``parallel.config.
    operator_split``), known before the strategy file is read: searched under
    ``search_mode``, by strategies when it names a ``strategy`` file, by the model's own
    collectives when ``tensor_degree > 1`` asks for a split neither gives, else not at all.
    ``fields``: the group's :func:`config_fields`, where the caller has them."""
    fields = config_fields(cfg) if fields is None else fields
    return operator_split(SimpleNamespace(search_mode=fields.get("search_mode"),
                                          strategies=bool(cfg.get("strategy")),
                                          tensor_degree=fields.get("tensor_degree") or 1))


def stand_alone(cfg: DictConfig, fields: dict[str, Any] | None = None) -> bool:
    """Whether the group trains one replica in one process (``parallel=none``: every degree 1,
    so ``parallelize`` has nothing to do); ``fields`` as for :func:`group_split`."""
    fields = config_fields(cfg) if fields is None else fields
    return fields.get("data_degree") == 1 and \
        group_split(cfg, fields) is OperatorSplit.REPLICAS and \
        all(fields.get(k, 1) == 1 for k in ("pipeline_degree", "expert_degree", "multi_copy")) \
        and not fields.get("enable_parallel_optimizer")


def _strategies(cfg: DictConfig, dp: int, mp: int) -> dict[str, Any]:
    path = Path(cfg.strategy)
    if path.suffix not in (".yaml", ".yml"):
        path = STRATEGY_DIR / f"{cfg.strategy}.yaml"
    return load_strategy_file(path, dp=dp, mp=mp)


def feed_count(config: ParallelConfig) -> int:
    """Into how many slices the global batch is cut: one per data-parallel (× expert-parallel)
    rank, or one where every rank of a stage feeds the whole batch (full_batch)."""
    return 1 if config.shards_operators and config.full_batch else config.batch_ranks


def batch_slice(config: ParallelConfig) -> tuple[int, int]:
    """(index, count): which slice of the global batch this rank feeds (:func:`feed_count`)."""
    if feed_count(config) == 1:
        return 0, 1
    return batch_mesh(config).get_local_rank(), config.batch_ranks


def apply_parallel_mode(model: nn.Module, cfg: DictConfig, *,
                        loss_fn: Callable[[Any, Any], Any] | None = None,
                        example_inputs: tuple | None = None,
                        hetero: DictConfig | None = None, offload: DictConfig | None = None,
                        accumulate: int = 1,
                        init_seed: int | None = None, weights: str | None = None,
                        plan_file: Path | None = None) -> tuple[nn.Module, ParallelConfig]:
    """``model`` parallelised as the ``parallel`` group says (a ``Pipeline`` when it has
    pipeline stages, which need ``loss_fn``), and the resolved config; what was done is logged
    (``Parallelized.explain()``). Needs ``parallel.init()``. ``init_seed``: ``model`` is on the
    meta device and is initialized from it after the split and sharding (deferred init), or
    read from ``weights`` (a local checkpoint: each rank reads its block). ``plan_file``: where
    rank 0 writes the whole account when the log gets a summary (:func:`summarise_sharding`)."""
    config = parallel_config(cfg, parallel.get_world_size(), hetero, accumulate, offload)
    if stand_alone(cfg):
        if init_seed is not None:
            parallel.materialize(model, seed=init_seed, weights=weights)
        return model, config
    if config.pipeline_degree == 1:
        loss_fn = None  # the model computes its own loss
    result = parallel.parallelize(model, config, loss_fn=loss_fn, example_inputs=example_inputs,
                                  init_seed=init_seed, weights=weights)
    parts = result.explain_parts()
    full = "\n".join(parts)  # result.explain(), its accounts computed once
    shown = [summarise_sharding(part) for part in parts]
    if shown != parts and plan_file is not None:
        if parallel.get_rank() == 0:
            plan_file.write_text(full + "\n")
        shown.append(f"(the whole plan, {len(full.splitlines())} lines: {plan_file})")
    log.info("%s", "\n".join(shown) if plan_file is not None else full)
    return result.model, result.config


def summarise_sharding(account: str) -> str:
    """A semi-auto account for the log: each tagged module with a sharded (or partial) layout
    and its sharded tensors, the sharded parameters, and a count of what stays replicated;
    other accounts (and anything else) unchanged. The detail runs to ~130 lines for a 2-layer
    GPT, most of them replicated layouts."""
    lines = account.splitlines()
    if not lines or not lines[0].startswith("semi-auto parallel over"):
        return account
    out, i = [], 0
    while i < len(lines):
        j = i + 1
        while j < len(lines) and lines[j].startswith("    "):
            j += 1
        header, details = lines[i], lines[i + 1:j]
        sharded = [d for d in details if "S(" in d or "P(" in d]
        if not details or sharded or header.endswith(":"):
            out += [header, *sharded]
        if header == "parameters:" and len(details) > len(sharded):
            out.append(f"    ... and {len(details) - len(sharded)} replicated parameters")
        i = j
    return "\n".join(out)


def check_deferred_recipe(cfg: DictConfig, device: torch.device) -> None:
    """ValueError naming the setting when ``model.init_device=meta`` meets hetero settings it is
    not built for (placement and optimizer offload take a model with values; deferred
    initialization allocates on the accelerator in use, ``hetero.device=device``; under
    ``offload.params=host`` it allocates the whole model in host memory instead)."""
    if cfg.model.name in ("hf", "custom"):
        raise ValueError(f"model.init_device=meta with model={cfg.model.name} is not built yet: "
                         f"deferred initialization generates each tensor from the recipe GPT's "
                         f"init_parameter (HuggingFace's _init_weights is not replayed per "
                         f"tensor); use model.init_device=device")
    h = cfg.hetero
    on_host = cfg.get("offload") is not None and cfg.offload.params != "device"
    why = ("hetero.cpu_modules" if h.cpu_modules else
           "offload.optimizer=host" if h.offload_optimizer and not on_host else
           f"hetero.device={h.device}" if device != hd.resolve("device") else None)
    if why is not None:
        raise ValueError(f"model.init_device=meta with {why} is not built yet: deferred "
                         f"initialization allocates on the accelerator in use after "
                         f"parallelize; use model.init_device=device")
