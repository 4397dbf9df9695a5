"""``Recipe``: the part every training recipe shares (torchtune's setup / train / cleanup shape).

A recipe subclass builds its parts in ``setup`` (after :meth:`Recipe.init_distributed`) and says
how one step goes: :meth:`~Recipe.forward` (zero the gradients, take the step's batch, return the
loss), :meth:`~Recipe.backward` and :meth:`~Recipe.step` (clip, optimizer step). The loop here
does the rest, the same way for every recipe:

* the loss averaged over the ranks is checked after backward and before any update: a NaN/Inf
  loss stops the run with :class:`NonFiniteLossError` (``trainer.on_nonfinite_loss=stop``, the
  default) or skips the update on every rank alike (``skip``), so no non-finite state is
  trained into the weights. The average stays on the device (an asynchronous all-reduce issued
  after backward, so forward and backward are queued without a wait between them); the host
  reads one finiteness flag per step, before the update, or, where the optimizer skips on the
  device (a fused torch optimizer), a step later without waiting (:mod:`recipes.finite_guard`),
  and the losses themselves only every
  ``trainer.log_every`` steps (and at checkpoints and the end), a window at a time
  (:class:`recipes.loss_window.LossWindow`);
* a failed collective anywhere in a step is a ``parallel.CollectiveError`` naming the step;
* metrics (``logger=[jsonl,...]``, rank 0), the progress bar, the periodic log line, the summary;
* ``loss.png`` in the run dir at the end, and ``trainer.profile_steps`` traced (rank 0).
"""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import foundation.device as hd
import parallel
from foundation.host_allocator import pin_mmap_threshold
from recipes.config_schema import check_config
from recipes.fail_early import check_world_size, config_errors_once, env_world_size
from recipes.fault_injection import check_kill_at, kill_if_chosen
from recipes.finite_guard import FiniteGuard, NonFiniteLossError, skips_on_device
from recipes.loggers import Loggers
from recipes.loss_window import LossWindow
from recipes.plot import write_run_plot
from recipes.process_exit import open_stderr
from recipes.profiling import StepProfiler
from recipes.quiet_start import release_stop
from recipes.resume import check_fresh_start
from recipes.run_dir import agree_on_run_dir
from recipes.run_settings import check_run_settings
from recipes.stragglers import StragglerWatch

log = logging.getLogger("recipe")


