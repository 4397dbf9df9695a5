"""``trainer.checkpoint_every_minutes``: checkpoints by time as well as by steps.

A save is collective, so every rank must decide alike at the same step: after each step rank 0
reads its clock and broadcasts whether the interval since the last save has passed (one byte, a
host tensor on the default group's host backend: no device work waits for it). Nothing is
exchanged when no minutes are set. PyTorch Lightning's
``ModelCheckpoint(train_time_interval=...)`` beside ``every_n_train_steps`` is the same pair of
settings.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


class CheckpointClock:
    """Whether a save is due by time (module docstring); ``minutes`` None: never."""

    def __init__(self, minutes: float | None) -> None:
        self.seconds = None if minutes is None else minutes * 60.0
        self.last = time.monotonic()
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1

    def due(self) -> bool:
        """Collective when minutes are set (every rank, after every step): rank 0's answer."""
        if self.seconds is None:
            return False
        flag = torch.tensor([int(time.monotonic() - self.last >= self.seconds)],
                            dtype=torch.uint8)
        if self.distributed:
            dist.broadcast(flag, src=0)
        return bool(flag.item())

    def saved(self) -> None:
        """A checkpoint was just started: the interval starts again."""
        self.last = time.monotonic()
