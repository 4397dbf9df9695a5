"""Atomic, resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout of one checkpoint, ``<checkpoint_dir>/step_000100/``:

* DCP files (``.metadata``, ``__<rank>_0.distcp``): model and optimizer state, collected with
  ``get_state_dict`` so keys are plain parameter names (no DDP ``module.`` prefix) and a checkpoint
  loads into any parallel mode;
* ``rank_00000.pt``, ...: per rank, the step, scheduler state, loss-scaler state (fp16 offload)
  and RNG states (python, torch CPU and accelerator), each written to a temp file and moved into
  place with ``os.replace``;
* ``config.yaml``: the run's resolved config (when the recipe passes it), so a checkpoint says
  what model it holds (``python -m recipes.export`` reads it); ``hf_config.json``: a
  transformers model's own config, when the model is one;
* ``checksums.json``: the SHA-256 of every other file, verified before anything is loaded.

The directory itself is atomic: all ranks write into ``step_000100.tmp/``, and only after a
barrier does rank 0 rename it to ``step_000100/``. A directory named ``step_N`` is complete. A
state holding NaN or Inf is never written (so never becomes the latest checkpoint). Loading is
strict: a model whose parameter names or shapes differ from the checkpoint's is refused, naming
them, unless ``allow_partial`` (``trainer.allow_partial_resume``) asks for a partial load.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

import parallel
from foundation import trusted_checkpoint
from hetero.optim import LossScaler
from recipes.checkpoint_integrity import (
    CheckpointError,
    all_finite,
    checkpoint_digest,
    compare_with_checkpoint,
    verify_checksums,
    write_checksums,
)
from recipes.optimizer_fit import check_optimizer_fits

log = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Optimizer param groups keyed by parameter name, not group index: a pipeline stage's ranks hold
# different parameters, so index-keyed groups of different ranks would collide in DCP's files.
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter that has several (tied weights), first name first."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [n for n in names.values() if len(n) > 1]


def _with_tied_aliases(model: nn.Module, optim_sd: dict[str, Any]) -> dict[str, Any]:
    """The flattened optimizer state with a tied parameter's entries under each of its names
    (``lm_head.weight`` beside ``tok_emb.weight``): torch keys them by the first name only, but
    at another pipeline degree the head's stage holds the weight under the other."""
    out = dict(optim_sd)
    for first, *others in _tied_names(model):
        for key, value in optim_sd.items():
            for part in ("state.", "param_groups."):
                if key.startswith(f"{part}{first}."):
                    for other in others:
                        out[f"{part}{other}.{key[len(part) + len(first) + 1:]}"] = value
    return out


def _options(path: Path, strict: bool = True) -> StateDictOptions:
    """How the checkpoint at ``path`` keys its optimizer state (older ones by group index)."""
    stored = trusted_checkpoint.read_metadata(path).state_dict_metadata
    flat = "optim.param_groups.0.params" not in stored
    return StateDictOptions(flatten_optimizer_state_dict=flat, strict=strict)


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


#: One optimizer, or several over disjoint parameters (Wide&Deep: Adam for the dense part and a
#: sparse optimizer for the tables); ``get_state_dict`` flattens them into one state by name.
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]

CONFIG_FILE = "config.yaml"
HF_CONFIG = "hf_config.json"
TOKENIZER_FILE = "tokenizer.json"  # the run's tokenizer as a tokenizers JSON


def _hf_config(model: nn.Module) -> Any:
    """The transformers config of ``model`` or of a model it wraps (``.module``, ``.model``),
    or None."""
    todo, seen = [model], set()
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        config = getattr(current, "config", None)
        if hasattr(config, "model_type") and hasattr(config, "to_json_file"):
            return config
        todo += [getattr(current, "module", None), getattr(current, "model", None)]
    return None


