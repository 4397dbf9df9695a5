"""The one front door: one vocabulary, one result, one set of process groups, one matrix.

* ``ParallelConfig`` is the only definition of the settings: the recipes' schema and the
  MindSpore-style context speak its names, and the previous release's names still work with a
  ``DeprecationWarning``;
* ``parallelize(model, config)`` returns a ``Parallelized`` (model, config, dims, plan,
  ``explain()``);
* every mesh takes its process groups from one registry: no rank set gets two groups;
* ``parallel.combinations()`` is the matrix the config enforces and the README prints.
"""

from __future__ import annotations

import ast
import collections
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import parallel
from parallel import ParallelConfig
from parallel.combinations import (
    PLACEMENT,
    Status,
    combinations,
    markdown_table,
    merged,
)
from recipes import parallel_mode
from tests.distributed import run_ranks
from tests.recipe_helpers import compose_train
from torch_features import needs_spmd_sharding

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- the previous release still works
def test_the_previous_release_names_work_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="'data' is deprecated, use 'data_degree'"):
        old = ParallelConfig(data=2, model=1, pipeline=1, expert=1)
    assert old == ParallelConfig(data_degree=2)
    with pytest.warns(DeprecationWarning, match="ParallelConfig.pipeline is deprecated"):
        assert old.pipeline == 1
    with pytest.raises(ValueError, match="'model' is the old name of 'tensor_degree'; give one"):
        ParallelConfig(model=2, tensor_degree=2)
    from parallel.config import OPTIMIZER_LEVELS, SCHEDULES, SEARCH_MODES  # old tuples

    assert "zbv" in SCHEDULES and "level3" in OPTIMIZER_LEVELS and "dynamic_programming" in \
        SEARCH_MODES


def test_the_top_level_is_what_a_training_script_uses_and_moved_names_still_work():
    """``parallel.__all__`` is the short list the docs use; every name that moved into its
    submodule still answers at the top level for one release, warning with its new spelling,
    and is the same object."""
    import importlib
    import warnings

    assert 15 <= len(parallel.__all__) <= 25
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in parallel.__all__:
            getattr(parallel, name)
    for name, home in parallel.MOVED.items():
        with pytest.warns(DeprecationWarning, match=rf"parallel\.{name} is deprecated: use "
                                                    rf"{re.escape(home)}\.{name}"):
            old = getattr(parallel, name)
        assert old is getattr(importlib.import_module(home), name)
    with pytest.warns(DeprecationWarning, match="use parallel.data.DataParallel"):
        from parallel import DataParallel  # noqa: F401  (the old spelling, on purpose)
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        parallel.no_such_name  # noqa: B018


def test_modules_moved_into_their_dimension_still_import_with_a_warning():
    """``parallel/``'s root modules that moved into ``data/``, ``expert/`` and ``weights/`` (and
    ``hybrid`` -> ``compose``) answer at their old names for one release: ``import``, ``from
    ... import`` and attribute access give the same module object, warning with its new name."""
    import importlib
    import sys

    def forget(old: str) -> None:  # as in a fresh process: the old name not imported yet
        sys.modules.pop(f"parallel.{old}", None)
        parallel.__dict__.pop(old, None)

    for old, new in parallel.MOVED_MODULES.items():
        forget(old)
        with pytest.warns(DeprecationWarning, match=rf"module parallel\.{old} is deprecated: use "
                                                    rf"{re.escape(new)}$"):
            module = importlib.import_module(f"parallel.{old}")
        assert module is importlib.import_module(new) and module.__spec__.name == new
        forget(old)
        with pytest.warns(DeprecationWarning, match=rf"module parallel\.{old} is deprecated"):
            assert getattr(parallel, old) is module
    forget("data_parallel")
    with pytest.warns(DeprecationWarning, match="use parallel.data.replicas"):
        from parallel.data_parallel import DataParallel  # noqa: F401  (the old spelling)
    assert DataParallel is parallel.data.DataParallel


def test_the_doors_deprecated_in_the_previous_release_are_gone():
    """0.1.0 deprecated them, 0.2.0 removes them (CHANGELOG: how to migrate)."""
    parallel.init()
    for old in ("data_parallel", None):
        with pytest.raises(TypeError, match="config must be a ParallelConfig"):
            parallel.parallelize(nn.Linear(4, 4), old)
    with pytest.raises(TypeError, match="model must be an nn.Module, got str"):
        parallel.parallelize("gpt2", ParallelConfig())  # was an AttributeError deep inside
    parallel.context.set_auto_parallel_context(parallel_mode="stand_alone")
    result = parallel.parallelize(nn.Linear(4, 4), ParallelConfig.from_context())
    assert type(result.model) is nn.Linear
    with pytest.raises(TypeError, match="not callable"):
        result(torch.ones(1, 4))  # the result is not the model
    assert not hasattr(result, "parameters") and not hasattr(parallel.auto, "applied_plan")


