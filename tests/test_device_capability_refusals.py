"""What a device cannot do is refused by name before any process group, each with its fix
(issue 39): bfloat16 on a device without it (Ascend 910A, GPUs before Ampere; the offload
presets' default weights ask for it), and torch.compile's default backend on an NPU. The
device's answers are faked here."""

from __future__ import annotations

import pytest
import torch

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


def test_compiling_for_a_device_inductor_does_not_serve_is_refused(monkeypatch):
    """trainer.compile with the default backend on an NPU (issue 39): refused by name."""
    check_run_settings(compose_train(["trainer.compile=true", "parallel=none"]))
    monkeypatch.setattr(hd, "accelerator_type", lambda: "npu")
    assert not hd.inductor_compiles()
    monkeypatch.setattr(hd, "resolve", lambda name: "npu:0")
    with pytest.raises(ValueError, match=r"trainer.compile=true on npu:0: torch.compile's "
                                         r"default backend \(Inductor\) generates no kernels"):
        check_run_settings(compose_train(["trainer.compile=true", "parallel=none"]))


def _table_grads(sharding: str) -> dict[bool, torch.Tensor]:
    """The table's gradient after one lookup, with sparse tensors on the device and without."""
    import hetero

    out = {}
    for sparse_here in (True, False):
        real = hd.has_sparse_tensors
        hd.has_sparse_tensors = lambda device, on=sparse_here: on
        try:
            torch.manual_seed(0)
            table = hetero.nn.EmbeddingLookup(12, 3, target="DEVICE", sharding=sharding)
            (table(torch.tensor([[1, 4, 4], [7, 1, 0]])) * torch.arange(18.0).view(2, 3, 3)
             ).sum().backward()
        finally:
            hd.has_sparse_tensors = real
        out[sparse_here] = table.weight.grad
    return out


@pytest.mark.parametrize("sharding", ["none", "row"])
def test_a_device_without_sparse_tensors_gets_the_tables_gradient_dense(sharding):
    """An NPU has no sparse kernels (issue 39): a device table's gradient comes dense there, with
    the values the row-sparse one holds."""
    import parallel

    parallel.init()
    grads = _table_grads(sharding)
    assert grads[True].is_sparse and not grads[False].is_sparse
    torch.testing.assert_close(grads[False], grads[True].to_dense())
