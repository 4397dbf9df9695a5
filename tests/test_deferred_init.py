"""Deferred initialization: a meta-device model given to ``parallel.parallelize`` gets, on every
rank, only what the rank holds, bitwise equal to the same slices of ``parallel.materialize`` in
one process with the same seed, and trains with one process's losses (rel 1e-5).

The one-process tests check ``materialize`` itself (ties, determinism, ``reset_parameters``
models, clear errors). The 4-rank cases share one spawn of 4 gloo ranks: data parallel,
pipeline (+ data), optimizer parallel levels 1-3 (+ pipeline), expert parallel (+ pipeline),
optimizer parallel of an MoE model (+ pipeline), multi_copy, several stages per rank
(``interleaved_1f1b``, ``zbv``, + optimizer parallel), optimizer parallel with ``param_dtype``
(16-bit shards keeping their FP32 slices, training as the model given with values does), the
refused modes, and set-up memory checks on a model 4x the per-rank share; a 2-rank spawn runs a
few of the combinations again."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from peak_tensor_bytes import PeakTensorBytes
from torch import nn
from torch.distributed.tensor import DTensor

import parallel
import parallel.weights.deferred_init as deferred_init
from distributed import run_ranks
from foundation.compat import dtensor_slice
from hetero.local_parts import FP32_SEED_ATTR
from parallel import ParallelConfig
from parallel.mesh import batch_mesh
from recipes.gpt import GPT, lm_loss
from torch_features import runs_here, zbv_params

# the 4-rank fixture trains every mode in one spawn (about 2 minutes alone on 2 cores): under a
# loaded machine, with another xdist worker beside it, more than pytest-timeout's 300 s default
pytestmark = pytest.mark.timeout(900)

VOCAB, SEQ, BATCH, MICRO, STEPS, SEED = 37, 8, 8, 2, 3, 1234


def meta_gpt(n_layer: int = 2, moe: bool = False, d_model: int = 16) -> GPT:
    with torch.device("meta"):
        return GPT(VOCAB, d_model=d_model, n_layer=n_layer, n_head=2, block_size=SEQ,
                   moe=dict(num_experts=4, top_k=2, capacity_factor=1.0, aux_loss_factor=0.05)
                   if moe else None, moe_every=2)


def reference_model(moe: bool) -> GPT:
    return parallel.materialize(meta_gpt(moe=moe), seed=SEED, device="cpu")


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _micro(t: torch.Tensor, ranks: int, m: int) -> torch.Tensor:
    """Micro-batch ``m`` as ``ranks`` batch ranks feed it together: each one's slice cut in
    MICRO (MoE layers count capacity and the balancing loss over it)."""
    return torch.cat([part.chunk(MICRO)[m] for part in t.chunk(ranks)])


def reference_losses(moe: bool, ranks: int | None = None) -> list[float]:
    """One process: the whole batch per step (what every mode's ranks compute together), or
    for an MoE pipeline its MICRO micro-batches as ``ranks`` batch ranks feed them."""
    return _losses_of(reference_model(moe), ranks)


def _losses_of(model: GPT, ranks: int | None = None) -> list[float]:
    """``model``'s STEPS AdamW steps in one process (``reference_losses``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        parts = [(x, y)] if ranks is None else [
            (_micro(x, ranks, m), _micro(y, ranks, m)) for m in range(MICRO)]
        total = 0.0
        for xm, ym in parts:
            _, loss = model(xm, ym)
            (loss / len(parts)).backward()
            total += loss.item() / len(parts)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