def test_the_recipes_old_keys_work_with_a_deprecation_warning():
    cfg = compose_train(["parallel=semi_auto", "parallel.model_parallel=2"])
    with pytest.warns(DeprecationWarning) as caught:
        config = parallel_mode.parallel_config(cfg.parallel, 4)
    assert "parallel.model_parallel is deprecated, use parallel.tensor_degree" in {
        str(w.message) for w in caught}
    assert (config.tensor_degree, config.data_degree) == (2, 2)
    # optim.parallel_optimizer, deprecated in 0.1.0, is gone: the schema refuses the key
    with pytest.raises(Exception, match="parallel_optimizer"):
        compose_train(["optim.parallel_optimizer=level2"])


# ---------------------------------------------------------------- one vocabulary
@pytest.mark.parametrize("mode, fields", [
    ("stand_alone", {"data_degree": 1}), ("data_parallel", {}),
    ("semi_auto_parallel", {"strategy_tags": True}),
    ("auto_parallel", {"search_mode": "sharding_propagation"}), ("hybrid_parallel", {}),
])
def test_the_old_mode_is_translated_into_the_fields_that_say_it(mode, fields):
    """ParallelConfig has no mode (the degrees, strategies and search say it); the previous
    release's ``mode=`` and the recipes' ``parallel.mode`` still work, with a warning."""
    with pytest.warns(DeprecationWarning, match=r"ParallelConfig\(mode=...\) is deprecated"):
        assert ParallelConfig(mode=mode) == ParallelConfig(**fields)
    cfg = compose_train(["parallel=data", f"parallel.mode={mode.upper()}"])
    with pytest.warns(DeprecationWarning, match="parallel.mode is deprecated"):
        translated = parallel_mode.config_fields(cfg.parallel)
    assert {k: translated[k] for k in fields} == fields
    with pytest.raises(ValueError, match="mode 'stand_alone' keeps one copy per rank"), \
            pytest.warns(DeprecationWarning):
        ParallelConfig(mode="stand_alone", data_degree=2)


def test_each_old_name_is_declared_on_its_field_and_works_everywhere():
    """One name per dimension, one deprecation mechanism: the fields declare their previous
    names, and each works (with a DeprecationWarning naming the field) in ParallelConfig, in the
    MindSpore-style context and in the recipes' parallel group."""
    import dataclasses
    import warnings

    declared = {old: f.name for f in dataclasses.fields(ParallelConfig)
                for old in f.metadata.get("was", ())}
    assert declared == parallel.config.RENAMED and declared["model_parallel"] == "tensor_degree"
    for old, new in declared.items():
        with pytest.warns(DeprecationWarning, match=f"'{old}' is deprecated, use '{new}'"):
            assert ParallelConfig(**{old: 1}) == ParallelConfig(**{new: 1})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parallel.context.set_auto_parallel_context(**{old: 1})
        assert parallel.context.get_auto_parallel_context(new) == 1
        parallel.context.reset_auto_parallel_context()
        cfg = compose_train(["parallel=data", f"parallel.{old}=1"])
        with pytest.warns(DeprecationWarning, match=f"parallel.{old} is deprecated, use "
                                                    f"parallel.{new}"):
            assert parallel_mode.config_fields(cfg.parallel)[new] == 1


def test_python_yaml_and_the_context_share_the_names():
    """Every ParallelConfig field is a key of the parallel group (but those filled from the
    strategy file and hetero) and a setting of the context, with the same default."""
    from recipes.parallel_schema import FROM_ELSEWHERE, ParallelGroupConfig

    fields = [f for f in parallel.config.FIELDS if f not in FROM_ELSEWHERE]
    group = compose_train(["parallel=data"]).parallel
    defaults = ParallelConfig()
    for name in fields:
        assert name in ParallelGroupConfig.__dataclass_fields__
        assert parallel.context.get_auto_parallel_context(name) == getattr(defaults, name), name
    cfg = compose_train(["parallel=data", "parallel.schedule=zbv", "parallel.pipeline_degree=2",
                         "parallel.micro_batches=4"])
    config = parallel_mode.parallel_config(cfg.parallel, 2)
    assert (config.schedule, config.pipeline_degree) == (parallel.config.Schedule.ZERO_BUBBLE_V, 2)
    assert group.schedule == "1f1b"


def test_a_bad_recipe_value_is_refused_by_parallel_config_itself():
    from recipes.config_schema import check_config

    with pytest.raises(ValueError, match="parallel.schedule=zb must be one of"):
        check_config(compose_train(["parallel.schedule=zb"]))
    with pytest.raises(ValueError, match="parallel.expert_degree must be at least 1"):
        check_config(compose_train(["parallel.expert_degree=0"]))
    with pytest.raises(ValueError, match="auto × expert × pipeline is unsupported"):
        check_config(compose_train(["parallel=auto", "parallel.expert_degree=2",
                                    "parallel.pipeline_degree=2"]))


