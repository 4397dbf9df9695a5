"""Sizes that cannot fit, refused before anything is allocated (issue 38).

``model.d_model=120000`` or ``data.global_batch_size=100000000000`` used to reach the allocator
("tried to allocate 172800000000 bytes") after the process group, the data and half the model
were built. :func:`check_sizes` estimates, from the config alone, a lower bound of the bytes one
rank must hold (the recipe GPT's FP32 parameters, even if sharded over every rank, and the
global batch's token indices) and refuses a setting whose bound exceeds the whole machine's
memory (host RAM plus the accelerator's: no offload can go beyond that), naming the setting,
the estimate and what the machine has. A bound, not a prediction: a config that passes can
still run out of memory; one that fails here never could have run.
"""

from __future__ import annotations

from omegaconf import DictConfig

import foundation.device as hd
from recipes.fail_early import ConfigError

GPT_MODELS = ("gpt", "gpt_moe")
FP32, INDEX = 4, 8  # bytes per parameter value and per sampled batch index (int64)


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def gpt_parameter_count(m: DictConfig) -> int:
    """A lower bound on the recipe GPT's parameters without the vocabulary: per block the
    attention (4 d²) and the 4x MLP (8 d²), plus the position table (``block_size`` × d)."""
    return m.n_layer * 12 * m.d_model * m.d_model + m.block_size * m.d_model


def check_sizes(cfg: DictConfig, world_size: int, capacity: int | None = None) -> None:
    """ConfigError when a size setting cannot fit this machine (``capacity`` bytes; default:
    :func:`foundation.device.machine_memory_bytes`)."""
    capacity = hd.machine_memory_bytes() if capacity is None else capacity
    m, d = cfg.model, cfg.data
    needs = []
    if m.name in GPT_MODELS:
        params = gpt_parameter_count(m)
        needs.append((f"model.d_model={m.d_model} with model.n_layer={m.n_layer} and "
                      f"model.block_size={m.block_size}",
                      params * FP32 / world_size,
                      f"{params:,} FP32 parameters (12·n_layer·d_model² + block_size·d_model) "
                      f"even if sharded over all {world_size} rank(s)"))
    needs.append((f"data.global_batch_size={d.global_batch_size}", d.global_batch_size * INDEX,
                   "the global batch's sampled indices"))
    for setting, size, what in needs:
        if size > capacity:
            raise ConfigError(
                f"{setting} cannot fit: {what} alone take {_gib(size)} per rank, and this "
                f"machine has {_gib(capacity)} of memory (host RAM and accelerator together)",
                "choose a size that fits (the estimate is a lower bound, before activations "
                "and optimizer state)")