# ---------------------------------------------------------------- one process
def test_materialize_is_deterministic_keeps_ties_and_follows_the_gpt_rules():
    a, b = reference_model(False), reference_model(False)
    assert a.lm_head.weight is a.tok_emb.weight
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    assert torch.equal(a.blocks[0].ln1.weight, torch.ones(16))
    assert torch.equal(a.blocks[0].attn.qkv.bias, torch.zeros(48))
    assert a.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.2)
    c = parallel.materialize(meta_gpt(), seed=SEED + 1, device="cpu")
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_materialize_after_a_fake_tensor_dry_run_of_a_moe_model():
    # the dry run (a pipeline's FLOP-balanced split) leaves weak references to the meta
    # parameters in reference cycles; swap_tensors refuses such a tensor until they are collected
    from parallel.pipeline.partition import measure_units, unit_paths
    from recipes.gpt import GPT

    with torch.device("meta"):
        model = GPT(64, 32, 2, 2, 16, moe={"num_experts": 4, "top_k": 2})
    measure_units(model, unit_paths(model), (torch.randint(0, 64, (2, 16), device="meta"),))
    parallel.materialize(model, seed=SEED, device="cpu")
    assert not any(p.is_meta for p in model.parameters())


def test_materialize_runs_reset_parameters_per_module_seeded_by_its_path():
    def build() -> nn.Module:
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    a = parallel.materialize(build(), seed=7, device="cpu")
    b = parallel.materialize(build(), seed=7, device="cpu")
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a[0].weight[:2, :2], a[2].weight[:2, :2])  # own stream per module
    assert torch.equal(a[1].weight, torch.ones(4))
    assert a[0].weight.abs().max() <= 1 / 3**0.5  # Linear's own reset_parameters


def test_materialize_leaves_every_random_generator_as_it_was(monkeypatch):
    """Each tensor is generated from the host generator alone, inside fork_rng: the accelerator
    generators (which torch.manual_seed would reseed and fork_rng(devices=[]) not give back:
    every data-parallel rank would draw the same dropout masks) are never touched."""
    reseeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", reseeded.append)
    torch.manual_seed(123)
    reseeded.clear()
    before = torch.get_rng_state()
    for generic in (False, True):  # the GPT's init_parameter, and modules' reset_parameters
        def build(generic: bool = generic) -> nn.Module:
            with torch.device("meta"):
                return nn.Sequential(nn.Linear(3, 4)) if generic else meta_gpt()
        parallel.materialize(build(), seed=7, device="cpu")
    assert reseeded == []
    assert torch.equal(torch.get_rng_state(), before)


def test_materialize_refuses_what_it_cannot_fill():
    class NoInit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        bare = nn.Sequential(NoInit())
        bn = nn.BatchNorm1d(3)
    with pytest.raises(ValueError, match=r"'0.w' has no initializer.*NoInit"):
        parallel.materialize(bare)
    with pytest.raises(ValueError, match="buffer '.*' has no initializer.*BatchNorm1d"):
        parallel.materialize(bn)
    assert bare[0].w.is_meta  # nothing changed
    with pytest.raises(ValueError, match="no tensor on the meta device"):
        parallel.materialize(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        parallel.materialize(meta_gpt(), seed=-1)
    mixed = meta_gpt()
    mixed.ln_f.weight = nn.Parameter(torch.ones(16))
    with pytest.raises(ValueError, match="'ln_f.weight' is not on the meta device"):
        parallel.materialize(mixed)


# ---------------------------------------------------------------- the ranks
def _check_slices(model: nn.Module, ref: GPT) -> list[str]:
    """Names whose local value is not bitwise the reference's slice; plus any meta left."""
    bad = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        full = ref.get_parameter(name) if name in dict(ref.named_parameters(
            remove_duplicate=False)) else ref.get_buffer(name)
        if isinstance(t, DTensor):
            local, want = t.to_local(), full[dtensor_slice(t)]
        else:
            local, want = t, full
        if local.is_meta or not torch.equal(local.detach(), want.detach()):
            bad.append(name)
    return bad


def _pipeline_loss(output, target: torch.Tensor) -> torch.Tensor:
    return lm_loss(output[0] if isinstance(output, tuple) else output, target)


def _train(model: nn.Module, config: ParallelConfig) -> list[float]:
    resolved = config.resolve(dist.get_world_size())
    ranks = batch_mesh(resolved)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = (t.chunk(resolved.batch_ranks)[ranks.get_local_rank()] for t in batch(step))
        if isinstance(model, parallel.pipeline.Pipeline):
            losses.append(model.step(x, target=y).item())
        else:
            _, loss = model(x, y)
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total, group=ranks.get_group())  # each rank's loss is its slice's
            losses.append(total.item() / resolved.batch_ranks)
        opt.step()
        opt.zero_grad()
    return losses