# ---------------------------------------------------------------- one front door
def test_parallelize_returns_what_it_did():
    parallel.init()
    linear = nn.Linear(4, 4)
    result = parallel.parallelize(linear, ParallelConfig())
    assert isinstance(result, parallel.Parallelized)
    assert result.module is linear
    assert result.config.data_degree == 1 and result.dims.world_mesh.mesh_dim_names == (
        "pp", "dp", "ep", "cp", "tp")
    assert result.plan is None
    assert result.explain().startswith(
        "mesh pp=1 × dp=1 × ep=1 × cp=1 × tp=1 (operators: replicas)")
    with pytest.raises(ValueError, match="plan= is a searched plan, but the config has no "
                                         "search_mode"):
        parallel.parallelize(nn.Linear(4, 4), ParallelConfig(), plan={"x": ((1, 1),)})


def _placed_data_parallel() -> tuple[nn.Module, parallel.Parallelized]:
    import hetero

    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
    hetero.set_device(model[0], "cpu")
    return model, parallel.parallelize(model, ParallelConfig())


def test_the_model_and_its_placement_are_reached_the_same_way_on_one_process():
    """``result.module`` is the model as built and ``hetero.explain(result.model)`` finds the
    placement on one process (``result.model``: the placed model) as on several (a
    data-parallel wrapper around it: ``_two_models``)."""
    import hetero

    parallel.init()
    model, result = _placed_data_parallel()
    result.model(torch.randint(0, 16, (2, 3)))
    assert result.module is model
    assert "cpu" in hetero.explain(result.model)


def test_no_module_level_registries_hold_results():
    """What parallelize made is handed back (or kept on the model, as torch's composable APIs
    keep their state), never in module-level dictionaries. (The user's own ``parallel.shard``
    tags are kept beside their modules, as ``hetero.set_device`` tags are: inputs, not results.)"""
    for name in ("parallelize.py", "compose.py", "result.py", "dims.py", "auto/apply.py",
                 "semi_auto/apply.py"):
        path = ROOT / "parallel" / name
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign | ast.AnnAssign):
                text = ast.unparse(node)
                assert "WeakKeyDictionary" not in text, f"{path}: {text}"


# ---------------------------------------------------------------- one matrix
def test_the_readme_table_is_the_generated_matrix():
    readme = (ROOT / "README.md").read_text()
    assert markdown_table() in readme, "regenerate with: python -m parallel.combinations"


@pytest.mark.parametrize("pair", sorted(combinations()), ids="×".join)
def test_the_config_enforces_every_cell(pair):
    status, reason = combinations()[pair]
    if PLACEMENT in pair:
        pytest.skip("placement tags are a model's, checked by parallelize (test below)")
    fields = merged(*pair)
    if fields is None:
        assert status is Status.MEANINGLESS
        return
    if status is Status.BUILT:
        ParallelConfig(**fields)  # accepted
    else:
        with pytest.raises(ValueError, match=re.escape(reason)):
            ParallelConfig(**fields)


def test_placement_cells_are_refused_by_parallelize_before_any_change():
    import hetero

    parallel.init()
    for (a, b), (status, reason) in combinations().items():
        if PLACEMENT not in (a, b) or status is Status.BUILT:
            continue
        other = b if a == PLACEMENT else a
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        hetero.set_device(model[0], "cpu")
        with pytest.raises(ValueError, match=re.escape(reason)):
            parallel.parallelize(model, ParallelConfig(**merged(other)))
        assert type(model[0].weight) is nn.Parameter


