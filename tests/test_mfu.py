"""MFU in the recipe's metrics: PaLM's FLOPs per token against the device's peak, from the
user's figure, the accelerator's cluster preset or this host's measured profile."""

from __future__ import annotations

import pytest
import torch

import foundation.device as hd
from parallel.auto.cost_model import default_profile
from recipe_helpers import run_recipe
from recipes import mfu
from recipes.metrics import read_metrics


def test_flops_per_token_is_palms():
    # 6N for the weights' products, 12·L·d·s for attention's scores and values
    assert mfu.flops_per_token(1000, 2, 16, 64) == 6 * 1000 + 12 * 2 * 16 * 64
    assert mfu.flops_per_token(1000, None, None, 64) == 6000  # shape unknown: the weights' part


def test_the_peak_comes_from_the_user_the_preset_or_the_measured_host(monkeypatch, tmp_path):
    assert mfu.device_peak("bf16", 312.0) == mfu.Peak(312e12, "trainer.peak_tflops")
    monkeypatch.setattr(hd, "has_accelerator", lambda: True)
    for name, flops in (("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12),
                        ("NVIDIA A100-SXM4-80GB", 312e12)):
        monkeypatch.setattr(hd, "device_model", lambda name=name: name)
        peak = mfu.device_peak("bf16")
        assert peak is not None and peak.flops == flops and name in peak.source
    assert mfu.device_peak("fp32").flops == 19.5e12  # the A100's FP32 peak (the last one)
    monkeypatch.setattr(hd, "device_model", lambda: "Some Future GPU")
    assert mfu.device_peak("bf16") is None  # not guessed
    monkeypatch.setattr(hd, "has_accelerator", lambda: False)
    monkeypatch.setattr(hd, "device_model", lambda: None)
    monkeypatch.setenv("HETERO_PARALLEL_CACHE", str(tmp_path))
    assert mfu.device_peak("fp32") is None  # the host was never measured: defaults are guesses
    measured = default_profile()
    measured.save(tmp_path / f"device-profile-{measured.kind}.yaml")
    peak = mfu.device_peak("fp32")
    assert peak is not None and peak.flops == measured.flops and "measured" in peak.source


def test_the_meter_is_per_device():
    meter = mfu.MfuMeter(flops_per_token=100.0, devices=4, peak=mfu.Peak(1e6, "test"))
    assert meter(40_000.0) == pytest.approx(40_000 / 4 * 100 / 1e6)


@pytest.mark.slow
def test_the_recipe_reports_mfu_with_a_given_peak(tmp_path):
    run = tmp_path / "run"
    run_recipe(["trainer.max_steps=3", "trainer.peak_tflops=0.5"], 2, run, tmp_path / "data")
    records = read_metrics(run / "metrics.jsonl")
    line = next(line for line in (run / "train.log").read_text().splitlines()
                if "MFU against 0.5 TFLOP/s per device (trainer.peak_tflops)" in line)
    equation = line.split("FLOPs per token: ")[1]  # "6 x N parameters + 12 x 1 layers x ..."
    n_params, per_token = int(equation.split()[2]), float(equation.rsplit("= ", 1)[1])
    # the tests' tiny settings: 1 layer of width 32, data.seq_len 64
    assert "+ 12 x 1 layers x 32 width x 64 tokens" in equation
    assert per_token == mfu.flops_per_token(n_params, 1, 32, 64)
    for record in records:
        assert record["mfu"] == pytest.approx(
            record["tokens_per_s"] / 2 * per_token / 0.5e12, rel=1e-3)
    assert torch.tensor([r["mfu"] for r in records]).gt(0).all()
