"""MFU: the model FLOPs each device does per second, against that device's peak.

The model's FLOPs per token are PaLM's (Chowdhery et al. 2022, appendix B): ``6 N`` for the
matrix products with the N weights (2 forward, 4 backward) plus ``12 L d s`` for attention's
score and value products over a sequence of s tokens (L layers of width d). Recompute is not
counted: MFU is the model's work, not the hardware's (that would be HFU).

The device's peak comes from, in order: ``trainer.peak_tflops`` (the user's figure), the cluster
preset of the accelerator the runtime names (``parallel/auto/clusters/``: H100, H200 — the same
compute as H100 SXM —, A100, Ascend 910B), or on a host-only machine the FLOP/s
``parallel.auto.profile_devices()`` measured and saved here. Without any of them MFU is not
reported, and the log says how to give the peak.
"""

from __future__ import annotations

import dataclasses

import torch

import foundation.device as hd

#: a token in the accelerator's model name -> the cluster preset holding its peak FLOP/s
PRESET_OF_MODEL = {"h100": "h100-80gb", "h200": "h100-80gb", "a100": "a100-80gb",
                   "910b": "ascend-910b"}
#: trainer.precision -> the dtype whose peak the matrix products run at
PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def flops_per_token(n_params: int, n_layer: int | None, d_model: int | None,
                    seq_len: int) -> float:
    """Training FLOPs per token (module docstring); the attention term only when the layer
    count and width are known."""
    attention = 12 * n_layer * d_model * seq_len if n_layer and d_model else 0
    return 6.0 * n_params + attention


@dataclasses.dataclass(frozen=True)
class Peak:
    """A device's peak FLOP/s and where the figure came from (for the log)."""

    flops: float
    source: str


def device_peak(precision: str, explicit_tflops: float | None = None) -> Peak | None:
    """This device's peak FLOP/s at ``precision`` (module docstring), or None where unknown."""
    if explicit_tflops is not None:
        return Peak(explicit_tflops * 1e12, "trainer.peak_tflops")
    dtype = PRECISION_DTYPES[precision]
    model = hd.device_model()
    if model is not None:
        from parallel.auto.cluster import ClusterSpec

        preset = next((p for token, p in PRESET_OF_MODEL.items() if token in model.lower()),
                      None)
        if preset is None:
            return None
        return Peak(ClusterSpec.preset(preset).peak_flops(dtype),
                    f"the {preset} preset's {dtype} peak ({model})")
    if hd.has_accelerator():
        return None
    from parallel.auto.profile import measured_profile

    profile = measured_profile()
    return None if profile is None else Peak(profile.flops, "this host's measured FLOP/s "
                                                            "(parallel.auto.profile_devices)")


class MfuMeter:
    """MFU of a step from its global token rate: ``tokens_per_s / devices * flops_per_token /
    peak``."""

    def __init__(self, flops_per_token: float, devices: int, peak: Peak) -> None:
        self.flops_per_token = flops_per_token
        self.devices = devices
        self.peak = peak

    def __call__(self, tokens_per_s: float) -> float:
        return tokens_per_s / self.devices * self.flops_per_token / self.peak.flops
