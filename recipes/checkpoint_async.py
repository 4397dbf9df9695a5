"""Asynchronous checkpoints (``trainer.checkpoint_async=true``): training goes on while DCP
writes.

A save copies the state into staging memory (DCP's ``DefaultStager``: pinned host buffers on an
accelerator, kept and reused from one save to the next; torch 2.11's stager serves one save, so
there each save has a new one) and returns; DCP's writer thread puts
those copies into ``step_N.tmp/``. The checkpoint becomes ``step_N/`` only once every rank's
part is written (:func:`recipes.checkpoint.publish`: checksums, then rank 0's rename), so a
kill while it is written leaves the previous checkpoint the newest complete one, and
``resume_from=auto`` (or ``latest``) continues from there.

Three rules keep it correct:

* one save in flight: a save waits for the one before it (its staging buffers are reused);
* the writer thread's collectives (DCP's plan and metadata exchange) run on a gloo group of
  their own (``ProcessGroups.dedicated``), never interleaved with the training step's;
* every rank publishes at the same step: after each step while a save is in flight, the ranks
  agree (a MIN over "my part is written", a host tensor on the default group, which
  ``parallel.init`` always gives a host backend) whether all parts are written, and publish
  together when they are. The last step's save is waited for at once.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

import foundation.device as hd
from foundation.compat import stager_spent
from parallel.dims import ProcessGroups
from recipes.checkpoint import begin_save, publish

log = logging.getLogger(__name__)


class AsyncCheckpointer:
    """At most one asynchronous save in flight (the module docstring); ``run``: the run
    directory recorded in each checkpoint's manifest."""

    def __init__(self, run: str | None) -> None:
        self.stager = self._new_stager()
        self.run = run
        self.writing: tuple[Path, Future] | None = None
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.write_group = ProcessGroups.dedicated("checkpoint write") if distributed else None

    @staticmethod
    def _new_stager() -> DefaultStager:
        pinned = hd.resolve("device").type != "cpu"  # pinned staging only speeds device copies
        return DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False,
                                            use_async_staging=False,
                                            use_non_blocking_copy=False))

    def save(self, root: str | Path, step: int, model: Any, optimizer: Any,
             **kwargs: Any) -> Path | None:
        """Start writing the checkpoint of ``step`` (``recipes.checkpoint.save_checkpoint``'s
        arguments) once the save before it is complete; returns that one's path, if it was
        still in flight."""
        before = self.wait()
        if stager_spent(self.stager):  # torch 2.11's stager serves one save
            self.stager.close()
            self.stager = self._new_stager()
        tmp, state = begin_save(root, step, model, optimizer, **kwargs)
        future = dcp.async_save(state, checkpoint_id=tmp, process_group=self.write_group,
                                async_stager=self.stager)
        assert isinstance(future, Future)  # no asynchronous staging: a plain future
        self.writing = (tmp, future)
        return before

    def poll(self) -> Path | None:
        """After a step: publish the save in flight if every rank's part is written (all ranks
        call it, and agree); returns the checkpoint published, if any."""
        if self.writing is None:
            return None
        done = torch.tensor([int(self.writing[1].done())])
        if self.write_group is not None:  # main-thread, host-only: the default group
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return self.wait() if done.item() else None

    def wait(self) -> Path | None:
        """Wait for the save in flight and publish it; returns its path (None: none)."""
        if self.writing is None:
            return None
        tmp, future = self.writing
        self.writing = None
        future.result()  # the writer's error, if any, is raised here
        return publish(tmp, self.run)

    def close(self) -> None:
        """Release the staging buffers (a save still in flight is abandoned: its directory stays
        ``step_N.tmp/``, never taken for a checkpoint)."""
        self.stager.close()
