"""A device without bfloat16 (Ascend 910A, GPUs before Ampere): the settings that ask for it,
the offload presets' default weights included, are refused by name before any process group,
each with its fix (issue 39). The device's answer is faked here."""

from __future__ import annotations

import pytest

import foundation.device as hd
from recipe_helpers import compose_train
from recipes.run_settings import check_run_settings


@pytest.fixture
def no_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hd, "supports_bf16", lambda: False)


def test_the_offload_presets_bf16_weights_are_refused_with_their_fix(no_bf16):
    with pytest.raises(ValueError, match=r"offload.param_dtype=bfloat16: .* has no bfloat16; "
                                         r"use offload.param_dtype=float16"):
        check_run_settings(compose_train(["offload=optimizer"]))
    check_run_settings(compose_train(["offload=optimizer", "offload.param_dtype=float16"]))


def test_bf16_autocast_is_refused_and_fp32_still_runs(no_bf16):
    with pytest.raises(ValueError, match=r"trainer.precision=bf16: .* use trainer.precision="
                                         r"fp16"):
        check_run_settings(compose_train(["trainer.precision=bf16"]))
    check_run_settings(compose_train([]))


def test_a_device_with_bf16_takes_them():
    assert hd.supports_bf16()  # the host has it
    check_run_settings(compose_train(["offload=optimizer", "trainer.precision=bf16"]))