def peak_memory_gib() -> dict[str, float]:
    """The process's peak memory so far: host (the kernel's high-water mark of its resident
    set) and, with an accelerator, the device's peak of allocated bytes (``torch.accelerator``)."""
    peak = {"peak_host_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if hd.has_accelerator():
        peak["peak_device_gib"] = torch.accelerator.max_memory_allocated() / 2**30
    return peak


def show_progress_bar(wanted: bool, stream: Any) -> bool:
    """Whether to draw the progress bar: ``wanted`` (rank 0, ``trainer.progress_bar``) and
    ``stream`` a terminal. Redirected to a file or a pipe (a cluster job's log, ``nohup``), the
    bar would fill it with carriage-return redraws; the log lines every ``trainer.log_every``
    steps show the progress there."""
    if not wanted:
        return False
    if not (hasattr(stream, "isatty") and stream.isatty()):
        log.info("progress bar off: stderr is not a terminal (a log line every "
                 "trainer.log_every steps instead)")
        return False
    return True


class Recipe:
    """Shared loop and bookkeeping; subclasses set ``rate_name``/``units_per_step`` in setup."""

    rate_name = "items_per_s"   # metrics key of the throughput, e.g. tokens_per_s
    rate_unit = "items/s"       # how the log line and the bar show it

    def __init__(self, cfg: DictConfig, run_dir: str | Path) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.start_step = 0
        self.units_per_step = 1
        self.skipped_steps: list[int] = []
        #: each update guarded by its loss being finite (recipes/finite_guard.py)
        self.guard = FiniteGuard(cfg.trainer.get("on_nonfinite_loss", "stop"), self.skipped_steps)
        self._skips_on_device: bool | None = None
        self.metrics: Loggers | None = None  # or any object with log(**record) and close()
        #: the step's total gradient norm before clipping, where ``step`` computed one
        self.grad_norm: torch.Tensor | None = None
        self.stragglers: StragglerWatch | None = None  # trainer.straggler_threshold (train())

    # ------------------------------------------------------------------ what subclasses give

    @staticmethod
    def check(cfg: DictConfig) -> None:
        """Refuse settings this recipe cannot honour (ValueError); runs before any process
        group starts, so the error is reported once (``recipes/fail_early.py``)."""

    def setup(self) -> None:
        raise NotImplementedError

    def forward(self, step: int) -> torch.Tensor:
        """Zero the gradients, run step ``step``'s batch forward, return this rank's loss."""
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        """Backward from ``loss`` (nothing where :meth:`forward` ran it already)."""
        raise NotImplementedError

    def step(self) -> None:
        """Clip and apply the optimizer(s) to the gradients :meth:`backward` left."""
        raise NotImplementedError

    def update(self, loss: torch.Tensor) -> None:
        """Backward from ``loss``, clip, apply the optimizer(s)."""
        self.backward(loss)
        self.step()

    def after_step(self, step: int, record: dict[str, Any]) -> None:
        """Evaluate, checkpoint, add to ``record`` (the step's metrics line)."""

    def postfix(self, record: dict[str, Any]) -> dict[str, str]:
        """What the progress bar shows after each step."""
        shown = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}",
                 "rate": f"{record[self.rate_name]:,.0f}"}
        if "grad_norm" in record:
            shown["gnorm"] = f"{record['grad_norm']:.3g}"
        return shown

    def summary_extras(self) -> dict[str, Any]:
        return {}

    # ------------------------------------------------------------------ shared parts

    def init_distributed(self) -> None:
        """Process group, rank, one voice on the console, the shared run dir, the device
        (deterministic kernels first, where ``trainer.deterministic`` asks: before any runs)."""
        if self.cfg.trainer.get("deterministic"):
            hd.use_deterministic_algorithms()
        parallel.init(timeout=self.cfg.trainer.collective_timeout_s)
        self.rank, self.world_size = parallel.get_rank(), parallel.get_world_size()
        if self.rank != 0:
            logging.getLogger().setLevel(logging.WARNING)
        # the whole resolved config, one line (as torchtitan logs its job config): the run's
        # log says what ran, beside .hydra/config.yaml
        log.info("config: %s", json.dumps(OmegaConf.to_container(self.cfg, resolve=True),
                                          separators=(",", ":"), default=str))
        self.run_dir = Path(agree_on_run_dir(str(self.run_dir)))
        self.run_dir.mkdir(parents=True, exist_ok=True)  # Hydra made it, unless run in-process
        self.device = hd.resolve(self.cfg.hetero.device)

    @property
    def run_id(self) -> str:
        """This run's identity in its checkpoints' manifests: its run directory, resolved (a run
        resumed in the same directory is the same run)."""
        return str(Path(self.run_dir).resolve())

    def build_loggers(self) -> Loggers:
        """The ``logger=[...]`` loggers (rank 0 writes; later steps of a resumed run dropped)."""
        return Loggers(OmegaConf.to_container(self.cfg.get("logger", ["jsonl"])), self.run_dir,
                       enabled=self.rank == 0, resume_step=self.start_step,
                       config=OmegaConf.to_container(self.cfg, resolve=True))

    def train(self) -> dict[str, Any]:
        """Run steps start_step+1 .. max_steps; return the summary (also printed on rank 0)."""
        t = self.cfg.trainer
        losses: list[float] = []
        profiler = StepProfiler(t.get("profile_steps"), self.run_dir, enabled=self.rank == 0)
        bar = tqdm(total=t.max_steps, initial=self.start_step, desc="train", dynamic_ncols=True,
                   disable=not show_progress_bar(self.rank == 0 and t.progress_bar, sys.stderr))
        window = LossWindow()
        checkpoint_every = t.get("checkpoint_every") or 0
        threshold = t.get("straggler_threshold")
        self.stragglers = StragglerWatch(threshold) if threshold is not None else None

        def flush() -> None:  # the window's losses to the host: metrics, bar, log line
            for record in window.flush():
                losses.append(record["loss"])
                self.metrics.log(**record)
                bar.set_postfix(self.postfix(record), refresh=False)
                if record["step"] % t.log_every == 0:
                    log.info("step %d  loss %.4f  lr %.2e  %.0f %s", record["step"],
                             record["loss"], record["lr"], record[self.rate_name], self.rate_unit)

        self.model.train()
        t0 = time.perf_counter()
        with logging_redirect_tqdm(), contextlib.closing(profiler):
            for step in range(self.start_step + 1, t.max_steps + 1):
                kill_if_chosen(t.get("kill_at"), self.rank, step, t.get("kill_scope", "rank"))
                profiler.begin(step)
                t_step = time.perf_counter()
                with parallel.errors.collective_guard(f"training step {step}",
                                                      only_backend_errors=True):
                    self.grad_norm = None
                    try:
                        loss = self._checked_step(step)
                        lr = self.scheduler.get_last_lr()[0]
                        self.scheduler.step()
                        rate = self.units_per_step / (time.perf_counter() - t_step)
                        record = {"step": step, "loss": loss, "lr": lr, self.rate_name: rate}
                        if self.grad_norm is not None:  # read with the loss, in one transfer
                            record["grad_norm"] = self.grad_norm.detach().reshape(())
                        record.update(peak_memory_gib())
                        self.after_step(step, record)  # settles the guard before a checkpoint
                    except NonFiniteLossError:
                        flush()  # the steps before it are logged, as they were trained
                        raise
                    window.add(record, elapsed_s=time.perf_counter() - t0)
                    if (step % t.log_every == 0 or step == t.max_steps
                            or (checkpoint_every and step % checkpoint_every == 0)):
                        flush()
                        self._name_straggler(step)
                bar.update()
                profiler.end(step)
            try:
                self.guard.settle()  # the last step's flag
            except NonFiniteLossError:
                flush()
                raise
        bar.close()
        if self.rank == 0:
            self.metrics.close()  # flushed: the plot reads the metrics file back
            kept = getattr(self.metrics, "records", ())  # a recipe may bring its own logger
            if plot := write_run_plot(self.run_dir, fallback=kept):
                log.info("loss curve: %s", plot)
        return self._summary(losses, time.perf_counter() - t0)

    def _name_straggler(self, step: int) -> None:
        """At a log line: the slowest rank named when it lags (``recipes/stragglers.py``)."""
        message = self.stragglers.check(step) if self.stragglers is not None else None
        if message is not None and self.rank == 0:
            log.warning("%s", message)

    def _checked_step(self, step: int) -> torch.Tensor:
        """One step whose update runs only when the loss over all ranks is finite; returns
        that mean loss, still on the device."""
        with (self.stragglers.forward() if self.stragglers is not None
              else contextlib.nullcontext()):
            loss = self.forward(step)
        self.backward(loss)
        mean = parallel.collectives.all_reduce(loss.detach(), op="mean")  # the same on every rank
        optimizer = getattr(self, "optimizer", None)  # a recipe of several: read on the host
        if self._skips_on_device is None:  # asked once: the optimizer and its weights are set
            self._skips_on_device = optimizer is not None and skips_on_device(
                optimizer, self.model.parameters(), getattr(self, "scaler", None) is not None)
        self.guard.step(step, mean, self.step, optimizer, self._skips_on_device)
        return mean

    def _summary(self, losses: list[float], wall: float) -> dict[str, Any]:
        summary = {
            "steps": f"{self.start_step + 1}..{self.start_step + len(losses)}"
                     if losses else "none (already at max_steps)",
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "wall_time_s": round(wall, 2),
            self.rate_name: round(len(losses) * self.units_per_step / wall) if losses else 0,
            **self.summary_extras(),
            "run_dir": str(self.run_dir),
        }
        if self.skipped_steps:
            summary["skipped_steps"] = self.skipped_steps
        if self.rank == 0:
            shown = {k: f"{v:.4f}" if isinstance(v, float) else v for k, v in summary.items()}
            shown["wall_time_s"] = f"{wall:.1f}"
            print("\nTraining summary\n" + "\n".join(f"  {k:<13} {v}" for k, v in shown.items()),
                  flush=True)
        return summary

    def cleanup(self, *, failed: bool = False) -> None:
        """Close the metrics file and tear the process group down (without waiting for peers
        when this rank is leaving on an error: they may never arrive)."""
        if self.metrics is not None:
            self.metrics.close()
        parallel.destroy(drain=not failed)