def _parallelize(model: GPT, config: ParallelConfig, generated: list[str]) -> nn.Module:
    """``parallelize`` recording the names whose full value this rank generated (a pipeline is
    dry-run on fake tensors of a micro-batch first, as the recipe does)."""
    full_value = deferred_init.full_value

    def counting(info, name):
        generated.append(name)
        return full_value(info, name)

    deferred_init.full_value = counting
    try:
        pipelined = config.pipeline_degree > 1
        return parallel.parallelize(model, config, init_seed=SEED,
                                    loss_fn=_pipeline_loss if pipelined else None,
                                    example_inputs=(batch(0)[0][:2],) if pipelined else None
                                    ).model
    finally:
        deferred_init.full_value = full_value


def _case(config: ParallelConfig, moe: int | None) -> tuple[list[str], list[float]]:
    model = _parallelize(meta_gpt(moe=moe is not None), config, [])
    return _check_slices(model, reference_model(moe is not None)), _train(model, config)


def _low_precision(config: ParallelConfig) -> dict:
    """Optimizer parallel with ``param_dtype``: the deferred model against the same config given
    the one-process model with values (whose 16-bit run matches the unsharded OffloadAdamW bit
    for bit: test_optimizer_parallel.py): the 16-bit shards, the FP32 values each keeps for
    OffloadAdamW (its rank's slice of the one-process FP32 tensor), and the losses."""
    from hetero.optim import OffloadAdamW

    ref = reference_model(False)
    out: dict = {"bad": [], "seeds": 0}
    for deferred in (True, False):
        model = _parallelize(meta_gpt(), config, []) if deferred else parallel.parallelize(
            reference_model(False), config).model
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            want = ref.get_parameter(name)
            want = want[dtensor_slice(p)] if isinstance(p, DTensor) else want
            seed = getattr(p, FP32_SEED_ATTR, None)
            if deferred and (local.dtype != torch.bfloat16 or seed is None or not torch.equal(
                    local.detach(), want.detach().bfloat16()) or not torch.equal(seed, want)):
                out["bad"].append(name)
            out["seeds"] += deferred and seed is not None
        opt = OffloadAdamW(model.parameters(), lr=1e-2, param_dtype=torch.bfloat16,
                           overlap_backward=False)
        losses = []
        for step in range(STEPS):
            x, y = (t.chunk(dist.get_world_size())[dist.get_rank()] for t in batch(step))
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[deferred] = losses
    return out


def _refusals() -> list[str]:
    import hetero

    model = meta_gpt(moe=True)
    hetero.set_device(model.blocks[0], "cpu")
    try:
        parallel.parallelize(model, ParallelConfig())
    except ValueError as err:
        assert all(t.is_meta for t in model.parameters()) and model.tok_emb is not None
        return [str(err)]
    return []


def _memory(config: ParallelConfig, moe: bool = False) -> dict:
    """A ~50 MB GPT of 4 blocks (~13 MB each; ~100 MB with MoE blocks) on 4 ranks: the rank's
    set-up peak (tensor bytes allocated above the baseline) against the whole model's bytes and
    what the rank holds."""
    model = meta_gpt(n_layer=4, d_model=512, moe=moe)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    generated: list[str] = []
    with PeakTensorBytes() as peak:
        pipe = _parallelize(model, config, generated)
    held = sum(t.numel() * t.element_size() for t in (
        p.to_local() if isinstance(p, DTensor) else p for p in pipe.parameters()))
    # with param_dtype the rank also holds its FP32 slices (host) for OffloadAdamW
    held += sum(s.numel() * s.element_size() for p in pipe.parameters()
                if (s := getattr(p, FP32_SEED_ATTR, None)) is not None)
    blocks = {n.split(".")[1] for n, _ in pipe.named_parameters() if n.startswith("blocks.")}
    return {"whole": whole, "held": held, "largest": largest, "peak": peak.bytes,
            "generated": generated, "blocks": sorted(blocks)}