def _write_model_description(directory: Path, model: nn.Module, config: DictConfig | None,
                             tokenizer: str | None) -> None:
    """``config.yaml``, ``hf_config.json`` and ``tokenizer.json`` (rank 0): what
    ``recipes.export`` dispatches on, and the tokenizer it ships with ``--to hf``."""
    if tokenizer is not None:
        (directory / TOKENIZER_FILE).write_text(tokenizer)
    if config is not None:
        (directory / CONFIG_FILE).write_text(OmegaConf.to_yaml(config, resolve=True))
    if (hf := _hf_config(model)) is not None:
        hf.to_json_file(directory / HF_CONFIG)


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save_checkpoint(root: str | os.PathLike, step: int, model: nn.Module,
                    optimizer: Optimizers, scheduler: Any, device: torch.device, *,
                    scaler: LossScaler | None = None, config: DictConfig | None = None,
                    run: str | None = None, tokenizer: str | None = None,
                    data: dict[str, int] | None = None) -> Path:
    """Write the checkpoint of ``step`` (collective: every rank must call it). Returns its path.
    ``config``: the run's config, kept in the checkpoint as ``config.yaml``; ``run``: the run
    directory, recorded in the manifest (``trainer.keep_last`` deletes only its own);
    ``tokenizer``: the run's tokenizer as a ``tokenizers`` JSON; ``data``: where the data
    source's next batch starts (a streamed source's position, :func:`data_position` reads it).

    CheckpointError, and nothing written, when the state holds NaN or Inf."""
    tmp, state = begin_save(root, step, model, optimizer, scheduler, device, scaler=scaler,
                            config=config, tokenizer=tokenizer, data=data)
    dcp.save(state, checkpoint_id=tmp)
    return publish(tmp, run)


def begin_save(root: str | os.PathLike, step: int, model: nn.Module, optimizer: Optimizers,
               scheduler: Any, device: torch.device, *, scaler: LossScaler | None = None,
               config: DictConfig | None = None, tokenizer: str | None = None,
               data: dict[str, int] | None = None) -> tuple[Path, dict[str, Any]]:
    """A save's first half (collective): the state checked finite, ``step_N.tmp/`` made with
    the model's description and this rank's own file (step, scheduler, RNG, ...). Returns the
    directory and the state DCP writes there (:func:`save_checkpoint`'s arguments)."""
    rank = parallel.get_rank()
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_FLAT)
    optim_sd = _with_tied_aliases(model, optim_sd)
    if not all_finite({"model": model_sd, "optim": optim_sd}):
        raise CheckpointError(f"step {step}: the model or optimizer state holds NaN/Inf; "
                              f"refusing to write {final} (the last good checkpoint stays the "
                              f"latest)")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a crash mid-save
        tmp.mkdir(parents=True)
        _write_model_description(tmp, model, config, tokenizer)
    parallel.barrier()
    extra = {"step": step, "world_size": parallel.get_world_size(),
             "scheduler": scheduler.state_dict(), "rng": _rng_state(device),
             "loss_scaler": scaler.state_dict() if scaler is not None else None,
             "optimizer": type(optimizer).__name__,  # named if a resume uses another
             "data": data}
    _atomic_save(extra, tmp / f"rank_{rank:05d}.pt")
    return tmp, {"model": model_sd, "optim": optim_sd}


