"""The host optimizer gets the cores its rank owns (issue 24, finding 13): torchrun's
``OMP_NUM_THREADS=1`` must not leave OffloadAdamW's update on one core, and the thread count is
changed around the host update only."""

from __future__ import annotations

import pytest
import torch

import foundation.host_threads as ht
from hetero.optim import OffloadAdamW
from recipe_helpers import compose_train
from recipes import optim


def test_cores_are_divided_among_the_ranks_of_a_node(monkeypatch):
    monkeypatch.setattr(ht, "_available_cores", lambda: (16, False))
    assert ht.cores_per_rank(4) == 4
    assert ht.cores_per_rank(32) == 1  # more ranks than cores: one each
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ht.cores_per_rank() == 8


def test_a_rank_bound_by_its_launcher_keeps_its_whole_affinity(monkeypatch):
    monkeypatch.setattr(ht, "_available_cores", lambda: (6, True))
    assert ht.cores_per_rank(4) == 6


def test_thread_scope_restores_the_previous_count():
    before = torch.get_num_threads()
    with ht.thread_scope(before + 1):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads must be >= 1"):
        with ht.thread_scope(0):
            pass


def test_offload_adam_runs_its_host_update_with_the_ranks_cores(monkeypatch):
    """Under torchrun's one thread, the host update runs with ``host_threads`` threads and the
    rest of the step keeps one."""
    monkeypatch.setattr("hetero.optim.offload_adam.cores_per_rank", lambda: 3)
    param = torch.nn.Parameter(torch.randn(64))
    opt = OffloadAdamW([param], lr=0.1, kernel="torch")
    assert opt.host_threads == 3
    seen = []
    kernel = opt._kernel
    update = kernel.update
    monkeypatch.setattr(kernel, "update",
                        lambda *a, **k: (seen.append(torch.get_num_threads()), update(*a, **k)))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        param.grad = torch.ones_like(param)
        opt.step()
        assert seen == [3] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_host_threads_is_configurable_and_checked():
    param = torch.nn.Parameter(torch.randn(8))
    assert OffloadAdamW([param], host_threads=2, kernel="torch").host_threads == 2
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="host_threads must be a whole number >= 1"):
            OffloadAdamW([torch.nn.Parameter(torch.randn(8))], host_threads=bad)


def test_the_recipe_setting_reaches_the_optimizer():
    cfg = compose_train(["offload=optimizer", "hetero.offload_kernel=torch",
                         "hetero.host_threads=3"])
    model = torch.nn.Linear(4, 4)
    opt = optim.build_optimizer(model, cfg.optim, cfg.hetero, offload=cfg.offload)
    assert isinstance(opt, OffloadAdamW) and opt.host_threads == 3