OPTIMIZER = dict(enable_parallel_optimizer=True, parallel_optimizer_threshold=0)
CASES = {  # name -> (config, MoE model: None, or the batch ranks of its pipeline's reference)
    "data dp4": (ParallelConfig(), None),
    "pipeline pp2×dp2 1f1b": (ParallelConfig(pipeline_degree=2, micro_batches=MICRO), None),
    "optimizer level1 dp4": (ParallelConfig(optimizer_level="level1", **OPTIMIZER), None),
    "optimizer level2 dp4, small ones replicated": (ParallelConfig(
        optimizer_level="level2", enable_parallel_optimizer=True,
        parallel_optimizer_threshold=1), None),
    "optimizer level3 dp4": (ParallelConfig(optimizer_level="level3", **OPTIMIZER), None),
    "optimizer level3 2-D (shard size 2)": (ParallelConfig(
        optimizer_level="level3", optimizer_weight_shard_size=2, **OPTIMIZER), None),
    "pipeline pp2 × optimizer level3 dp2": (ParallelConfig(
        pipeline_degree=2, micro_batches=MICRO, optimizer_level="level3", **OPTIMIZER), None),
    "expert ep2×dp2": (ParallelConfig(expert_degree=2), 0),
    "expert ep4": (ParallelConfig(expert_degree=4), 0),
    "MoE under data parallel dp4 (expert_degree=1)": (ParallelConfig(), 0),
    "pipeline pp2 × expert ep2": (ParallelConfig(pipeline_degree=2, micro_batches=MICRO,
                                                 expert_degree=2), 2),
    "optimizer level3 × expert ep2×dp2, small ones replicated": (ParallelConfig(
        expert_degree=2, optimizer_level="level3", enable_parallel_optimizer=True,
        parallel_optimizer_threshold=1), 0),
    "optimizer level2 × expert ep4 (dp=1)": (ParallelConfig(
        expert_degree=4, optimizer_level="level2", **OPTIMIZER), 0),
    "pipeline pp2 × expert ep2 × optimizer level1": (ParallelConfig(
        pipeline_degree=2, micro_batches=MICRO, expert_degree=2, optimizer_level="level1",
        **OPTIMIZER), 2),
    "expert ep2×dp2 × multi_copy 2": (ParallelConfig(expert_degree=2, multi_copy=2), 0),
    "optimizer level2 × expert ep2×dp2 × multi_copy 2": (ParallelConfig(
        expert_degree=2, multi_copy=2, optimizer_level="level2", **OPTIMIZER), 0),
}
#: several stages per rank: 4 blocks, so 2 ranks of pipeline make 4 stages
DEEP = {
    "pipeline pp2×dp2 interleaved_1f1b": ParallelConfig(
        pipeline_degree=2, micro_batches=MICRO, schedule="interleaved_1f1b"),
    "pipeline pp2×dp2 zbv": ParallelConfig(pipeline_degree=2, micro_batches=MICRO, schedule="zbv"),
    "pipeline pp2 interleaved_1f1b × optimizer level3": ParallelConfig(
        pipeline_degree=2, micro_batches=MICRO, schedule="interleaved_1f1b",
        optimizer_level="level3", **OPTIMIZER),
}
#: the 2-rank spawn's cases: name -> (config, as CASES; None for a 4-block pipeline as DEEP)
TWO = {
    "optimizer level3 × expert ep2": (ParallelConfig(
        expert_degree=2, optimizer_level="level3", **OPTIMIZER), 0),
    "expert ep2 × multi_copy 2": (ParallelConfig(expert_degree=2, multi_copy=2), 0),
    "pipeline pp2 interleaved_1f1b": (ParallelConfig(
        pipeline_degree=2, micro_batches=MICRO, schedule="interleaved_1f1b"), None),
}


