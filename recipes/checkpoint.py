"""Atomic, resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout of one checkpoint, ``<checkpoint_dir>/step_000100/``:

* DCP files (``.metadata``, ``__<rank>_0.distcp``): model and optimizer state, collected with
  ``get_state_dict`` so keys are plain parameter names (no DDP ``module.`` prefix) and a checkpoint
  loads into any parallel mode;
* ``rank_00000.pt``, ...: per rank, the step, scheduler state and RNG states (python, torch CPU
  and accelerator), each written to a temp file and moved into place with ``os.replace``.

The directory itself is atomic: all ranks write into ``step_000100.tmp/``, and only after a
barrier does rank 0 rename it to ``step_000100/``. A directory named ``step_N`` is complete.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import parallel

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(root: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of ``step`` lives under ``root``."""
    return Path(root) / f"step_{step:06d}"


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step under ``root`` (None if there is none)."""
    root = Path(root)
    steps = [(int(m.group(1)), p) for p in root.glob("step_*")
             if (m := _STEP_DIR.match(p.name)) and p.is_dir()] if root.is_dir() else []
    return max(steps)[1] if steps else None


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type != "cpu":
        state["device"] = torch.get_device_module(device).get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "device" in state and device.type != "cpu":
        torch.get_device_module(device).set_rng_state(state["device"], device)


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(root: str | os.PathLike, step: int, model: nn.Module,
                    optimizer: torch.optim.Optimizer, scheduler: Any,
                    device: torch.device) -> Path:
    """Write the checkpoint of ``step`` (collective: every rank must call it). Returns its path."""
    rank = parallel.get_rank()
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a crash mid-save
        tmp.mkdir(parents=True)
    parallel.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    extra = {"step": step, "world_size": parallel.get_world_size(),
             "scheduler": scheduler.state_dict(), "rng": _rng_state(device)}
    _atomic_save(extra, tmp / f"rank_{rank:05d}.pt")
    parallel.barrier()
    if rank == 0:
        if final.exists():  # the same step saved again, e.g. by a resumed run
            shutil.rmtree(final)
        os.replace(tmp, final)
    parallel.barrier()
    return final


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any, device: torch.device) -> int:
    """Restore everything ``save_checkpoint`` wrote (collective). Returns the checkpoint's step.

    With a different world size than at save time, model and optimizer still load (DCP
    reshards), but RNG states cannot be matched to ranks and are left as they are.
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no DCP .metadata file)")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    rank = parallel.get_rank()
    own = path / f"rank_{rank:05d}.pt"
    extra = torch.load(own if own.exists() else path / "rank_00000.pt", weights_only=True)
    scheduler.load_state_dict(extra["scheduler"])
    if extra["world_size"] == parallel.get_world_size():
        _set_rng_state(extra["rng"], device)
    else:
        log.warning("checkpoint %s was written by %d ranks, this job has %d: RNG states not "
                    "restored", path, extra["world_size"], parallel.get_world_size())
    return int(extra["step"])
