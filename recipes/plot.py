"""Loss curves of one or several runs in one PNG.

    python -m recipes.plot outputs/runs/a                      # -> outputs/runs/a/loss.png
    python -m recipes.plot outputs/runs/a outputs/runs/b --out compare.png

Each run is read from its run directory (``metrics.jsonl``, else ``metrics.csv``): the training
loss per step as a line, and ``eval_loss`` (Wide&Deep: ``eval_logloss``) when the run evaluated,
as markers in the same colour.
Every recipe also writes ``loss.png`` into its run directory at the end of a run
(:func:`write_run_plot`). Drawn with matplotlib's object API on the Agg canvas (no display, no
global pyplot state), so it works on a headless node and inside a training process.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from recipes.metrics import read_metrics

PLOT_NAME = "loss.png"
EVAL_KEYS = ("eval_loss", "eval_logloss")  # GPT's held-out loss; Wide&Deep's log loss
log = logging.getLogger(__name__)


def read_run(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The per-step records a run logged: ``metrics.jsonl``, else ``metrics.csv``."""
    run_dir = Path(run_dir)
    if (run_dir / "metrics.jsonl").is_file():
        return read_metrics(run_dir / "metrics.jsonl")
    if (run_dir / "metrics.csv").is_file():
        with open(run_dir / "metrics.csv", newline="", encoding="utf-8") as f:
            return [{k: float(v) for k, v in row.items() if v not in ("", None)}
                    for row in csv.DictReader(f)]
    raise FileNotFoundError(f"{run_dir} has no metrics.jsonl or metrics.csv (run the recipe with "
                            f"logger=[jsonl] or logger=[csv] to plot it)")


def _series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    points = [(float(r["step"]), float(r[key])) for r in records
              if key in r and "step" in r and r[key] is not None]
    return [s for s, _ in points], [v for _, v in points]


def plot_runs(runs: Mapping[str, Sequence[Mapping[str, Any]]], out: str | os.PathLike,
              title: str = "loss") -> Path:
    """Draw each run's ``loss`` (line) and ``eval_loss`` (markers) against the step; save a PNG."""
    from matplotlib.figure import Figure  # here: only plotting needs matplotlib imported

    if not runs:
        raise ValueError("plot_runs: no runs to plot")
    fig = Figure(figsize=(7, 4.5), dpi=120)
    ax = fig.add_subplot()
    for i, (label, records) in enumerate(runs.items()):
        color = f"C{i % 10}"
        steps, loss = _series(records, "loss")
        if not steps:
            raise ValueError(f"plot_runs: run {label!r} has no 'loss' records")
        ax.plot(steps, loss, color=color, linewidth=1.2, label=f"{label} train")
        for key in EVAL_KEYS:  # the first held-out loss the run logged
            steps, loss = _series(records, key)
            if steps:
                break
        if steps:
            ax.plot(steps, loss, color=color, linestyle="--", marker="o", markersize=4,
                    label=f"{label} eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def _labels(run_dirs: Sequence[Path]) -> list[str]:
    """Each run's directory name, or its whole path where two names are the same."""
    names = [p.name for p in run_dirs]
    return [n if names.count(n) == 1 else str(p) for n, p in zip(names, run_dirs, strict=True)]


def write_run_plot(run_dir: str | os.PathLike,
                   fallback: Sequence[Mapping[str, Any]] = ()) -> Path | None:
    """``RUN_DIR/loss.png`` from the run's metrics file (every launch of a resumed run), or from
    ``fallback`` records when no metrics file was written; None when there is nothing to plot."""
    run_dir = Path(run_dir)
    try:
        records = read_run(run_dir)
    except FileNotFoundError:
        records = list(fallback)
    if not any("loss" in r for r in records):
        return None
    if importlib.util.find_spec("matplotlib") is None:  # a dependency; a broken install should
        log.warning("no loss.png: matplotlib is not installed (pip install matplotlib)")
        return None  # not cost the run it ends
    return plot_runs({run_dir.name: records}, run_dir / PLOT_NAME, title=f"loss: {run_dir.name}")


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m recipes.plot", description=__doc__.split(
        "\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, default=None,
                        help="PNG to write (default: RUN_DIR/loss.png for one run, "
                             "loss_curves.png here for several)")
    parser.add_argument("--title", default="loss")
    args = parser.parse_args(argv)
    runs = {label: read_run(p) for label, p in zip(_labels(args.run_dirs), args.run_dirs,
                                                    strict=True)}
    out = args.out or (args.run_dirs[0] / PLOT_NAME if len(runs) == 1
                       else Path("loss_curves.png"))
    path = plot_runs(runs, out, title=args.title)
    print(f"wrote {path} ({len(runs)} run(s))")
    return path


if __name__ == "__main__":
    main()
