"""Optimizer parallel's backends: what each declares, the one choice, and the config refusing
exactly what no backend takes (``parallel/optimizer_parallel/backends.py``)."""

from __future__ import annotations

import pytest
import torch

from parallel import ParallelConfig
from parallel.combinations import RULES
from parallel.optimizer_parallel.backends import BACKENDS, FEATURES, Facts, choose, unbuilt


def _facts(chunkwise: bool = True, releasable: bool = True, asked: list | None = None) -> Facts:
    def ask(name: str, answer: bool):
        def fact() -> bool:
            if asked is not None:
                asked.append(name)
            return answer
        return fact
    return Facts(ask("chunkwise", chunkwise), ask("releasable", releasable))


def test_a_plain_model_takes_the_fast_backends_and_the_rest_fsdp2():
    asked: list[str] = []
    assert choose("level1", set(), _facts(asked=asked)).name == "whole_weights"
    assert choose("level2", set(), _facts(asked=asked)).name == "whole_weights"
    assert asked == ["chunkwise", "chunkwise"]  # level1/2 ask only the group's backend
    # on NCCL or HCCL: FSDP2's units, which reduce-scatter and prefetch on side streams
    assert choose("level1", set(), _facts(chunkwise=False)).name == "fsdp2"
    assert choose("level2", set(), _facts(chunkwise=False)).name == "fsdp2"
    assert choose("level3", set(), _facts()).name == "resharded"
    assert choose("level3", set(), _facts(chunkwise=False)).name == "fsdp2"  # NCCL, HCCL
    assert choose("level3", set(), _facts(releasable=False)).name == "fsdp2"  # shared storage
    for feature in ("semi_auto", "experts", "pipeline", "param_dtype", "deferred"):
        assert choose("level1", {feature}, _facts()).name == "fsdp2", feature
    assert choose("level2", {"placed"}, _facts()).name == "placed"


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_every_pair_a_backend_cannot_take_is_refused_by_name(backend):
    for pair, why in backend.not_together.items():
        assert unbuilt(pair) == why
        with pytest.raises(ValueError, match=f"ShardedDataParallel: {why}"):
            choose("level2", pair, _facts())


def test_placed_models_take_no_other_feature():
    for feature in set(FEATURES) - {"placed"}:
        why = unbuilt({"placed", feature})
        assert why is not None and feature in why and "placed by whole modules" in why


def test_unknown_features_are_refused():
    with pytest.raises(ValueError, match="unknown features \\['zero_infinity'\\]"):
        choose("level1", {"zero_infinity"}, _facts())


def test_the_config_refuses_what_no_backend_takes_with_the_backends_reason():
    reasons = {rule.reason for rule in RULES}
    for backend in BACKENDS:
        for pair, why in backend.not_together.items():
            if "host_params" in pair:  # ParallelConfig.offload_params checks those
                config = dict(enable_parallel_optimizer=True, optimizer_level="level3",
                              offload_params=True)
                other = next(iter(pair - {"host_params"}))
                config.update({"semi_auto": {"strategy_tags": True},
                               "experts": {"expert_degree": 2},
                               "pipeline": {"pipeline_degree": 2, "micro_batches": 2},
                               "param_dtype": {"param_dtype": torch.bfloat16}}[other])
                with pytest.raises(ValueError, match=why):
                    ParallelConfig(**config)
                continue
            assert why in reasons  # the matrix reads the declarations
    with pytest.raises(ValueError, match="param_dtype with semi-auto sharding is not built yet"):
        ParallelConfig(strategy_tags=True, enable_parallel_optimizer=True,
                       param_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="expert shards with param_dtype are not built yet"):
        ParallelConfig(expert_degree=2, enable_parallel_optimizer=True,
                       param_dtype=torch.bfloat16)
    ParallelConfig(pipeline_degree=2, micro_batches=2, enable_parallel_optimizer=True,
                   param_dtype=torch.bfloat16)  # fsdp2 takes both