def publish(tmp: Path, run: str | None = None) -> Path:
    """A save's second half (collective), once DCP has written every rank's part into ``tmp``:
    the checksums, then rank 0 renames ``step_N.tmp/`` to ``step_N/``, which makes it a complete
    checkpoint. Returns that path."""
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    parallel.barrier()
    write_checksums(tmp, run)
    parallel.barrier()
    if parallel.get_rank() == 0:
        if final.exists():  # the same step saved again, e.g. by a resumed run
            shutil.rmtree(final)
        os.replace(tmp, final)
        log.info("checkpoint %s: digest %s", final, checkpoint_digest(final))
    parallel.barrier()
    return final


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: Optimizers,
                    scheduler: Any, device: torch.device, *, scaler: LossScaler | None = None,
                    allow_partial: bool = False, digest: str | None = None) -> int:
    """Restore everything ``save_checkpoint`` wrote (collective). Returns the checkpoint's step.

    The files are verified against their checksums first, and the model must have exactly the
    checkpoint's parameters and shapes (CheckpointError naming the differences) unless
    ``allow_partial``: then what fits is loaded and the rest keeps its fresh values (logged).
    With a different world size than at save time, model and optimizer still load (DCP
    reshards), but RNG states cannot be matched to ranks and are left as they are.
    """
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no DCP .metadata file)")
    if not verify_checksums(path, digest):
        log.warning("%s has no checksums.json (written by an older version): not verified", path)
    options = _options(path, strict=not allow_partial)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd, "optim": optim_sd}
    first = path / "rank_00000.pt"
    saved_by = torch.load(first, weights_only=True).get("optimizer") if first.exists() else None
    check_optimizer_fits(path, optim_sd, type(optimizer).__name__, saved_by)
    missing, unexpected, reshaped = compare_with_checkpoint(state, path)
    # a tied name the checkpoint lacks (written before GPT's head had its own name) is the
    # same tensor as a name it has: load that one, then point the other at it
    aliases = {f"model.{name}": f"model.{group[0]}" for group in _tied_names(model)
               for name in group[1:]}
    borrowed = {k: aliases[k] for k in missing if k in aliases and aliases[k] not in missing}
    missing = [k for k in missing if k not in borrowed]
    if parallel.get_world_size() > 1:  # pipeline stages hold parts: unexpected only if no rank
        everyone: list[Any] = [None] * parallel.get_world_size()  # holds it
        torch.distributed.all_gather_object(everyone, set(unexpected))
        unexpected = sorted(set.intersection(*everyone))
    differences = [f"{what}: {', '.join(keys)}" for what, keys in (
        ("missing from the checkpoint", missing), ("only in the checkpoint", unexpected),
        ("shape differs", reshaped)) if keys]
    if differences and not allow_partial:
        raise CheckpointError(
            f"{path} does not fit this model ({'; '.join(differences)}); resume with the "
            f"model config it was written with, or set trainer.allow_partial_resume=true to "
            f"load only the matching parameters")
    if differences:
        log.warning("partial resume from %s: %s", path, "; ".join(differences))
        skip = {k.split(": ")[0] for k in reshaped} | set(missing)
        state = _without(state, skip)
    for key in borrowed:
        del state["model"][key.removeprefix("model.")]
    trusted_checkpoint.load(state, path, allow_partial=allow_partial)
    for key, source in borrowed.items():
        state["model"][key.removeprefix("model.")] = state["model"][source.removeprefix("model.")]
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=options)
    rank = parallel.get_rank()
    own = path / f"rank_{rank:05d}.pt"
    extra = torch.load(own if own.exists() else path / "rank_00000.pt", weights_only=True)
    scheduler.load_state_dict(extra["scheduler"])
    if scaler is not None and extra.get("loss_scaler"):
        scaler.load_state_dict(extra["loss_scaler"])
    if extra["world_size"] == parallel.get_world_size():
        _set_rng_state(extra["rng"], device)
    else:
        log.warning("checkpoint %s was written by %d ranks, this job has %d: RNG states not "
                    "restored", path, extra["world_size"], parallel.get_world_size())
    return int(extra["step"])


def data_position(path: str | os.PathLike) -> dict[str, int] | None:
    """The data position ``save_checkpoint`` kept in checkpoint ``path`` (None: none was)."""
    extra = torch.load(Path(path) / "rank_00000.pt", weights_only=True)
    return extra.get("data")


def _without(state: dict[str, Any], keys: set[str]) -> dict[str, Any]:
    """``state`` without the parameters named by DCP key (``model.<name>``), in the model and in
    the optimizer's per-parameter state."""
    names = {k.removeprefix("model.") for k in keys}
    optim = dict(state["optim"])
    if isinstance(optim.get("state"), dict):  # keyed by group index (older checkpoints)
        optim["state"] = {k: v for k, v in optim["state"].items() if k not in names}
    else:  # flattened: "state.<name>.<field>"; the group hyperparameters stay
        optim = {k: v for k, v in optim.items()
                 if not any(k.startswith(f"state.{name}.") for name in names)}
    return {"model": {k: v for k, v in state["model"].items() if k not in names}, "optim": optim}
