"""How the GPT recipe cuts each step's batch and sequence over the ranks, checked before any
process group starts.

The global batch is cut into one slice per batch rank (data × expert), or fed whole where every
rank of a stage feeds it (``full_batch`` under strategies); each slice into pipeline
micro-batches or ``trainer.grad_accum_steps`` parts; each sequence into context-parallel chunks;
the recipe GPT's experts over the expert ranks. Each rule follows from the config and the world
size alone, yet each used to be found only at set-up or at the first step: every rank raised
its own traceback after the process group, the data and the model were built (on a cluster,
after the rendezvous). :func:`check_batch_layout` refuses them first, as one config error.
"""

from __future__ import annotations

from omegaconf import DictConfig

from parallel import ParallelConfig
from parallel.context_parallel.layout import chunk_count
from recipes.fail_early import ConfigError
from recipes.parallel_mode import feed_count, parallel_config
from recipes.size_check import GPT_MODELS


def check_batch_layout(cfg: DictConfig, world_size: int) -> None:
    """ConfigError naming the first cut of the batch, sequence or experts that does not divide
    on ``world_size`` ranks; nothing when the layout itself does not fit them (the world-size
    check reports that)."""
    accumulate = cfg.trainer.get("grad_accum_steps", 1)
    try:
        resolved = parallel_config(cfg.parallel, world_size, cfg.get("hetero"), accumulate,
                                   cfg.get("offload"))
    except ValueError:
        return
    _check_batch(cfg, resolved, accumulate)
    _check_sequence(cfg, resolved)
    _check_experts(cfg, resolved)


def _check_batch(cfg: DictConfig, resolved: ParallelConfig, accumulate: int) -> None:
    batch, ranks = cfg.data.global_batch_size, feed_count(resolved)
    if batch % ranks:
        raise ConfigError(f"data.global_batch_size={batch} does not divide over the {ranks} "
                          f"ranks that each feed a slice of it (data × expert degrees of "
                          f"parallel={cfg.parallel.name})", f"make it a multiple of {ranks}")
    each = batch // ranks
    if resolved.pipeline_degree > 1:
        parts = resolved.micro_batches
        cut = (f"{parts} pipeline micro-batches (parallel.micro_batches="
               f"{parts // accumulate} × trainer.grad_accum_steps={accumulate})"
               if accumulate > 1 else f"parallel.micro_batches={parts} pipeline micro-batches")
    else:
        parts, cut = accumulate, f"trainer.grad_accum_steps={accumulate} parts"
    if each % parts:
        raise ConfigError(f"each rank's {each} samples per step (data.global_batch_size={batch} "
                          f"over {ranks} rank(s)) do not divide into {cut}",
                          f"make data.global_batch_size a multiple of {ranks * parts}")


def _check_sequence(cfg: DictConfig, resolved: ParallelConfig) -> None:
    degree = resolved.context_degree
    chunks, length = chunk_count(degree), cfg.data.get("seq_len")
    if degree > 1 and length is not None and length % chunks:
        raise ConfigError(f"data.seq_len={length} does not divide into the {chunks} chunks "
                          f"context parallel cuts each sequence into (2 × "
                          f"parallel.context_degree={degree}: one early and one late chunk per "
                          f"rank)", f"use a sequence length that is a multiple of {chunks}")


def _check_experts(cfg: DictConfig, resolved: ParallelConfig) -> None:
    m, degree = cfg.model, resolved.expert_degree
    experts = m.get("num_experts") or 0
    if m.get("name") in GPT_MODELS and experts and experts % degree:
        raise ConfigError(f"model.num_experts={experts} does not divide over "
                          f"parallel.expert_degree={degree} ranks",
                          f"make it a multiple of {degree}, or lower parallel.expert_degree")
