"""Issue 25: the auto-parallel memory model counts activation recompute, and both searches choose
it per layer when ``max_device_memory`` needs it; the plan says where, and ``parallelize`` applies
it (one process: a 1-rank auto_parallel run trains like the model without recompute)."""

from __future__ import annotations

import pytest
import torch

import parallel
from parallel.auto.cost_model import DEFAULT_PROFILES
from parallel.auto.plan import load_plan, plan_auto_parallel
from parallel.auto.recompute_choice import stack_layers
from parallel.recompute import recompute_mode
from recipes.gpt import GPT

PROFILE = DEFAULT_PROFILES["cpu"]
SEARCHES = ["dynamic_programming", "recursive_programming"]
LAYERS = [f"blocks.{i}" for i in range(4)]


def _gpt() -> tuple[GPT, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return GPT(65, 192, 4, 6, 64), (torch.randint(0, 65, (16, 64)),)


def _plan(search_mode: str, **kwargs):
    model, idx = _gpt()
    return plan_auto_parallel(model, idx, device_num=2, search_mode=search_mode,
                              profile=PROFILE, **kwargs)


def test_the_layers_are_the_stack_the_pipeline_splits():
    model, _ = _gpt()
    assert stack_layers(model) == LAYERS
    assert stack_layers(torch.nn.Linear(2, 2)) == []  # no stack: nothing to recompute


@pytest.mark.parametrize("search_mode", SEARCHES)
def test_the_memory_model_counts_what_each_mode_keeps_and_costs(search_mode):
    plan = _plan(search_mode)
    assert plan.recompute == {} and not plan.restore  # no limit: recompute only costs time
    assert set(plan.recompute_costs) == set(LAYERS)
    costs = plan.recompute_costs["blocks.0"]
    assert costs["full"].held < costs["selective"].held < costs["none"].held
    assert costs["none"].saved == 0 and costs["none"].seconds == 0
    assert 0 < costs["selective"].seconds < costs["full"].seconds
    for mode, cost in costs.items():  # held + dropped = every activation the layer makes
        assert cost.held + cost.saved == pytest.approx(costs["none"].held), mode
    # full keeps only what leaves the layer: its [16, 64, 192] fp32 output (the next layer's
    # saved input), whole or split over the 2 devices
    assert costs["full"].held in {16 * 64 * 192 * 4 / split for split in (1, 2)}


@pytest.mark.parametrize("search_mode", SEARCHES)
def test_a_limit_layouts_cannot_meet_is_met_with_recompute_on_some_layers(search_mode):
    free = _plan(search_mode)
    layouts_only = None
    for fraction in (0.9, 0.8, 0.7, 0.6):  # the first limit layouts alone cannot meet
        limit = free.memory * fraction
        try:
            _plan(search_mode, max_device_memory=limit, recompute=False)
        except ValueError as error:
            layouts_only = error
            break
    assert layouts_only is not None and "max_device_memory" in str(layouts_only)
    plan = _plan(search_mode, max_device_memory=limit)
    assert plan.recompute and set(plan.recompute) <= set(LAYERS)
    assert set(plan.recompute.values()) <= {"selective", "full"}
    assert plan.memory <= limit
    # the plan's memory and time count it: the dropped outputs and the restore, the re-run
    dropped = sum(plan.recompute_costs[p][m].saved for p, m in plan.recompute.items())
    held = sum(op.memory for op in plan.ops)
    assert plan.memory == pytest.approx(held + plan.restore[0])
    assert plan.restore[0] == max(plan.recompute_costs[p][m].saved
                                  for p, m in plan.recompute.items())
    assert dropped > plan.restore[0] or len(plan.recompute) == 1
    added = sum(plan.recompute_costs[p][m].seconds for p, m in plan.recompute.items())
    assert sum(op.recompute for op in plan.ops) == pytest.approx(added)
    assert plan.cost > free.cost
    text = plan.explain()
    assert "recompute (" in text and "[recomputed]" in text
    assert all(f"{p} {m}" in text for p, m in plan.recompute.items())


def test_recompute_is_chosen_where_it_is_cheaper_than_layouts():
    """On one device layouts cannot save memory: every byte under the limit comes from
    recompute, and no more of it than the limit needs (not every layer flips together)."""
    model, idx = _gpt()
    free = plan_auto_parallel(model, idx, device_num=1, search_mode="dynamic_programming",
                              profile=PROFILE)
    one_layer = free.recompute_costs["blocks.0"]["selective"].saved
    limit = free.memory - one_layer / 2  # one selective layer is enough
    plan = plan_auto_parallel(model, idx, device_num=1, search_mode="dynamic_programming",
                              profile=PROFILE, max_device_memory=limit)
    assert plan.memory <= limit
    assert 1 <= len(plan.recompute) < len(LAYERS)


@pytest.mark.parametrize("search_mode", SEARCHES)
def test_recompute_is_chosen_where_it_meets_the_limit_faster_than_layouts(search_mode):
    """Fast compute, a slow network: sharding activations to fit costs far more than running
    two layers' forward again, so the plan recomputes though layouts alone would fit."""
    import dataclasses
    device = DEFAULT_PROFILES["device"]
    slow_links = dataclasses.replace(device, bandwidth=device.bandwidth / 20)
    model, idx = _gpt()
    kwargs = dict(device_num=2, search_mode=search_mode, profile=slow_links)
    free = plan_auto_parallel(model, idx, **kwargs)
    limit = free.memory * 0.9
    layouts = plan_auto_parallel(model, idx, max_device_memory=limit, recompute=False, **kwargs)
    plan = plan_auto_parallel(model, idx, max_device_memory=limit, **kwargs)
    assert layouts.memory <= limit and plan.memory <= limit
    assert plan.recompute and plan.cost < layouts.cost
    assert plan.strategies == free.strategies  # the layouts stay the fastest ones


def test_activation_offload_is_chosen_where_the_host_link_is_cheaper_than_recomputing():
    """Offload drops what full recompute drops, for link time instead of a forward: with a fast
    host link the plan offloads; with none known it is never offered."""
    import dataclasses
    model, idx = _gpt()
    kwargs = dict(device_num=1, search_mode="dynamic_programming")
    free = plan_auto_parallel(model, idx, profile=PROFILE, **kwargs)
    limit = free.memory - free.recompute_costs["blocks.0"]["selective"].saved * 2
    unlinked = plan_auto_parallel(model, idx, profile=PROFILE, max_device_memory=limit, **kwargs)
    assert unlinked.recompute and "offload" not in unlinked.recompute.values()
    fast = dataclasses.replace(PROFILE, host_bandwidth=1e15)  # transfers hide behind compute
    plan = plan_auto_parallel(model, idx, profile=fast, max_device_memory=limit, **kwargs)
    costs = plan.recompute_costs["blocks.0"]
    assert costs["offload"].saved == costs["full"].saved and costs["offload"].seconds == 0
    assert plan.memory <= limit and set(plan.recompute.values()) == {"offload"}
    assert plan.cost < unlinked.cost  # nothing is run again
    assert plan.host_memory == sum(plan.recompute_costs[p]["offload"].saved
                                   for p in plan.recompute) > 0
    assert f"{plan.host_memory / 2**20:.1f} MiB per device in host memory" in plan.explain()
    assert unlinked.host_memory == 0
    slow = dataclasses.replace(PROFILE, host_bandwidth=1e3)  # a link slower than any forward
    assert "offload" not in plan_auto_parallel(model, idx, profile=slow, max_device_memory=limit,
                                               **kwargs).recompute.values()


@pytest.mark.parametrize("search_mode", SEARCHES)
def test_a_limit_met_without_recompute_chooses_none(search_mode):
    free = _plan(search_mode)
    plan = _plan(search_mode, max_device_memory=free.memory * 1.01)
    assert plan.recompute == {} and plan.memory == free.memory
    assert "recompute" not in plan.explain().splitlines()[1]


@pytest.mark.parametrize("search_mode", SEARCHES)
def test_an_impossible_limit_names_the_least_memory_with_recompute_counted(search_mode):
    with pytest.raises(ValueError, match=r"max_device_memory=0\.000 GiB cannot be met on 2 "
                                         r"devices; the least memory a plan found needs is "
                                         r"[0-9.]+ GiB per device with activation recompute "
                                         r"counted"):
        _plan(search_mode, max_device_memory=1024)


def test_recompute_must_be_a_bool():
    with pytest.raises(TypeError, match="recompute must be True or False"):
        _plan("dynamic_programming", recompute="full")


def test_a_layer_the_user_recomputed_is_counted_at_its_mode():
    model, idx = _gpt()
    parallel.recompute(model.blocks[1], "full")
    plan = plan_auto_parallel(model, idx, device_num=2, search_mode="dynamic_programming",
                              profile=PROFILE)
    assert plan.recompute == {"blocks.1": "full"}  # counted, though no limit asked for it
    assert plan.restore[0] == plan.recompute_costs["blocks.1"]["full"].saved


def test_a_plan_whose_layers_cannot_be_recomputed_is_refused_before_anything_changes():
    from parallel.auto.apply import apply_auto_parallel
    model, idx = _gpt()
    plan = plan_auto_parallel(model, idx, device_num=1, search_mode="dynamic_programming",
                              profile=PROFILE)
    plan.recompute = {"blocks.9": "full"}
    with pytest.raises(ValueError, match="recomputes 'blocks.9', which is not a module of GPT"):
        apply_auto_parallel(model, device_num=1, plan=plan)
    parallel.recompute(model.blocks[0], "selective")
    plan.recompute = {"blocks.0": "full"}
    with pytest.raises(ValueError, match="recomputes 'blocks.0' with mode 'full', but it is "
                                         "already recomputed with 'selective'"):
        apply_auto_parallel(model, device_num=1, plan=plan)
    assert model.blocks[1].attn.qkv.weight.__class__ is torch.nn.Parameter  # nothing sharded


def _loss_and_grads(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor):
    _, loss = model(idx, targets)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = grad.detach().clone()
    return loss.detach(), grads


def test_the_applied_plan_recomputes_the_named_layers_and_trains_alike():
    torch.manual_seed(0)
    reference = GPT(37, 32, 4, 4, 16)
    idx = torch.randint(0, 37, (4, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 37, (4, 16), generator=torch.Generator().manual_seed(2))
    free = plan_auto_parallel(reference, (idx,), device_num=1, search_mode="dynamic_programming")
    limit = free.memory - free.recompute_costs["blocks.0"]["full"].saved  # needs recompute
    parallel.init()
    try:
        torch.manual_seed(0)
        model = GPT(37, 32, 4, 4, 16)
        result = parallel.parallelize(model, parallel.ParallelConfig(
            search_mode="dynamic_programming", max_device_memory=limit),
            example_inputs=(idx,))
        assert result.model is model
        plan = result.plan
        assert plan.recompute and plan.memory <= limit
        modules = dict(model.named_modules())
        for path in LAYERS:
            assert recompute_mode(modules[path]) == plan.recompute.get(path), path
        runs = {path: 0 for path in LAYERS}
        for path in LAYERS:  # a recomputed layer's submodules run again in backward
            modules[path + ".ln1"].register_forward_hook(
                lambda *_, path=path: runs.__setitem__(path, runs[path] + 1))
        loss, grads = _loss_and_grads(model, idx, targets)
        assert runs == {p: 2 if p in plan.recompute else 1 for p in LAYERS}
        want_loss, want = _loss_and_grads(reference, idx, targets)
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
        for name, grad in want.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    finally:
        parallel.destroy()


def test_the_recipe_recomputes_before_auto_planning(tmp_path):
    """``trainer.recompute`` under ``parallel=auto``: the blocks are recomputed before the plan
    is made, so it counts them at their mode (and never recomputes them a second time)."""
    from parallel.auto.apply import planned
    from recipe_helpers import train_in_process

    found = {}

    def grab(recipe) -> None:
        found["plan"] = planned(recipe.model)
        found["modes"] = {p: recompute_mode(m) for p, m in recipe.model.named_modules()
                          if p.startswith("blocks.") and p.count(".") == 1}

    summary = train_in_process(["parallel=auto", "parallel.strategy=null",
                                "parallel.search_mode=dynamic_programming",
                                "trainer.recompute=selective", "model.n_layer=2",
                                "trainer.max_steps=2"], tmp_path / "run", tmp_path / "data", grab)
    assert found["plan"].recompute == {"blocks.0": "selective", "blocks.1": "selective"}
    assert found["modes"] == found["plan"].recompute
    assert summary["steps"] == "1..2"


def _two_ranks(rank: int, world: int) -> dict:
    parallel.init()
    idx = torch.randint(0, 37, (8, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 37, (8, 16), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    reference = GPT(37, 32, 4, 4, 16)
    from parallel.semi_auto import load_strategy_file
    from recipes.parallel_mode import STRATEGY_DIR
    megatron = load_strategy_file(STRATEGY_DIR / "gpt_megatron.yaml", dp=1, mp=world)
    search = dict(device_num=world, search_mode="recursive_programming", profile=PROFILE,
                  strategies=megatron)  # tensor-parallel layers, the rest searched
    free = plan_auto_parallel(reference, (idx,), **search)
    limit = free.memory - free.recompute_costs["blocks.0"]["full"].saved
    plan = plan_auto_parallel(reference, (idx,), max_device_memory=limit, **search)
    torch.manual_seed(0)
    model = GPT(37, 32, 4, 4, 16)
    parallel.parallelize(model, parallel.ParallelConfig(search_mode="sharding_propagation"),
                         plan=plan)
    modes = {p: recompute_mode(model.get_submodule(p)) for p in LAYERS}
    loss, grads = _loss_and_grads(model, idx, targets)
    want_loss, want = _loss_and_grads(reference, idx, targets)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    return {"recompute": plan.recompute, "modes": modes,
            "sharded": sum(any(max(e) > 1 for e in s) for s in plan.strategies.values())}


@pytest.mark.slow
def test_a_plan_with_recompute_trains_like_one_process_on_two_ranks():
    from distributed import run_ranks
    for found in run_ranks(_two_ranks, 2):
        assert found["recompute"]
        assert found["modes"] == {p: found["recompute"].get(p) for p in LAYERS}
        assert found["sharded"]  # recompute on top of split layouts


def test_a_saved_plan_keeps_its_recompute_and_applies_it(tmp_path):
    """``plan.save()`` writes the recomputed layers under ``recompute`` beside the strategies;
    ``parallelize(..., plan=file)`` wraps the same layers; a bad mode in the file is refused."""
    torch.manual_seed(0)
    model = GPT(37, 32, 4, 4, 16)
    idx = torch.randint(0, 37, (4, 16), generator=torch.Generator().manual_seed(1))
    free = plan_auto_parallel(model, (idx,), device_num=1, search_mode="dynamic_programming")
    limit = free.memory - free.recompute_costs["blocks.0"]["full"].saved
    plan = plan_auto_parallel(model, (idx,), device_num=1, search_mode="dynamic_programming",
                              max_device_memory=limit)
    path = plan.save(tmp_path / "plan.yaml")
    loaded = load_plan(path)
    assert loaded["recompute"] == plan.recompute and plan.recompute
    assert {k: v for k, v in loaded.items() if k != "recompute"} == plan.strategies
    parallel.init()
    try:
        parallel.parallelize(model, parallel.ParallelConfig(search_mode="sharding_propagation"),
                             plan=path)
        modules = dict(model.named_modules())
        assert {p: recompute_mode(modules[p]) for p in LAYERS} == \
            {p: plan.recompute.get(p) for p in LAYERS}
    finally:
        parallel.destroy()
    path.write_text(path.read_text().replace(next(iter(plan.recompute.values())), "half"))
    with pytest.raises(ValueError, match="recompute modes must be 'selective' or 'full'"):
        load_plan(path)
