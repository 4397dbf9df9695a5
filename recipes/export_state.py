"""The full, unsharded model state of a recipe checkpoint, read in one process.

A checkpoint (``recipes/checkpoint.py``) holds the model under ``model.<name>`` in DCP's files,
whatever layout wrote it: semi-auto and optimizer-parallel DTensor shards, pipeline stages (each
stage's ranks wrote their parameters under the original names), expert-parallel stacked experts,
parameter-server table blocks. DCP's own reader assembles every tensor whole: the state to fill
is built from the checkpoint's metadata (names, shapes, dtypes) and ``dcp.load(no_dist=True)``
reads it without a process group — the public form of what ``format_utils.dcp_to_torch_save``
does, restricted to the model (the optimizer state can be several times its size).

Before reading, the files are verified against the checkpoint's ``checksums.json``. Names are the
plain model's: a prefix every name shares that only a wrapper adds (``module.``, ``_orig_mod.``,
torch's activation-checkpoint and FSDP wrapper names, ``stages.N.``) is removed. Under
``offload=optimizer`` the model holds 16-bit weights and the optimizer the FP32 masters
(``fp32_master``); :func:`read_model_state` returns the masters by default, as DeepSpeed's
``zero_to_fp32`` does, since they are the weights training converged to.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from foundation import trusted_checkpoint
from recipes.checkpoint import CONFIG_FILE, HF_CONFIG
from recipes.checkpoint_integrity import CheckpointError, verify_checksums

log = logging.getLogger(__name__)

MODEL, MASTER = "model.", ".fp32_master"
#: what a wrapper inserts into parameter names (torch.compile, activation checkpointing, FSDP1)
_WRAPPER_PARTS = re.compile(r"(^|\.)(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)"
                            r"(?=\.)")
#: a prefix that a wrapper (DDP-style ``module.``) or a pipeline stage container adds to all names
_SHARED_PREFIX = re.compile(r"^(module\.|stages?\.\d+\.|stage_\d+\.)")


@dataclass
class CheckpointModel:
    """A checkpoint's model: its state by plain name, and what the checkpoint says it is."""

    path: Path
    state: dict[str, torch.Tensor]
    config: DictConfig | None       # the run's config (config.yaml, or .hydra/ of its run dir)
    hf_config: dict[str, Any] | None  # a transformers model's config.json (hf_config.json)
    from_master: bool               # whether the weights are the FP32 masters of an offload run


def saved_config(path: Path) -> DictConfig | None:
    """The run config a checkpoint was written with: its own ``config.yaml`` or, for one written
    before checkpoints kept it, the ``.hydra/config.yaml`` of the run directory above it."""
    if (path / CONFIG_FILE).is_file():
        return OmegaConf.load(path / CONFIG_FILE)
    for parent in path.resolve().parents:
        if (parent / ".hydra" / "config.yaml").is_file():
            return OmegaConf.load(parent / ".hydra" / "config.yaml")
    return None


def plain_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` under the plain model's names (wrapper parts and shared wrapper prefixes gone);
    CheckpointError when two names would become one."""
    out = {_WRAPPER_PARTS.sub("", name).lstrip("."): t for name, t in state.items()}
    if len(out) != len(state):
        raise CheckpointError("removing wrapper names (_orig_mod, ...) makes two parameter "
                              "names equal; the checkpoint holds two models")
    while out and (m := _SHARED_PREFIX.match(next(iter(out)))) and \
            all(k.startswith(m.group(1)) for k in out):
        out = {k[len(m.group(1)):]: t for k, t in out.items()}
    return out


def read_model_state(path: str | Path, weights: str = "auto", digest: str | None = None
                     ) -> CheckpointModel:
    """Verify and read the model of the checkpoint at ``path`` whole, in this process.

    ``weights``: ``auto`` (the FP32 masters when the optimizer holds them, else the model's
    tensors), ``model`` (the tensors the model trained with) or ``master`` (refused by name when
    the checkpoint has none)."""
    path = Path(path)
    if weights not in ("auto", "model", "master"):
        raise ValueError(f"weights={weights!r} must be one of auto, model, master")
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no DCP .metadata file): "
                                f"give a checkpoints/step_N directory")
    if not verify_checksums(path, digest):
        log.warning("%s has no checksums.json (written by an older version): not verified", path)
    stored = trusted_checkpoint.read_metadata(path).state_dict_metadata
    tensors = {k: v for k, v in stored.items() if isinstance(v, TensorStorageMetadata)}
    names = [k[len(MODEL):] for k in tensors if k.startswith(MODEL)]
    if not names:
        raise CheckpointError(f"{path} holds no model tensors (no 'model.*' keys)")
    masters = {n: f"optim.state.{n}{MASTER}" for n in names
               if f"optim.state.{n}{MASTER}" in tensors}
    if weights == "master" and not masters:
        raise ValueError(f"--weights master: {path} has no FP32 master weights (only runs with "
                         f"offload=optimizer keep them); use --weights model")
    use_master = weights != "model" and bool(masters)
    keys = {n: masters.get(n, MODEL + n) if use_master else MODEL + n for n in names}
    state = {key: torch.empty(tuple(tensors[key].size), dtype=tensors[key].properties.dtype)
             for key in keys.values()}
    trusted_checkpoint.load(state, path, no_dist=True)
    hf_path = path / HF_CONFIG
    hf_config = OmegaConf.to_container(OmegaConf.load(hf_path)) if hf_path.is_file() else None
    return CheckpointModel(path, plain_names({n: state[k] for n, k in keys.items()}),
                           saved_config(path), hf_config, use_master)