def run(recipe_cls: type[Recipe], cfg: DictConfig) -> dict[str, Any]:
    """The body of a recipe's ``@hydra.main``: check every config value and the world size,
    then set up and train. A config error is one line on rank 0 (``recipes/fail_early.py``)."""
    open_stderr()  # Hydra has composed the config: what is written from here on is the run's
    # a setting of the previous release still works, and says so (Python hides them by default)
    warnings.filterwarnings("default", category=DeprecationWarning, module="recipes")
    with config_errors_once():  # before any work: no process group, data or model yet
        check_config(cfg)
        check_run_settings(cfg)  # loggers installed, precision/compile/profiler fit the config
        recipe_cls.check(cfg)
        check_world_size(cfg)
        check_kill_at(cfg.trainer.get("kill_at"), env_world_size())
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        check_fresh_start(cfg.trainer.resume_from, run_dir / cfg.trainer.checkpoint_dir)
    release_stop()  # checked: a stop from here on is a stop (quiet_start.py)
    pin_mmap_threshold()  # freed tensors' pages leave the process (foundation/host_allocator.py)
    recipe = recipe_cls(cfg, run_dir)
    try:
        recipe.setup()
        summary = recipe.train()
    except BaseException:
        recipe.cleanup(failed=True)
        raise
    recipe.cleanup()
    return summary
