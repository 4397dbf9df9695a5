"""Refuse, before the first step, a checkpoint directory some rank cannot write.

Every rank writes its part of each DCP checkpoint (``__<rank>_0.distcp``, ``rank_<r>.pt``), so a
directory that cannot be created or written on any one rank (``/proc/nope``, a read-only mount,
a path only one node sees) would otherwise fail at the first save, after the steps before it
were paid for. :func:`check_writable` creates the directory and writes and removes one probe file
on every rank, then tells every rank what every rank found, so all of them stop with the same
error naming the setting, the path and the ranks.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch.distributed as dist

import parallel


def _probe(directory: Path) -> str | None:
    """Why ``directory`` cannot take a file on this rank, or None."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".write_probe_", dir=directory)
        try:
            os.write(fd, b"ok")
        finally:
            os.close(fd)
            os.unlink(name)
    except OSError as err:
        return f"{type(err).__name__}: {err.strerror or err}"
    return None


def check_writable(directory: str | os.PathLike, setting: str) -> None:
    """Raise ValueError on every rank unless every rank can create ``directory`` and write a file
    in it (collective when the process group spans several ranks). ``setting`` names the config
    value the directory comes from ("trainer.checkpoint_dir=...")."""
    directory = Path(directory)
    mine = _probe(directory)
    everyone: list[Any] = [mine]
    if parallel.is_initialized() and parallel.get_world_size() > 1:
        everyone = [None] * parallel.get_world_size()
        dist.all_gather_object(everyone, mine)
    failed = {rank: why for rank, why in enumerate(everyone) if why is not None}
    if failed:
        ranks = sorted(failed)
        raise ValueError(
            f"{setting}: {directory} is not a writable directory on rank(s) {ranks} "
            f"({failed[ranks[0]]}); every rank writes its part of each checkpoint there, so the "
            f"run stops now rather than at the first save")
