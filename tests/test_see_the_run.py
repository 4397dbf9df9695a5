"""See the run (issue 28): loggers write files their own tools read back, the loss plot, and the
profiler trace; one two-rank recipe run checks them end to end (rank 0 writes, once)."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from recipe_helpers import compose_train, losses_of, run_recipe
from recipes import loggers as loggers_mod
from recipes.loggers import Loggers, check_loggers
from recipes.plot import main as plot_main
from recipes.plot import read_run
from recipes.profiling import StepProfiler, check_profile_steps
from recipes.run_settings import check_run_settings

PNG = b"\x89PNG\r\n\x1a\n"


def _scalars(logdir: Path, tag: str) -> dict[int, float]:
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def _records(steps: range, eval_at: int | None = None) -> list[dict]:
    out = []
    for s in steps:
        r = {"step": s, "loss": 4.0 / s, "lr": 1e-3, "tokens_per_s": 1000.0}
        if s == eval_at:
            r["eval_loss"] = 4.5 / s
        out.append(r)
    return out


def test_every_logger_writes_a_file_its_tool_reads(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """jsonl and csv read back with json/csv, TensorBoard with EventAccumulator, W&B offline run
    directory with its .wandb file; a resume drops the steps past the checkpoint in each."""
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the default: offline, no network
    names = ["jsonl", "csv", "tensorboard", "wandb"]
    group = Loggers(names, tmp_path, enabled=True, config={"trainer": {"max_steps": 4}})
    for r in _records(range(1, 5), eval_at=4):  # eval_loss first appears at step 4
        group.log(**r)
    group.close()
    assert [r["step"] for r in read_run(tmp_path)] == [1, 2, 3, 4]
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert rows[0]["eval_loss"] == "" and float(rows[3]["eval_loss"]) == pytest.approx(4.5 / 4)
    assert float(rows[1]["loss"]) == 2.0
    assert _scalars(tmp_path / "tensorboard", "loss") == pytest.approx(
        {s: 4.0 / s for s in range(1, 5)})
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb")), runs

    # a resumed launch from step 2: steps 3.. are logged again, once
    group = Loggers(["jsonl", "csv", "tensorboard"], tmp_path, enabled=True, resume_step=2)
    for r in _records(range(3, 6)):
        group.log(**{**r, "loss": r["loss"] + 1})
    group.close()
    assert [r["step"] for r in read_run(tmp_path)] == [1, 2, 3, 4, 5]
    with open(tmp_path / "metrics.csv", newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [1, 2, 3, 4, 5]
    assert _scalars(tmp_path / "tensorboard", "loss")[3] == pytest.approx(4.0 / 3 + 1)


def test_loggers_off_the_first_rank_write_nothing(tmp_path: Path) -> None:
    group = Loggers(["jsonl", "csv", "tensorboard"], tmp_path, enabled=False)
    group.log(step=1, loss=1.0)
    group.close()
    assert list(tmp_path.iterdir()) == []


def test_a_missing_logger_package_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(loggers_mod.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match=r"wandb package.*pip install wandb"):
        check_loggers(["jsonl", "wandb"])
    with pytest.raises(ModuleNotFoundError, match="pip install wandb"):  # at start-up
        check_run_settings(compose_train(["logger=[jsonl,wandb]"]))
    with pytest.raises(ValueError, match=r"unknown logger\(s\) \['mlflow'\]"):
        check_loggers(["mlflow"])


def test_plot_command_puts_several_runs_on_one_png(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    for name, eval_at in (("a", 3), ("b", None)):
        Path(tmp_path / name).mkdir()
        group = Loggers(["jsonl" if name == "a" else "csv"], tmp_path / name, enabled=True)
        for r in _records(range(1, 4), eval_at):
            group.log(**r)
        group.close()
    out = plot_main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "c.png")])
    assert out.read_bytes()[:8] == PNG and "2 run(s)" in capsys.readouterr().out
    assert plot_main([str(tmp_path / "b")]) == tmp_path / "b" / "loss.png"  # one run: beside it
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl or metrics.csv"):
        plot_main([str(tmp_path / "c.png")])


def test_profile_steps_rules_and_trace(tmp_path: Path) -> None:
    assert check_profile_steps(None, 10) == []
    assert "first <= last" in check_profile_steps([3, 2], 10)[0]
    assert "trainer.max_steps=10" in check_profile_steps([2, 11], 10)[0]
    with pytest.raises(ValueError, match=r"trainer.profile_steps=\[5, 9\]"):
        check_run_settings(compose_train(["trainer.max_steps=6", "trainer.profile_steps=[5,9]"]))
    prof = StepProfiler([2, 3], tmp_path, enabled=True)
    x = torch.randn(64, 64)
    for step in range(1, 5):
        prof.begin(step)
        x = torch.tanh(x @ x)
        prof.end(step)
    prof.close()
    trace = json.loads(prof.trace.read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"step 2", "step 3"} <= names and "step 1" not in names and "step 4" not in names


@pytest.mark.slow
def test_recipe_run_writes_loggers_plot_and_trace_from_rank_zero(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks, every logger, an eval, a profiled window: each file once, read back."""
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the default: offline, no network
    run = tmp_path / "run"
    run_recipe(["trainer.max_steps=4", "trainer.eval_every=2", "trainer.eval_batches=1",
                "logger=[jsonl,csv,tensorboard,wandb]", "trainer.profile_steps=[2,3]"],
               nproc=2, run=run, cache=tmp_path / "cache")
    losses = losses_of(run)
    assert sorted(losses) == [1, 2, 3, 4]
    assert _scalars(run / "tensorboard", "loss") == pytest.approx(losses, rel=1e-6)
    assert sorted(_scalars(run / "tensorboard", "eval_loss")) == [2, 4]
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 1  # rank 0 only
    with open(run / "metrics.csv", newline="") as f:
        assert [float(r["loss"]) for r in csv.DictReader(f)] == pytest.approx(
            [losses[s] for s in range(1, 5)])
    assert len(list((run / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
    assert (run / "loss.png").read_bytes()[:8] == PNG
    trace = json.loads((run / "profile_steps_2-3_rank0.json").read_text())
    assert any(e.get("name") == "step 2" for e in trace["traceEvents"])
    assert not list(run.glob("profile_*rank1*"))


@pytest.mark.slow
def test_wide_deep_run_has_the_loggers_and_the_plot(tmp_path: Path) -> None:
    """The Wide&Deep recipe shares the loop: csv beside jsonl, its eval log loss, loss.png."""
    from test_wide_deep import run_wide_deep

    run = tmp_path / "wd"
    records = run_wide_deep(["parallel=none", "trainer.max_steps=4", "trainer.eval_every=2",
                             "logger=[jsonl,csv]"], nproc=None, run=run)
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["loss"]) for r in rows] == pytest.approx([r["loss"] for r in records])
    assert [r["step"] for r in rows if r["eval_logloss"]] == ["2", "4"]
    assert (run / "loss.png").read_bytes()[:8] == PNG


def test_without_a_metrics_file_the_plot_draws_this_launch(tmp_path: Path) -> None:
    """logger=[tensorboard] alone: loss.png still comes, from the records kept in memory."""
    from recipes.plot import write_run_plot

    group = Loggers(["tensorboard"], tmp_path, enabled=True)
    for r in _records(range(1, 4)):
        group.log(**r)
    group.close()
    assert len(group.records) == 3
    assert write_run_plot(tmp_path, fallback=group.records).read_bytes()[:8] == PNG
    assert Loggers(["jsonl"], tmp_path / "j", enabled=True).records == []  # reads the file
