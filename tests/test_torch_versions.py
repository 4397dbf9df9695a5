"""Which torch the project imports on: from the lent GPU machines' 2.11 (a warning naming what
is known not to work there) to the 2.13 the whole suite runs on; below, an ImportError; above,
a warning that the private APIs may have moved."""

from __future__ import annotations

import pytest

from foundation import compat


@pytest.mark.parametrize("version, outcome", [
    ((2, 10), "needs torch >= 2.11"),
    ((2, 11), "the whole suite was run on it"),
    ((2, 13), None),
    ((2, 14), "may have moved"),
])
def test_each_torch_release_is_taken_refused_or_warned_of(monkeypatch, recwarn, version,
                                                          outcome):
    monkeypatch.setattr(compat, "torch_version", lambda: version)
    if version < compat.MIN_TORCH:
        with pytest.raises(ImportError, match=outcome):
            compat._check_torch()
        return
    compat._check_torch()
    found = [str(w.message) for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert (outcome is None and not found) or any(outcome in text for text in found)


def test_the_tested_releases_are_the_install_range_s():
    from pathlib import Path

    setup = (Path(__file__).resolve().parents[1] / "setup.cfg").read_text()
    low = ".".join(map(str, compat.MIN_TORCH))
    high = max(compat.TESTED_TORCH)
    assert f"torch>={low},<{high[0]}.{high[1] + 1}" in setup


def test_a_meta_model_is_dry_run_on_meta_inputs():
    """torch 2.11's fake tensors refuse a meta weight beside a host index in one operator (an
    embedding), so the pipeline's split and stage check feed a meta model meta inputs; a model
    with values keeps its inputs where they are."""
    import torch
    from torch import nn

    from foundation.compat import fake_tensor_mode
    from parallel.pipeline.dry_run import fake_inputs

    ids = torch.tensor([[1, 2]])
    with fake_tensor_mode() as mode:
        (meta,) = fake_inputs(nn.Embedding(4, 2, device="meta"), mode, (ids,))
        (host,) = fake_inputs(nn.Embedding(4, 2), mode, (ids,))
    assert meta.device.type == "meta" and host.device.type == "cpu"


def test_zbv_over_gloo_is_refused_where_torch_sends_between_a_ranks_own_stages(monkeypatch):
    """torch before 2.13 sends between the two adjacent stages zbv puts on one rank through the
    process group, and gloo connects no rank to itself ("Pair is not connected" at the first
    step, on 2.11): refused by name at the build. 2.13 hands the activation over in the process;
    NCCL may send to itself."""
    from torch.distributed.pipelining import PipelineStage

    if hasattr(PipelineStage, "_is_same_rank"):  # 2.13: nothing to refuse
        compat.check_stages_on_one_rank("gloo")
        monkeypatch.delattr(PipelineStage, "_is_same_rank")  # as in torch 2.11
    with pytest.raises(ValueError, match="parallel.schedule=zbv over gloo needs torch >= 2.13"):
        compat.check_stages_on_one_rank("gloo")
    compat.check_stages_on_one_rank("nccl")