MEMORY = {  # name -> (config, MoE model)
    "memory pp4": (ParallelConfig(pipeline_degree=4, micro_batches=4, schedule="gpipe"), False),
    "memory optimizer level3 dp4": (ParallelConfig(optimizer_level="level3", **OPTIMIZER),
                                    False),
    "memory optimizer level3 × expert ep2×dp2": (ParallelConfig(
        expert_degree=2, optimizer_level="level3", **OPTIMIZER), True),
}
#: the 2-rank spawn's set-up peak: 16-bit weights and the FP32 slices kept for OffloadAdamW
LOW_PRECISION_MEMORY = ParallelConfig(optimizer_level="level3", param_dtype=torch.bfloat16,
                                      **OPTIMIZER)


def _deep_case(config: ParallelConfig) -> tuple[list[str], list[float]]:
    model = _parallelize(meta_gpt(n_layer=4), config, [])
    ref = parallel.materialize(meta_gpt(n_layer=4), seed=SEED, device="cpu")
    return _check_slices(model, ref), _train(model, config)


LOW_PRECISION = {
    "optimizer level3 param_dtype=bf16, small ones replicated": ParallelConfig(
        optimizer_level="level3", enable_parallel_optimizer=True, parallel_optimizer_threshold=1,
        param_dtype=torch.bfloat16),
    "optimizer level1 param_dtype=bf16": ParallelConfig(
        optimizer_level="level1", param_dtype=torch.bfloat16, **OPTIMIZER),
}


def _all_cases(rank: int, world: int) -> dict:
    parallel.init()
    out: dict = {name: _memory(config, moe) for name, (config, moe) in MEMORY.items()}
    out.update({name: _low_precision(config) for name, config in LOW_PRECISION.items()})
    for name, (config, moe) in CASES.items():
        out[name] = _case(config, moe)
    out.update({name: _deep_case(config) for name, config in DEEP.items() if runs_here(config)})
    out["refused"] = _refusals()
    return out


def _two_rank_cases(rank: int, world: int) -> dict:
    parallel.init()
    out: dict = {"memory param_dtype": _memory(LOW_PRECISION_MEMORY)}
    out.update({name: _deep_case(config) if moe is None else _case(config, moe)
                for name, (config, moe) in TWO.items()})
    out.update({name: _low_precision(config) for name, config in LOW_PRECISION.items()})
    return out


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_ranks(_all_cases, 4, timeout=500)


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_ranks(_two_rank_cases, 2, timeout=300)


def deep_reference_losses() -> list[float]:
    """One process, the 4-block model on the whole batch per step."""
    return _losses_of(parallel.materialize(meta_gpt(n_layer=4), seed=SEED, device="cpu"))


def _check_slices_and_losses(spawned: list[dict], name: str, want: list[float]) -> None:
    for rank, results in enumerate(spawned):
        bad, losses = results[name]
        assert bad == [], f"{name}: rank {rank} differs from the one-process slices: {bad}"
        assert losses == pytest.approx(want, rel=1e-5), f"{name}: rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_mode_initializes_the_reference_slices_and_trains_like_one_process(four_ranks, name):
    moe = CASES[name][1]
    want = reference_losses(moe is not None, moe or None)
    _check_slices_and_losses(four_ranks, name, want)


@pytest.mark.slow
@pytest.mark.parametrize("name", zbv_params(DEEP))
def test_several_stages_per_rank_initialize_the_reference_slices_and_train_like_one_process(
        four_ranks, name):
    want = deep_reference_losses()
    _check_slices_and_losses(four_ranks, name, want)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TWO))
def test_on_two_ranks_initialize_the_reference_slices_and_train_like_one_process(
        two_ranks, name):
    moe = TWO[name][1]
    want = deep_reference_losses() if moe is None else reference_losses(True, moe or None)
    _check_slices_and_losses(two_ranks, name, want)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MEMORY))
