"""Where a run's per-step metrics go: ``logger=[jsonl,csv,tensorboard,wandb]`` (rank 0 only).

Every logger is a small class with one interface (:class:`MetricLogger`: ``log(record)`` and
``close()``); :class:`Loggers` fans each step's record out to the chosen ones and is what a recipe
holds as ``self.metrics``. Each writes into the run directory:

* ``jsonl`` (the default): ``metrics.jsonl``, one JSON object per step (:mod:`recipes.metrics`);
* ``csv``: ``metrics.csv`` with a header row (a column appears when a record first brings it:
  the file is rewritten with the wider header, so every row has every column);
* ``tensorboard``: an event file under ``tensorboard/`` written by
  ``torch.utils.tensorboard.SummaryWriter`` (``tensorboard --logdir RUN_DIR/tensorboard``);
* ``wandb``: a Weights & Biases run under ``wandb/``, offline unless ``WANDB_MODE`` says otherwise
  (no network, no account: ``wandb sync`` uploads it later).

A resumed run drops what was logged past the resumed step first (jsonl and csv rewrite their file,
TensorBoard purges those steps), so each step appears once. TensorBoard and W&B are optional
packages: :func:`check_loggers` refuses a missing one by name, with the pip command, before any
work starts.
"""

from __future__ import annotations

import csv
import importlib.util
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from recipes.metrics import MetricsLogger

#: logger name -> (the module it imports, the pip package that brings it)
OPTIONAL_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}
LOGGERS = ("jsonl", "csv", "tensorboard", "wandb")


class MetricLogger(Protocol):
    """What every logger does: take one step's record, and close at the end of the run."""

    def log(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def _numbers(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's numeric values but the step (what scalar loggers can plot)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class JsonlLogger:
    """``metrics.jsonl``: what :class:`recipes.metrics.MetricsLogger` writes."""

    def __init__(self, run_dir: Path, resume_step: int) -> None:
        self._out = MetricsLogger(run_dir / "metrics.jsonl", enabled=True, resume_step=resume_step)

    def log(self, record: Mapping[str, Any]) -> None:
        self._out.log(**record)

    def close(self) -> None:
        self._out.close()


class CsvLogger:
    """``metrics.csv`` through the ``csv`` module; rows of earlier launches past the resumed step
    are dropped. The rows are kept in memory (one small dict per step) so that a column first
    seen mid-run (``eval_loss`` at the first evaluation) can widen the header of the whole file."""

    def __init__(self, run_dir: Path, resume_step: int) -> None:
        self.path = run_dir / "metrics.csv"
        self.rows: list[dict[str, Any]] = []
        if self.path.exists():
            with open(self.path, newline="", encoding="utf-8") as f:
                self.rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
        self.columns: list[str] = list(dict.fromkeys(k for r in self.rows for k in r))
        self._file = None
        self._rewrite()

    def _rewrite(self) -> None:
        if self._file is not None:
            self._file.close()
        tmp = self.path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, self.columns)
            if self.columns:
                writer.writeheader()
                writer.writerows(self.rows)
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._file, self.columns)

    def log(self, record: Mapping[str, Any]) -> None:
        row = {k: v for k, v in record.items() if isinstance(v, (int, float, str, bool))}
        self.rows.append(row)
        if any(k not in self.columns for k in row):  # a new column: rewrite with the wider header
            self.columns += [k for k in row if k not in self.columns]
            self._rewrite()
        else:
            self._writer.writerow(row)
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class TensorBoardLogger:
    """Scalars through ``torch.utils.tensorboard.SummaryWriter`` into ``RUN_DIR/tensorboard``;
    ``purge_step`` hides the steps an earlier launch logged past the checkpoint it resumes."""

    def __init__(self, run_dir: Path, resume_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"),
                                     purge_step=resume_step + 1 if resume_step else None)

    def log(self, record: Mapping[str, Any]) -> None:
        for key, value in _numbers(record).items():
            self._writer.add_scalar(key, value, global_step=int(record["step"]))

    def close(self) -> None:
        self._writer.close()


class WandbLogger:
    """A W&B run in ``RUN_DIR/wandb``: ``mode`` from ``WANDB_MODE``, offline when unset, so a run
    needs no network or account (``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later).
    The run's config is the resolved Hydra config. Console capture is off: the recipe's own log
    and progress bar stay as they are."""

    def __init__(self, run_dir: Path, resume_step: int, config: Mapping[str, Any] | None) -> None:
        import wandb

        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "hetero-parallel"),
                               name=run_dir.name, dir=str(run_dir), config=dict(config or {}),
                               mode=os.environ.get("WANDB_MODE", "offline"),
                               settings=wandb.Settings(console="off", silent=True))

    def log(self, record: Mapping[str, Any]) -> None:
        self._run.log(_numbers(record), step=int(record["step"]))

    def close(self) -> None:
        self._run.finish()


def check_loggers(names: Iterable[str]) -> None:
    """Refuse unknown logger names and loggers whose optional package is not installed (by name,
    with the pip command), before any work starts."""
    names = list(names)
    if unknown := [n for n in names if n not in LOGGERS]:
        raise ValueError(f"logger={names}: unknown logger(s) {unknown}; choose from "
                         f"{list(LOGGERS)}")
    for name in names:
        module, package = OPTIONAL_PACKAGES.get(name, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(
                f"logger={names} needs the {package} package, which is not installed: "
                f"pip install {package}  (or pip install -e '.[loggers]' for every logger)")


class Loggers:
    """The chosen loggers behind one ``log(**record)``; a no-op unless ``enabled`` (rank 0).
    ``config``: the run's resolved config, given to loggers that store one (W&B)."""

    def __init__(self, names: Iterable[str], run_dir: str | os.PathLike, enabled: bool,
                 resume_step: int = 0, config: Mapping[str, Any] | None = None) -> None:
        names = list(dict.fromkeys(names))
        check_loggers(names)
        run_dir = Path(run_dir)
        self.loggers: list[MetricLogger] = []
        # this launch's records (rank 0), kept only when no metrics file is written: what the
        # end-of-run plot draws then (with jsonl or csv it reads the file, all launches)
        self.records: list[dict[str, Any]] = []
        self._keep = enabled and not {"jsonl", "csv"} & set(names)
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in names:
            if name == "jsonl":
                self.loggers.append(JsonlLogger(run_dir, resume_step))
            elif name == "csv":
                self.loggers.append(CsvLogger(run_dir, resume_step))
            elif name == "tensorboard":
                self.loggers.append(TensorBoardLogger(run_dir, resume_step))
            else:
                self.loggers.append(WandbLogger(run_dir, resume_step, config))

    def log(self, **record: Any) -> None:
        """Hand one step's record to every logger."""
        if self._keep:
            self.records.append(record)
        for logger in self.loggers:
            logger.log(record)

    def close(self) -> None:
        """Close every logger (safe to call twice)."""
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            logger.close()
