"""Our host kernel: gradient upcast, Adam/AdamW update and weight downcast in one memory pass.

torch's fused CPU AdamW is vectorized but takes an FP32 gradient and leaves the 16-bit copy to a
second pass, and DeepSpeed's op is the same shape; together with the upcast that is ~40 bytes of
memory traffic per parameter where ~28 suffice. No library ships the fused form, so we write the
arithmetic once, in torch ops, and let ``torch.compile`` (Inductor's C++ backend) generate the
vectorized, OpenMP-parallel loop: every element is loaded once and stored once. The arithmetic
follows ``torch.optim.AdamW``'s single-tensor path operation for operation (same scalars computed
in double precision on the host), so results agree with it to float rounding.

Each (gradient dtype, output dtype, Adam/AdamW) combination compiles once per process on first
use (~6 s with a cold Inductor cache on the README's 2-core box, up to ~15 s loaded; ~2 s
warm); sizes are dynamic and hyper-parameters are tensor inputs, so learning-rate schedules do
not recompile.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from foundation.compat import cpp_compiler_missing, single_compile_thread
from hetero.optim.host_kernels import Hyper, KernelUnavailable, Run, TorchKernel


def _adam_math(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
               exp_avg_sq: torch.Tensor, out: torch.Tensor | None, scalars: torch.Tensor,
               decoupled: bool) -> None:
    # scalars: decay factor, weight decay, 1 - beta1, beta2, 1 - beta2, bias_correction2_sqrt,
    #          eps, -step_size, grad_scale  (FP32, computed in double by the caller, as torch's
    #          single-tensor AdamW casts its Python-float scalars)
    decay, wd, one_m_b1, b2, one_m_b2, bc2_sqrt, eps, neg_step, gscale = scalars.unbind(0)
    g = grad.float() * gscale
    if decoupled:
        p = param * decay
    else:
        g = g + param * wd
        p = param
    m = torch.lerp(exp_avg, g, one_m_b1)
    # Operand order as ATen's addcmul_ (s * a * b) and addcdiv_ (s * a / b) kernels evaluate.
    v = exp_avg_sq * b2 + one_m_b2 * g * g
    p = p + neg_step * m / (v.sqrt() / bc2_sqrt + eps)
    param.copy_(p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if out is not None:
        out.copy_(p)


_compiled = None


def _kernel():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_adam_math, dynamic=True, fullgraph=True)
    return _compiled


def _scalars(run: Run, hyper: Hyper) -> torch.Tensor:
    bias_correction1 = 1 - hyper.beta1 ** run.step
    bias_correction2 = 1 - hyper.beta2 ** run.step
    return torch.tensor([
        1 - hyper.lr * hyper.weight_decay, hyper.weight_decay, 1 - hyper.beta1, hyper.beta2,
        1 - hyper.beta2, bias_correction2 ** 0.5, hyper.eps,
        -hyper.lr / bias_correction1, hyper.grad_scale,
    ], dtype=torch.float32)


def compiler_missing() -> str | None:
    """Why Inductor cannot build C++ kernels here, or None when it can."""
    return cpp_compiler_missing()


class CompiledKernel:
    """Fused upcast + update + downcast, compiled by ``torch.compile``."""

    name = "compiled"

    def __init__(self) -> None:
        reason = compiler_missing()
        if reason is not None:
            raise KernelUnavailable(
                f"kernel='compiled' needs a C++ compiler for torch.compile's CPU backend "
                f"({reason}); install one (g++/clang++) or use kernel='torch'"
            )
        self._proven: set[tuple] = set()  # variants that compiled and ran once
        self._fallback = TorchKernel()

    def update(self, runs: Sequence[Run], hyper: Hyper) -> None:
        kernel = _kernel()
        for done, run in enumerate(runs):
            tensors = [run.param, run.grad, run.exp_avg, run.exp_avg_sq, run.out]
            if run.param.numel() <= 1 or not all(t is None or t.is_contiguous() for t in tensors):
                # Dynamo specializes sizes 0 and 1 (a compile each) and the fused loop wants
                # flat memory: such rare runs take torch's kernel, which agrees with ours.
                self._fallback.update([run], hyper)
                continue
            flat = [None if t is None else t.view(-1) for t in tensors]
            args = (*flat, _scalars(run, hyper), hyper.decoupled)
            variant = (run.grad.dtype, None if run.out is None else run.out.dtype,
                       hyper.decoupled)
            if variant in self._proven:
                kernel(*args)
                continue
            try:  # the first call of a variant compiles; a failure there mutates nothing
                with single_compile_thread():
                    kernel(*args)
            except Exception as err:
                first_line = str(err).splitlines()[0] if str(err) else ""
                raise KernelUnavailable(
                    f"torch.compile could not build the fused kernel for {variant} "
                    f"({type(err).__name__}: {first_line})", done=done,
                ) from err
            self._proven.add(variant)
