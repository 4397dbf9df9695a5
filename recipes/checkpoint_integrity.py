"""What makes a checkpoint safe to resume from: checksums of its files, and a model that fits it.

* :func:`write_checksums` records the SHA-256 of every file of a checkpoint in
  ``checksums.json``; :func:`verify_checksums` recomputes them on load (the files spread over the
  ranks; in one process when there is no process group, as ``recipes.export`` runs) and names
  every file that is missing or changed, so 4 KiB overwritten inside a ``.distcp`` (size
  unchanged) is an error, not a run that goes NaN.
* :func:`compare_with_checkpoint` sets the state the job is about to load against what the
  checkpoint's DCP metadata holds: keys missing from it, keys only it has, tensors whose shapes
  differ. A resume refuses any of them unless a partial load was asked for.
* :func:`all_finite` says whether every floating tensor of a state is finite (no NaN checkpoint
  is ever written).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor

import parallel
from foundation import trusted_checkpoint

CHECKSUMS = "checksums.json"


class CheckpointError(RuntimeError):
    """A checkpoint is corrupt, incomplete, or does not fit the model it is loaded into."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _mine(names: list[str]) -> list[str]:
    """This rank's share of ``names`` (every rank hashes a part; rank 0 gathers); all of them
    without a process group (``python -m recipes.export`` verifies in one process)."""
    if not _distributed():
        return names
    return names[parallel.get_rank()::parallel.get_world_size()]


def _everyone(mine: Any) -> list[Any]:
    """``mine`` of every rank (all_gather_object), or ``[mine]`` without a process group."""
    if not _distributed():
        return [mine]
    everyone: list[Any] = [None] * parallel.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def write_checksums(directory: Path, run: str | None = None) -> None:
    """Hash every file of ``directory`` (collective) into ``checksums.json`` (rank 0 writes), the
    project's manifest of a checkpoint; ``run``: the run that wrote it (:func:`written_by`)."""
    names = sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != CHECKSUMS)
    mine = {name: _sha256(directory / name) for name in _mine(names)}
    everyone = _everyone(mine)
    if not _distributed() or parallel.get_rank() == 0:
        table = {k: v for part in everyone for k, v in part.items()}
        tmp = directory / (CHECKSUMS + ".tmp")
        manifest = {"sha256": dict(sorted(table.items())), **({"run": run} if run else {})}
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, directory / CHECKSUMS)


def written_by(directory: Path) -> str | None:
    """The run recorded in ``directory``'s manifest; None for a directory without one (not a
    checkpoint, an older version's, or unreadable)."""
    try:
        manifest = json.loads((directory / CHECKSUMS).read_text())
    except (OSError, ValueError):
        return None
    run = manifest.get("run") if isinstance(manifest, dict) else None
    return run if isinstance(run, str) else None


def checkpoint_digest(directory: Path) -> str:
    """One digest of the whole checkpoint at ``directory``: the SHA-256 of its manifest, which
    holds the SHA-256 of every file. Pinning it (``trainer.resume_digest``, ``recipes.export
    --digest``) pins every byte that is read."""
    manifest = directory / CHECKSUMS
    if not manifest.is_file():
        raise CheckpointError(f"{directory} has no {CHECKSUMS} (written by an older version): it "
                              f"has no digest")
    return "sha256:" + _sha256(manifest)


def verify_checksums(directory: Path, digest: str | None = None) -> bool:
    """Check every file against ``checksums.json`` (collective); CheckpointError naming the bad
    files. False when the checkpoint has no checksums (written before they existed). ``digest``:
    the :func:`checkpoint_digest` the checkpoint must have (received out of band); a checkpoint
    without a manifest, or with another one, is then refused before anything else is read."""
    table_path = directory / CHECKSUMS
    if digest is not None:
        found = checkpoint_digest(directory)
        if found != digest:
            raise CheckpointError(f"{directory} has digest {found}, not the expected {digest}: "
                                  f"it is not the checkpoint that was pinned")
    if not table_path.is_file():
        return False
    expected = json.loads(table_path.read_text())["sha256"]
    bad = []
    for name in _mine(sorted(expected)):
        path = directory / name
        if not path.is_file():
            bad.append(f"{path} is missing")
        elif _sha256(path) != expected[name]:
            bad.append(f"{path} does not match its checksum (corrupted or changed since saved)")
    everyone = _everyone(bad)
    if found := sorted(b for part in everyone for b in part):
        raise CheckpointError("checkpoint failed verification: " + "; ".join(found))
    return True


def _tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(DCP key, leaf) pairs of a nested state dict, keys dotted as DCP flattens them."""
    if isinstance(state, dict):
        for key, value in state.items():
            yield from _tensors(value, f"{prefix}{key}.")
    elif isinstance(state, (list, tuple)) and not isinstance(state, torch.Size):
        for i, value in enumerate(state):
            yield from _tensors(value, f"{prefix}{i}.")
    else:
        yield prefix[:-1], state


def compare_with_checkpoint(state: dict[str, Any], path: Path) -> tuple[list[str], list[str],
                                                                         list[str]]:
    """(missing, unexpected, reshaped) tensor keys of the ``"model"`` part of ``state`` against
    the checkpoint at ``path``; reshaped entries read ``key: checkpoint (a, b) vs model (c, d)``."""
    stored = trusted_checkpoint.read_metadata(path).state_dict_metadata
    stored = {k: v for k, v in stored.items() if k.startswith("model.")}
    ours = dict(_tensors({"model": state["model"]}))
    missing = sorted(k for k in ours if k not in stored)
    unexpected = sorted(k for k in stored if k not in ours)
    reshaped = []
    for key in sorted(set(ours) & set(stored)):
        value, meta = ours[key], stored[key]
        if isinstance(meta, TensorStorageMetadata) and isinstance(value, torch.Tensor):
            if tuple(meta.size) != tuple(value.shape):
                reshaped.append(f"{key}: checkpoint {tuple(meta.size)} vs model "
                                f"{tuple(value.shape)}")
    return missing, unexpected, reshaped


def all_finite(state: Any) -> bool:
    """Whether every floating-point tensor in ``state`` is free of NaN and Inf (collective:
    the answer is the same on every rank)."""
    ok = True
    for _, value in _tensors(state):
        if isinstance(value, DTensor):
            value = value.to_local()
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            ok = ok and bool(torch.isfinite(value).all())
    flag = torch.tensor([0.0 if ok else 1.0])
    return parallel.collectives.all_reduce(flag, op="max").item() == 0.0