def test_set_up_peak_is_the_share_plus_one_tensor_not_the_model(four_ranks, name):
    for rank, results in enumerate(four_ranks):
        mem = results[name]
        if name == "memory pp4":
            assert mem["blocks"] == [str(rank)]  # one block per stage, one stage per rank
            generated = {n.split(".")[1] for n in mem["generated"] if n.startswith("blocks.")}
            assert generated == {str(rank)}  # no other stage's layer was ever built here
        assert mem["held"] < mem["whole"] / 3
        # what the rank holds, one generated tensor and its slice (tensor bytes: exact)
        assert mem["peak"] <= mem["held"] + 2 * mem["largest"], mem
        assert mem["peak"] < 0.75 * mem["whole"], mem


@pytest.mark.slow
def test_param_dtype_set_up_peak_is_the_share_plus_one_tensor(two_ranks):
    for results in two_ranks:
        mem = results["memory param_dtype"]
        # 16-bit halves and the FP32 half kept for OffloadAdamW: 3/4 of the FP32 model's bytes
        assert mem["held"] < 0.8 * mem["whole"], mem
        assert mem["peak"] <= mem["held"] + 2 * mem["largest"], mem


@pytest.mark.slow
def test_placement_tags_are_refused_before_the_model_changes(four_ranks):
    # (every mode takes a meta model; hybrid parallel's: test_deferred_hybrid.py)
    for results in four_ranks:
        placed, = results["refused"]
        assert "hetero placement (modules tagged with hetero.set_device) is not built" in placed


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(LOW_PRECISION))
def test_optimizer_parallel_param_dtype_keeps_the_reference_fp32_slices(
        request, world, name):
    spawned = request.getfixturevalue("two_ranks" if world == 2 else "four_ranks")
    for rank, results in enumerate(spawned):
        case = results[name]
        assert case["bad"] == [], f"{name}: rank {rank} differs from the one-process slices"
        assert case["seeds"] > 0
        assert case[True] == case[False], f"{name}: rank {rank} trains unlike the model with values"


# ---------------------------------------------------------------- the recipe
RECIPE = ["model.init_device=meta", "trainer.max_steps=4", "model.n_layer=2",
          "trainer.seed=5", "trainer.checkpoint_every=100"]


def test_recipe_builds_on_meta_and_starts_from_the_materialized_values(tmp_path):
    from recipe_helpers import TINY, compose_train, train_in_process

    seen = {}

    def grab(recipe) -> None:
        seen.update({n: p.detach().clone() for n, p in recipe.model.named_parameters()})
        seen["vocab"] = recipe.tokenizer.vocab_size

    train_in_process([*RECIPE, "parallel=none"], tmp_path / "run", tmp_path / "data", grab)
    cfg = compose_train([*TINY, *RECIPE]).model
    with torch.device("meta"):
        want = GPT(seen.pop("vocab"), cfg.d_model, cfg.n_layer, cfg.n_head, cfg.block_size)
    want = parallel.materialize(want, seed=5, device="cpu")
    assert seen.keys() == dict(want.named_parameters()).keys()
    for name, value in want.named_parameters():
        assert torch.equal(seen[name], value.detach()), name


def test_recipe_refuses_meta_init_with_hetero_placement(tmp_path):
    from recipe_helpers import train_in_process

    with pytest.raises(ValueError, match=r"init_device=meta with hetero.cpu_modules"):
        train_in_process([*RECIPE, "parallel=none", "hetero.cpu_modules=[tok_emb]"],
                         tmp_path / "run", tmp_path / "data")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_recipe_pipeline_on_meta_trains_like_one_process(tmp_path):
    from recipe_helpers import assert_same_losses, losses_of, run_recipe

    run_recipe([*RECIPE, "parallel=none"], None, tmp_path / "one", tmp_path / "data")
    run_recipe([*RECIPE, "parallel=pipeline"], 2, tmp_path / "pp", tmp_path / "data")
    assert_same_losses(losses_of(tmp_path / "pp"), losses_of(tmp_path / "one"))
