"""The fused kernels ring attention runs block by block: which one a device and dtype get, the
calls into CUDA's FlashAttention-2 checked against torch's operator schemas (on the meta device,
which runs torch's shape rules for them), a kernel that fails on its first use (warned, the
plain-operation kernel from then on, exact), and on a CUDA GPU the flash blocks against the
plain ones."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import foundation.device as hd
from foundation import compat
from parallel.context_parallel import blocks


@pytest.fixture
def fresh_kernel_state(monkeypatch):
    """This process's record of proven and failed kernels, empty for the test and restored."""
    monkeypatch.setattr(compat, "_BLOCK_KERNEL_PROVEN", set())
    monkeypatch.setattr(compat, "_BLOCK_KERNEL_FAILED", set())


def _block(dtype: torch.dtype = torch.float32, device: str = "cpu", dim: int = 8,
           tokens: int = 16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(2, heads, tokens, dim, generator=gen).to(device=device, dtype=dtype)
            for heads in (4, 2, 2, 4)]  # q, grouped k and v, dout


def _plain_and_fused(q, k, v, dout, causal: bool, monkeypatch) -> tuple[list, list]:
    def run() -> list[torch.Tensor]:
        out, lse = blocks.attend(q, k, v, 0.3, causal)
        delta = (dout.float() * out.float()).sum(-1)
        return [out, lse, *blocks.attend_backward(dout, q, k, v, out.to(q.dtype), delta, lse,
                                                  0.3, causal)]
    fused = run()
    with monkeypatch.context() as m:
        m.setattr(compat, "has_fused_attention_block", lambda t: False)
        plain = run()
    return fused, plain


def test_each_device_and_dtype_gets_its_fused_kernel_or_none():
    cpu, gpu, meta = torch.device("cpu"), torch.device("cuda", 0), torch.device("meta")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert hd.attention_block_kernel(cpu, dtype, 64) == "host_flash"
    assert hd.attention_block_kernel(gpu, torch.bfloat16, 128) == "flash"
    assert hd.attention_block_kernel(gpu, torch.float16, hd.FLASH_MAX_HEAD_DIM) == "flash"
    assert hd.attention_block_kernel(gpu, torch.float32, 64) is None  # no fp32 flash kernel
    assert hd.attention_block_kernel(gpu, torch.bfloat16, hd.FLASH_MAX_HEAD_DIM * 2) is None
    assert hd.attention_block_kernel(cpu, torch.float64, 64) is None
    assert hd.attention_block_kernel(meta, torch.bfloat16, 64) is None


@pytest.mark.parametrize("causal", [True, False])
def test_the_cuda_flash_calls_match_torch_operator_schemas(causal: bool):
    """Forward and backward as ring attention calls them, with torch's own shape rules for the
    CUDA operators: outputs shaped and typed as the block, the log-sum-exp fp32 per row."""
    q = torch.empty(2, 4, 48, 64, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(2, 4, 32 if not causal else 48, 64, dtype=torch.bfloat16, device="meta")
    fused = compat.fused_attention_block(q, kv, kv, causal, 0.125, kernel="flash")
    assert fused is not None
    out, lse = fused
    assert (out.shape, out.dtype) == (q.shape, torch.bfloat16)
    assert (lse.shape, lse.dtype) == (q.shape[:-1], torch.float32)
    grads = compat.fused_attention_block_backward(q, q, kv, kv, out, lse, causal, 0.125,
                                                  kernel="flash")
    assert grads is not None
    assert [(g.shape, g.dtype) for g in grads] == [(t.shape, t.dtype) for t in (q, kv, kv)]


def test_an_unknown_kernel_name_is_refused():
    q = torch.zeros(1, 1, 2, 4)
    with pytest.raises(ValueError, match="no fused attention kernel 'splash'"):
        compat.fused_attention_block(q, q, q, True, 0.5, kernel="splash")


@pytest.mark.parametrize("causal", [True, False])
def test_a_kernel_failing_on_first_use_warns_once_and_blocks_run_plain_exactly(
        monkeypatch, fresh_kernel_state, causal: bool):
    """CUDA's flash kernel named for host tensors fails as a kernel does on a device it does not
    serve: one warning naming it, then the plain-operation kernel, whose results are the host
    kernel's (the first device run of an unproven kernel trains on, slower, told why)."""
    q, k, v, dout = _block()
    want, _ = _plain_and_fused(q, k, v, dout, causal, monkeypatch)  # the host's fused kernel
    monkeypatch.setitem(hd._ATTENTION_BLOCK_KERNELS, "cpu", ("flash", frozenset({q.dtype})))
    with pytest.warns(RuntimeWarning, match="kernel 'flash' failed on cpu torch.float32"):
        out, lse = blocks.attend(q, k, v, 0.3, causal)
    assert compat.attention_block_kernel(q) is None  # not tried again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        delta = (dout * out).sum(-1)
        got = [out, lse, *blocks.attend_backward(dout, q, k, v, out, delta, lse, 0.3, causal)]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_kernel_that_has_run_raises_its_errors_and_memory_errors_always(fresh_kernel_state):
    q = torch.zeros(1, 1, 2, 4)

    def fail(error: Exception):
        def call():
            raise error
        return call
    with pytest.raises(torch.OutOfMemoryError):  # never taken for an unusable kernel
        compat._first_use_checked("flash", q, fail(torch.OutOfMemoryError("out of memory")))
    assert compat.attention_block_kernel(q) == "host_flash"
    assert compat._first_use_checked("host_flash", q, lambda: "ran") == "ran"
    with pytest.raises(RuntimeError, match="a later failure"):
        compat._first_use_checked("host_flash", q, fail(RuntimeError("a later failure")))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_flash_blocks_equal_the_plain_ones(monkeypatch, fresh_kernel_state, dtype,
                                                causal: bool):
    """On a GPU the blocks run on FlashAttention-2 (no warning: it did not fall back), with the
    plain kernel's output, log-sum-exp and gradients to 16-bit rounding."""
    q, k, v, dout = _block(dtype, "cuda", dim=64, tokens=128)
    assert compat.attention_block_kernel(q) == "flash"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fused, plain = _plain_and_fused(q, k, v, dout, causal, monkeypatch)
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
def test_a_one_rank_ring_on_cuda_flash_is_attention(fresh_kernel_state):
    import torch.distributed as dist

    import parallel
    from parallel.context_parallel import ring_attention

    parallel.init()
    q, k, v = (t.requires_grad_() for t in _block(torch.bfloat16, "cuda", 64, 256)[:3])
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grads = torch.autograd.grad(want.float().square().sum(), (q, k, v))
    got = ring_attention(q, k, v, dist.group.WORLD)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    for a, b in zip(torch.autograd.grad(got.float().square().sum(), (q, k, v)), grads,
                    strict=True):
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2)
