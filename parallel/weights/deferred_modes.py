"""Which parallel modes ``parallelize`` can give a meta-device model (deferred initialization),
checked before anything changes, and the seed every rank must agree on.

Built: data parallel, pipeline stages (one or several per rank: ``interleaved_1f1b``, ``zbv``),
alone or with data parallel, optimizer parallel levels 1-3 (FSDP2 shards the meta parameters, then
each rank allocates and fills only its shards), expert parallel (each rank allocates only its
experts), optimizer parallel of an MoE model (experts cut to the rank's ``ep`` shard, then FSDP2
over them and the rest, allocation last), optimizer parallel with ``param_dtype`` (the 16-bit shards
keep their generated FP32 blocks), ``multi_copy``, the pipeline combinations of these, semi-auto and
auto parallel, alone, in pipeline stages, with optimizer parallel (the DTensor blocks stay meta
until FSDP2 has sharded them) or with MoE layers (each DTensor parameter gets storage for its block
only: ``parallel.weights.deferred_spmd``), and hybrid parallel in all of these combinations (the
model's own slices, marked ``mark_model_parallel(dim=)``, get their part of the whole tensor).
Hetero placement tags are refused by name here, so nothing is half-applied:
``parallel.materialize(model)`` first, then ``parallelize`` as usual, trains a tagged model (each
rank then holds the whole model once).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from parallel.weights.deferred_init import check_initializable, seeded


def check_deferred(model: nn.Module, seed: Any, tagged: bool,
                   covered: set[str] | frozenset[str] = frozenset()) -> int:
    """ValueError naming the setting when ``model`` cannot be initialized after sharding (every
    mode can take it; hetero placement tags cannot), or when the ranks' seeds differ; returns
    the seed (default: ``torch.initial_seed()``, what ``torch.manual_seed`` set). Collective
    over the world. ``covered``: canonical names a weights file fills (they need no
    initializer, and when it fills all of them, no agreed seed)."""
    if tagged:
        raise ValueError("parallel.parallelize: hetero placement (modules tagged with "
                         "hetero.set_device) is not built yet with deferred initialization (a "
                         "meta-device model); call parallel.materialize(model, seed=...) before "
                         "parallelize instead")
    check_initializable(model, covered)
    seed = torch.initial_seed() if seed is None else seed
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"parallel.parallelize: init_seed must be a non-negative int, got "
                         f"{seed!r}")
    if covered and not seeded(model, covered):
        return seed  # a weights file gives every value: the ranks' seeds do not matter
    seeds: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seeds, seed)
    if len(set(seeds)) > 1:
        raise ValueError(f"parallel.parallelize: the ranks' init seeds differ ({seeds}); deferred "
                         f"initialization needs the same seed on every rank (pass init_seed= or "
                         f"torch.manual_seed the same value everywhere)")
    return seed
