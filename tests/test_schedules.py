"""``optim.schedule``: linear warm-up, then cosine, linear, constant or warmup-stable-decay; a WSD
that cannot fit the run is refused by name before anything starts, and a warm-up as long as the
run (the rate never reaches ``optim.lr``) is reported instead of passing silently."""

from __future__ import annotations

import logging

import pytest
import torch

from recipe_helpers import compose_train
from recipes import optim
from recipes.run_settings import check_run_settings
from recipes.schedules import check_schedule, lr_factor


def _curve(schedule: str, warmup: int = 10, total: int = 100, fraction: float = 0.2):
    f = lr_factor(schedule, warmup, total, 0.1, fraction)
    return [f(s) for s in range(total)]


def test_every_schedule_warms_up_then_follows_its_shape():
    for name in ("cosine", "linear", "constant", "wsd"):
        curve = _curve(name)
        assert curve[:10] == pytest.approx([(s + 1) / 10 for s in range(10)]), name
        assert curve[10] == pytest.approx(1.0), name  # the peak, right after the warm-up
    assert _curve("cosine") == pytest.approx([optim.warmup_cosine(10, 100, 0.1)(s)
                                              for s in range(100)])
    assert set(_curve("constant")[10:]) == {1.0}
    linear = _curve("linear")
    assert all(a > b for a, b in zip(linear[10:-1], linear[11:], strict=True)) and linear[-1] > 0.1
    wsd = _curve("wsd")  # 20 decay steps: stable until step 80, min_lr_ratio at the last
    assert set(wsd[10:80]) == {1.0} and wsd[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(wsd[80:-1], wsd[81:], strict=True))


def test_a_wsd_that_cannot_fit_is_refused_before_the_run():
    with pytest.raises(ValueError, match=r"optim.schedule=wsd: optim.warmup_steps=30 and the "
                                         r"decay .optim.decay_fraction=0.5 of 40 steps = 20."):
        check_schedule("wsd", 30, 40, 0.5)
    with pytest.raises(ValueError, match="optim.schedule=wsd"):
        check_run_settings(compose_train(["optim.schedule=wsd", "trainer.max_steps=20",
                                          "optim.decay_fraction=0.5"]))
    check_run_settings(compose_train(["optim.schedule=wsd", "trainer.max_steps=300"]))


def test_a_warm_up_as_long_as_the_run_is_reported(caplog):
    note = check_schedule("cosine", 30, 20, 0.2)
    assert note is not None and "optim.warmup_steps=30 spans the whole schedule of 20" in note
    assert check_schedule("cosine", 19, 20, 0.2) is None
    cfg = compose_train(["trainer.max_steps=20"])  # the default warm-up is 30 steps
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="recipes.optim"):
        optim.build_scheduler(opt, cfg.optim, 20)
    assert "never decays" in caplog.text