# ---------------------------------------------------------------- one set of process groups
def _groups_made(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from parallel.dims import ParallelDims, ProcessGroups

    parallel.init()
    calls: collections.Counter = collections.Counter()
    real = dist.new_group

    def counting(ranks=None, *args, **kwargs):
        calls[tuple(sorted(ranks))] += 1
        return real(ranks, *args, **kwargs)

    dist.new_group = counting
    try:
        for config in (ParallelConfig(data_degree=2, pipeline_degree=2),
                       ParallelConfig(strategy_tags=True, tensor_degree=2),
                       ParallelConfig(enable_parallel_optimizer=True, pipeline_degree=2),
                       ParallelConfig(expert_degree=2, data_degree=2),
                       ParallelConfig(enable_parallel_optimizer=True,
                                      optimizer_weight_shard_size=2)):
            dims = ParallelDims(config)
            dims.world_mesh, dims["batch"], dims["stage"]
            if config.enable_parallel_optimizer:
                dims.optimizer_mesh()
            dims.stage_mesh((2, dims.config.stage_ranks // 2), ("a", "b"))
        parallel.mesh.parallel_mesh(ParallelConfig(pipeline_degree=2))  # the old helpers share them
    finally:
        dist.new_group = real
    return {"calls": dict(calls), "created": ProcessGroups.created()}


@pytest.mark.slow
def test_no_process_group_is_created_twice_for_the_same_ranks():
    results = run_ranks(_groups_made, 4, timeout=180)
    for got in results:
        assert got["calls"] and max(got["calls"].values()) == 1, got["calls"]
        assert sorted(got["calls"]) == sorted(got["created"])
    assert results[0]["calls"] == results[3]["calls"]  # every rank made the same groups


def _two_models(rank: int, world: int) -> dict:
    """A semi-auto model, then an auto-parallel one under optimizer parallel, in one process:
    FSDP2 needs each model's parameters on one mesh object, and DTensor's sharding cache hands
    the second model's parameters the first's (equal) mesh unless equal layouts are one mesh."""
    import torch

    import hetero
    from parallel.dims import build_mesh
    from recipes.gpt import GPT
    from tests.test_deferred_spmd import strategies

    parallel.init()

    def gpt() -> GPT:
        torch.manual_seed(0)
        return GPT(64, d_model=32, n_layer=2, n_head=2, block_size=8)

    x = torch.randint(0, 64, (4, 8))
    semi = parallel.parallelize(gpt(), ParallelConfig(
        tensor_degree=2, strategies=strategies("gpt_megatron", 1, 2)))
    semi.model(x)
    auto = parallel.parallelize(gpt(), ParallelConfig(
        search_mode="sharding_propagation", data_degree=2, enable_parallel_optimizer=True,
        optimizer_level="level3", parallel_optimizer_threshold=0), example_inputs=(x,))
    auto.model(x)[0].sum().backward()
    model, placed = _placed_data_parallel()
    placed.model(torch.randint(0, 16, (2, 3)))
    semi_text, auto_text = semi.explain(), auto.explain()
    return {"same": build_mesh((2,), ("a",)) is build_mesh((2,), ("a",)),
            "module": placed.module is model and isinstance(auto.module, GPT),
            "explained": "cpu" in hetero.explain(placed.model)
            # each mode's account after the mesh: the layouts; the plan, then the shards
            and semi_text.startswith("mesh ") and "[nn.Linear]" in semi_text
            and auto_text.index("auto parallel plan on 2 devices")
            < auto_text.index("optimizer parallel level3 over")}


@needs_spmd_sharding
@pytest.mark.slow
def test_two_models_in_one_process_share_one_mesh_per_layout():
    results = run_ranks(_two_models, 2, timeout=180)
    assert all(got["same"] and got["module"] and got["explained"] for got in results)


# ---------------------------------------------------------------- layers
def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package, below", [("hetero", {"parallel"}),
                                            ("foundation", {"parallel", "hetero"})])
def test_imports_only_go_down_the_layers(package, below):
    for path in (ROOT / package).rglob("*.py"):
        assert not _imported(path) & below, f"{path} imports {_imported(path) & below}"


def _import_graph() -> dict[str, set[str]]:
    """Library module -> the library modules it imports (anywhere in the file: a lazy import
    inside a function is still a dependency)."""
    paths = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
             for package in ("foundation", "hetero", "parallel")
             for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in paths}
    for name, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    target = full if full in paths else node.module
                    if target in paths and "." in target:  # not a package's own re-exports
                        graph[name].add(target)
    return graph


def _longest_cycle_through(graph: dict[str, set[str]], start: str, limit: int) -> int:
    """The length of a simple import cycle through ``start`` longer than 2, capped at
    ``limit`` (0: none)."""
    stack = [(start, (start,))]
    while stack:
        node, path = stack.pop()
        for nxt in graph[node]:
            if nxt == start and len(path) > 2:
                return len(path)
            if nxt not in path and len(path) < limit:
                stack.append((nxt, (*path, nxt)))
    return 0


def test_import_cycles_are_pairs_at_most():
    """Two modules may import each other (one lazily); a circle of three or more is a layer
    that is not one (issue 42: it was 12 files through parallel.result)."""
    graph = _import_graph()
    long = {name: n for name in graph if (n := _longest_cycle_through(graph, name, 8))}
    assert not long, f"import cycles of more than two modules through {long}"


def test_the_foundation_modules_keep_their_hetero_names():
    """hetero.device is foundation.device under its public name; the shims 0.1.0 deprecated
    (hetero.compat, hetero.model_view) are gone in 0.2.0."""
    import importlib

    import foundation.device
    import hetero

    assert hetero.device is foundation.device  # one module under two names: no warning
    for old in ("hetero.compat", "hetero.model_view"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
