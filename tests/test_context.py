"""set/get/reset_auto_parallel_context: the reference's settings, checked before applied."""

from __future__ import annotations

import pytest

import parallel
from parallel.context import ParallelMode

# the context's defaults are ParallelConfig's: one set of defaults
DEFAULTS = {
    "parallel_mode": ParallelMode.DATA_PARALLEL,
    "device_num": None,
    "gradients_mean": True,
    "parameter_broadcast": True,
    "search_mode": None,  # searched only under parallel_mode=auto_parallel
    "enable_parallel_optimizer": False,
    "pipeline_stages": 1,
    "full_batch": True,
}


def test_defaults():
    for name, value in DEFAULTS.items():
        assert parallel.context.get_auto_parallel_context(name) == value


def test_parallel_mode_members_are_the_reference_names():
    assert [m.value for m in ParallelMode] == [
        "stand_alone", "data_parallel", "semi_auto_parallel", "auto_parallel", "hybrid_parallel"
    ]


def test_set_get_reset_round_trip():
    settings = {
        "parallel_mode": ParallelMode.SEMI_AUTO_PARALLEL,
        "device_num": 8,
        "gradients_mean": True,
        "parameter_broadcast": True,
        "search_mode": "sharding_propagation",
        "enable_parallel_optimizer": True,
        "pipeline_stages": 2,
        "full_batch": True,
    }
    parallel.context.set_auto_parallel_context(**settings)
    for name, value in settings.items():
        assert parallel.context.get_auto_parallel_context(name) == value
    parallel.context.reset_auto_parallel_context()
    test_defaults()


def test_mode_accepts_its_string_name():
    parallel.context.set_auto_parallel_context(parallel_mode="data_parallel")
    mode = parallel.context.get_auto_parallel_context("parallel_mode")
    assert mode is ParallelMode.DATA_PARALLEL


@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        ({"gradient_mean": True}, ValueError, "'gradient_mean'"),
        ({"parallel_mode": "model_parallel"}, ValueError, "'model_parallel' is not one of"),
        ({"parallel_mode": 1}, TypeError, "parallel_mode must be"),
        ({"device_num": 0}, ValueError, "device_num must be at least 1"),
        ({"device_num": 2.0}, TypeError, "device_num must be an int"),
        ({"device_num": True}, TypeError, "device_num must be an int"),
        ({"pipeline_stages": "2"}, TypeError, "pipeline_stages must be an int"),
        ({"gradients_mean": 1}, TypeError, "gradients_mean must be a bool"),
        ({"full_batch": "yes"}, TypeError, "full_batch must be a bool"),
        ({"search_mode": "greedy"}, ValueError, "search_mode 'greedy' is not one of"),
        ({"tensor_degree": 0}, ValueError, "tensor_degree must be at least 1"),
        ({"schedule": "zb"}, ValueError, "schedule 'zb' is not one of"),
    ],
)
def test_bad_settings_name_the_key(settings, error, message):
    with pytest.raises(error, match=message):
        parallel.context.set_auto_parallel_context(**settings)


def test_a_bad_setting_changes_nothing():
    with pytest.raises(TypeError, match="pipeline_stages"):
        parallel.context.set_auto_parallel_context(gradients_mean=True, pipeline_stages="four")
    assert parallel.context.get_auto_parallel_context("gradients_mean") is True
    assert parallel.context.get_auto_parallel_context("pipeline_stages") == 1


def test_unknown_name_on_get():
    with pytest.raises(ValueError, match="unknown auto-parallel setting 'pipeline_count'"):
        parallel.context.get_auto_parallel_context("pipeline_count")


def test_the_context_speaks_parallel_configs_names_too():
    """Python, YAML and the context accept the same names: every ParallelConfig field, plus the
    reference's spellings of a few (parallel_mode, pipeline_stages)."""
    parallel.context.set_auto_parallel_context(
        tensor_degree=2, pipeline_stages=2, schedule="gpipe",
        parallel_optimizer_config={"optimizer_level": "level2"})
    # no mode set: the one the fields run as (tensor_degree=2 alone: the model's own collectives)
    assert (parallel.context.get_auto_parallel_context("parallel_mode")
            is ParallelMode.HYBRID_PARALLEL)
    parallel.context.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
    assert parallel.context.get_auto_parallel_context("pipeline_degree") == 2
    config = parallel.ParallelConfig.from_context(enable_parallel_optimizer=True)
    assert (config.operator_split, config.tensor_degree, config.pipeline_degree, config.schedule,
            config.optimizer_level) == ("strategies", 2, 2, "gpipe", "level2")
    assert parallel.ParallelConfig.from_context() == parallel.ParallelConfig(
        strategy_tags=True, tensor_degree=2, pipeline_degree=2, schedule="gpipe",
        optimizer_level="level2")


@pytest.mark.parametrize("mode, fields", [
    ("stand_alone", {"data_degree": 1}),
    ("data_parallel", {}),
    ("semi_auto_parallel", {"strategy_tags": True}),
    ("auto_parallel", {"search_mode": "sharding_propagation"}),
    ("hybrid_parallel", {"tensor_degree": 2}),
])
def test_the_mode_is_translated_once_into_the_fields_that_say_it(mode, fields):
    """ParallelConfig has no mode: the context translates the reference's into fields, and the
    config derives the same mode back from them."""
    extra = {"tensor_degree": 2} if mode == "hybrid_parallel" else {}
    parallel.context.set_auto_parallel_context(parallel_mode=mode, **extra)
    config = parallel.ParallelConfig.from_context()
    assert config == parallel.ParallelConfig(**fields)
    if mode != "stand_alone":  # one replica of data parallel
        assert config.operator_split.reference_mode is ParallelMode(mode)
    with pytest.warns(DeprecationWarning, match="ParallelConfig.mode is deprecated"):
        assert config.mode is ParallelMode("data_parallel" if mode == "stand_alone" else mode)


def test_the_context_accepts_the_previous_release_names_with_a_warning():
    with pytest.warns(DeprecationWarning, match="'model' is deprecated, use 'tensor_degree'"):
        parallel.context.set_auto_parallel_context(parallel_mode="semi_auto_parallel", model=2)
    assert parallel.context.get_auto_parallel_context("tensor_degree") == 2


def test_reading_the_mode_never_refuses_what_only_a_config_would():
    """The mode is read from the settings themselves: a combination a ParallelConfig refuses
    (a memory bound with no search) still reads back; from_context() is where it is refused."""
    parallel.context.set_auto_parallel_context(max_device_memory=2**30)
    assert parallel.context.get_auto_parallel_context("parallel_mode") is ParallelMode.DATA_PARALLEL
    with pytest.raises(ValueError, match="max_device_memory bounds the plan of a search"):
        parallel.ParallelConfig.from_context()
