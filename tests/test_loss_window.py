"""The training loop reads losses to the host a window at a time (issue 24, finding 9): per step
it queues forward, backward and the loss all-reduce without waiting, reads one finiteness flag
before the update (so ``trainer.on_nonfinite_loss`` still acts before it, alike on every rank:
the flag comes from the all-reduced mean), and reads the losses only every
``trainer.log_every`` steps, the values ``.item()`` would have given each step."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

import parallel
from recipe_helpers import losses_of, train_in_process
from recipes.base import NonFiniteLossError, Recipe
from recipes.loss_window import LossWindow
from recipes.metrics import MetricsLogger, read_metrics

EVENTS: list[str] = []


class Watched(torch.Tensor):
    """A loss tensor that notes every read of its values by the host."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in ("item", "tolist", "__bool__", "__float__"):
            EVENTS.append(f"read {args[0].numel()}")
        return super().__torch_function__(func, types, args, kwargs or {})


class Scripted(Recipe):
    """A recipe whose steps only note what the loop asks of them; step 5's loss is NaN."""

    rate_name = "items_per_s"

    def __init__(self, tmp_path, policy: str = "stop", log_every: int = 2) -> None:
        cfg = OmegaConf.create({"trainer": {"max_steps": 6, "log_every": log_every,
                                            "on_nonfinite_loss": policy,
                                            "progress_bar": False}})
        super().__init__(cfg, tmp_path)
        self.rank, self.model = 0, torch.nn.Linear(1, 1)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            torch.optim.SGD(self.model.parameters(), lr=1.0), lambda s: 1.0)
        self.metrics = MetricsLogger(tmp_path / "metrics.jsonl", enabled=True)

    def forward(self, step: int) -> torch.Tensor:
        EVENTS.append(f"forward {step}")
        value = float("nan") if step == 5 else 1.0 / (3 * step)
        return torch.tensor(value).as_subclass(Watched)

    def backward(self, loss: torch.Tensor) -> None:
        EVENTS.append("backward")

    def step(self) -> None:
        EVENTS.append("step")
        self.scheduler.optimizer.step()

    def after_step(self, step: int, record: dict) -> None:
        pass


@pytest.fixture
def events(monkeypatch):
    def all_reduce(tensor, op="sum", group=None):
        EVENTS.append("all_reduce")
        return tensor.clone()

    monkeypatch.setattr(parallel.collectives, "all_reduce", all_reduce)
    EVENTS.clear()
    return EVENTS


def test_losses_cross_to_the_host_once_per_window_after_backward(tmp_path, events):
    recipe = Scripted(tmp_path, policy="skip")
    summary = recipe.train()
    step = ["backward", "all_reduce", "read 1", "step"]  # the flag, then the update
    assert events[:5] == ["forward 1", *step]
    assert events[5:11] == ["forward 2", *step, "read 2"]  # steps 1 and 2's losses at once
    assert events[16:22] == ["forward 4", *step, "read 2"]
    # step 5 is NaN: no update, its value read for the warning; then its window as usual
    assert events[22:27] == ["forward 5", "backward", "all_reduce", "read 1", "read 1"]
    assert summary["skipped_steps"] == [5]
    logged = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]
    for record in logged:  # bitwise what .item() of each step's float32 loss gives
        want = torch.tensor(float("nan") if record["step"] == 5
                            else 1.0 / (3 * record["step"])).item()
        assert record["loss"] == want or (record["loss"] != record["loss"] and want != want)
    assert list(logged[0]) == ["step", "loss", "lr", "items_per_s", "peak_host_gib", "elapsed_s"]


def test_a_non_finite_loss_stops_before_its_update_with_the_window_logged(tmp_path, events):
    recipe = Scripted(tmp_path, policy="stop", log_every=4)
    with pytest.raises(NonFiniteLossError, match="step 5: the loss is nan"):
        recipe.train()
    assert events[-4:] == ["backward", "all_reduce", "read 1", "read 1"]  # no "step"
    recipe.metrics.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


def test_a_loss_window_refuses_a_loss_that_is_not_a_tensor():
    window = LossWindow()
    with pytest.raises(TypeError, match="loss must be a 0-dim tensor, got float"):
        window.add({"loss": 0.5})
    assert window.flush() == []


def test_the_gpt_recipe_logs_the_same_losses_whatever_the_window(tmp_path):
    cache = tmp_path / "cache"
    runs = {every: tmp_path / f"every_{every}" for every in (1, 3)}
    for every, run in runs.items():
        train_in_process(["parallel=none", "trainer.max_steps=5", "trainer.checkpoint_every=50",
                          f"trainer.log_every={every}"], run, cache)
    assert losses_of(runs[1]) == losses_of(runs[3])
    assert sorted(losses_of(runs[3])) == [1, 2, 3, 4, 5]
