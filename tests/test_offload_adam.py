"""hetero.optim.OffloadAdam(W): numerics against torch's Adam(W), state dicts, bad input.

The training-loop behaviour (hooks and buckets, accumulation, clipping, loss scaling, memory,
placed models, the recipe) is in test_offload_training.py.
"""

from __future__ import annotations

import copy
import io
import os

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import hetero
from hetero.optim import OffloadAdam, OffloadAdamW, host_arena
from hetero.optim.host_kernels import KernelUnavailable

SHAPES = [(1,), (7,), (1023,), (2**20 + 3,)]
#: rtol 1e-6, plus an absolute floor of one float32 ulp at the parameters' scale (N(0, 1)): near
#: zero a relative bound means nothing, and kernels round differently (ATen's vectorized lerp
#: uses an FMA, Inductor's generated loop does not).
ATOL = 1e-7


def _groups(params, hyper_groups):
    return [{"params": [p], **h} for p, h in zip(params, hyper_groups, strict=True)]


def _deepspeed_op_built() -> bool:
    """True when DeepSpeed's cpu_adam op is already built: building it takes a minute or two
    (``python benchmarks/host_adam.py`` does it once), too long for the suite."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except ImportError:
        return False
    from torch.utils.cpp_extension import _get_build_directory

    build = _get_build_directory(CPUAdamBuilder.NAME, verbose=False)
    return os.path.exists(os.path.join(build, f"{CPUAdamBuilder.NAME}.so"))


KERNEL_CASES = [
    (OffloadAdamW, torch.optim.AdamW, "torch", (1e-6, 1e-6)),
    (OffloadAdamW, torch.optim.AdamW, "compiled", (1e-6, 1e-6)),
    (OffloadAdam, torch.optim.Adam, "torch", (1e-6, 1e-6)),
    # DeepSpeed's op rounds its own way (~100 ulp apart on exp_avg_sq after 20 steps)
    pytest.param(OffloadAdamW, torch.optim.AdamW, "deepspeed", (1e-5, 1e-4),
                 marks=pytest.mark.skipif(not _deepspeed_op_built(),
                                          reason="DeepSpeed's cpu_adam op is not built here")),
]


@pytest.mark.parametrize("cls,ref_cls,kernel,rtols", KERNEL_CASES)
def test_fp32_equals_torch_for_20_steps_with_groups_and_scheduler(cls, ref_cls, kernel, rtols):
    rtol, moment_rtol = rtols
    torch.manual_seed(0)
    params = [torch.randn(s, requires_grad=True) for s in SHAPES]
    refs = [p.detach().clone().requires_grad_() for p in params]
    hyper = [{}, {"lr": 3e-3}, {"weight_decay": 0.1, "betas": (0.8, 0.99)}, {"eps": 1e-6}]
    opt = cls(_groups(params, hyper), lr=1e-2, weight_decay=0.02, kernel=kernel)
    ref = ref_cls(_groups(refs, hyper), lr=1e-2, weight_decay=0.02)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5) for o in (opt, ref)]
    for step in range(20):
        for i, (p, r) in enumerate(zip(params, refs, strict=True)):
            if step % 7 == 3 and i == 1:  # a parameter without a gradient is left alone
                p.grad = r.grad = None
                continue
            g = torch.randn_like(p)
            p.grad, r.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        for s in scheds:
            s.step()
    for p, r in zip(params, refs, strict=True):
        torch.testing.assert_close(p, r, rtol=rtol, atol=ATOL)
    for p, r in zip(params, refs, strict=True):
        assert opt.state[p]["step"] == ref.state[r]["step"]
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref.state[r]["exp_avg_sq"],
                                   rtol=moment_rtol, atol=1e-12)


@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, "compiled"), (torch.bfloat16, "torch"),
                                          (torch.float16, "torch")])
def test_16bit_master_follows_fp32_adamw_and_device_copy_is_its_downcast(dtype, kernel):
    torch.manual_seed(1)
    params = [nn.Parameter(torch.randn(s)) for s in [(33, 17), (1,), (4099,)]]
    refs = [p.detach().clone().requires_grad_() for p in params]
    opt = OffloadAdamW(params, lr=1e-2, param_dtype=dtype, kernel=kernel)
    ref = torch.optim.AdamW(refs, lr=1e-2)
    assert all(p.dtype == dtype for p in params)
    for _ in range(6):
        for p, r in zip(params, refs, strict=True):
            g = torch.randn(p.shape).to(dtype)
            p.grad, r.grad = g, g.float()  # the reference gets the same, upcast gradient
        opt.step()
        ref.step()
    for p, r in zip(params, refs, strict=True):
        master = opt.state[p]["fp32_master"]
        torch.testing.assert_close(master, r.detach(), rtol=1e-6, atol=ATOL)
        assert torch.equal(p.detach(), master.to(dtype))


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 3))


def _train(model, opt, steps, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 8, generator=gen).to(dtype)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_state_dict_round_trips_with_torch_adamw_both_ways():
    # ours -> torch: same moments and steps, and torch continues where we stopped
    model, twin = _model(), _model()
    ours = OffloadAdamW(model.parameters(), lr=1e-2, kernel="torch")
    _train(model, ours, 3, seed=1, dtype=torch.float32)
    twin.load_state_dict(model.state_dict())
    theirs = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))  # as saved: torch would share
    _train(model, ours, 3, seed=2, dtype=torch.float32)
    _train(twin, theirs, 3, seed=2, dtype=torch.float32)
    for p, r in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=ATOL)
    # torch -> ours (16-bit device copies): moments and steps carried over exactly
    ours16 = OffloadAdamW(_model().parameters(), lr=1e-2, param_dtype=torch.bfloat16)
    ours16.load_state_dict(theirs.state_dict())
    for (_, s), (_, t) in zip(ours16.state_dict()["state"].items(),
                              theirs.state_dict()["state"].items(), strict=True):
        assert torch.equal(s["exp_avg"], t["exp_avg"]) and s["step"] == t["step"]
    # a bf16 optimizer's dict (with masters) loads into torch.optim.AdamW as well
    torch.optim.AdamW(_model().parameters()).load_state_dict(ours16.state_dict())


@pytest.mark.parametrize("via_dcp", [False, True])
def test_resume_continues_bit_exactly(via_dcp):
    def fresh():
        model = _model()
        return model, OffloadAdamW(model.parameters(), lr=1e-2, param_dtype=torch.bfloat16,
                                   kernel="torch")

    model, opt = fresh()
    _train(model, opt, 3, seed=1)
    if via_dcp:  # what the recipe's checkpoints use: optimizer loaded before the model
        msd, osd = get_state_dict(model, opt)
        saved = copy.deepcopy({"model": msd, "optim": osd})
    else:
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    _train(model, opt, 3, seed=2)
    model2, opt2 = fresh()
    if via_dcp:
        set_state_dict(model2, opt2, model_state_dict=saved["model"],
                       optim_state_dict=saved["optim"])
    else:
        buf.seek(0)
        saved = torch.load(buf)
        model2.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["optim"])
    _train(model2, opt2, 3, seed=2)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["fp32_master"], opt2.state[q]["fp32_master"])


def test_model_weights_loaded_after_the_optimizer_become_the_master():
    model = _model()
    opt = OffloadAdamW(model.parameters(), param_dtype=torch.bfloat16, kernel="torch")
    other = _model(seed=5).bfloat16()
    model.load_state_dict(other.state_dict())  # new weights, written outside the optimizer
    w = model[0].weight
    assert torch.equal(opt.state_dict()["state"][0]["fp32_master"], w.detach().float())


def test_bad_state_dicts_are_refused_before_anything_changes():
    model = _model()
    opt = OffloadAdamW(model.parameters(), kernel="torch")
    _train(model, opt, 1, seed=0, dtype=torch.float32)
    good = copy.deepcopy(opt.state_dict())
    bad_shape = copy.deepcopy(good)
    bad_shape["state"][3]["exp_avg"] = torch.zeros(5)
    with pytest.raises(ValueError, match="state 'exp_avg' of parameter 3 has 5 elements"):
        opt.load_state_dict(bad_shape)
    amsgrad = copy.deepcopy(good)
    amsgrad["param_groups"][0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad=True"):
        opt.load_state_dict(amsgrad)
    with pytest.raises(ValueError, match="2 parameter groups"):
        opt.load_state_dict({**good, "param_groups": good["param_groups"] * 2})
    assert all(torch.equal(opt.state_dict()["state"][i]["exp_avg"], good["state"][i]["exp_avg"])
               for i in good["state"])


def test_bad_input_fails_before_any_state_is_created():
    ok, other = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(2))
    complex_param = nn.Parameter(torch.randn(2, dtype=torch.cfloat))
    cases = [
        (dict(params=[ok], kernel="gpu_fast"), ValueError, "unknown kernel 'gpu_fast'"),
        (dict(params=ok), TypeError, "single tensor"),
        (dict(params=[]), ValueError, "empty parameter list"),
        (dict(params=[ok], param_dtype=torch.float32), ValueError, "param_dtype must be"),
        (dict(params=[ok], lr=-1.0), ValueError, r"invalid lr=-1.0 \(must be >= 0"),
        (dict(params=[ok], bucket_cap_mb=0), ValueError, "bucket_cap_mb"),
        (dict(params=[{"params": [ok]}, {"params": [complex_param]}]), ValueError,
         "parameter 0 of param group 1 is complex"),
        (dict(params=[ok, nn.Parameter(torch.randn(2, dtype=torch.float64))]), ValueError,
         "dtype torch.float64"),
        (dict(params=[{"params": [ok]}, {"params": [other], "amsgrad": True}]), ValueError,
         "amsgrad=True is not implemented"),
        (dict(params=[{"params": [ok]}, {"params": [other, other]}]), ValueError, "twice"),
        (dict(params=[{"params": [ok]}, {"params": [ok]}]), ValueError, "more than one"),
    ]
    for kwargs, err, match in cases:
        with pytest.raises(err, match=match):
            OffloadAdamW(**{"param_dtype": torch.bfloat16, **kwargs})
        assert ok.dtype == torch.float32 and ok._post_accumulate_grad_hooks is None, match


@pytest.mark.parametrize("failure", ["host_oom", "non_leaf"])
def test_a_failing_second_param_group_leaves_the_model_untouched(monkeypatch, failure):
    """The first group used to be cast to bf16 (values rounded) before the second one failed."""
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    second: list = list(model[2].parameters())
    if failure == "host_oom":
        real_add, calls = host_arena.HostArena.add, []

        def add(arena, name, *args, **kwargs):
            calls.append(name)
            if len(calls) > 5:  # the first group's arena holds five buffers
                raise RuntimeError("host out of memory (simulated)")
            return real_add(arena, name, *args, **kwargs)
        monkeypatch.setattr(host_arena.HostArena, "add", add)
        match = "host out of memory"
    else:
        second.append(torch.randn(3, requires_grad=True) * 2)  # computed, not a leaf
        match = "parameter 2 of param group 1 is not a leaf"
    with pytest.raises((RuntimeError, ValueError), match=match):
        OffloadAdamW([{"params": model[0].parameters()}, {"params": second}],
                     param_dtype=torch.bfloat16)
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[name]), name
        assert p._post_accumulate_grad_hooks is None, name


@pytest.mark.parametrize("max_norm, norm_type, match", [
    (-1.0, 2.0, r"invalid max_norm=-1.0 \(must be >= 0"),
    (float("nan"), 2.0, "invalid max_norm=nan"),
    (1.0, 0.0, r"invalid norm_type=0.0 \(must be > 0"),
])
def test_clip_grad_norm_refuses_impossible_norms(max_norm, norm_type, match):
    """clip_grad_norm_(-1) scaled the gradients by a negative factor: gradient ascent."""
    model = _model()
    opt = OffloadAdamW(model.parameters(), param_dtype=torch.bfloat16, kernel="torch")
    model(torch.randn(4, 8, dtype=torch.bfloat16)).sum().backward()
    with pytest.raises(ValueError, match=match):
        opt.clip_grad_norm_(max_norm, norm_type)
    assert opt._grad_scale == 1.0


def test_add_param_group_later_trains_like_torch():
    model, twin = _model(), _model()
    opt = OffloadAdamW(model[0].parameters(), lr=1e-2, param_dtype=torch.bfloat16,
                       kernel="torch")
    ref = torch.optim.AdamW(twin[0].parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="is complex"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, dtype=torch.cfloat))]})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": model[2].parameters(), "lr": 3e-3})
    ref.add_param_group({"params": twin[2].parameters(), "lr": 3e-3})
    assert model[2].weight.dtype == torch.bfloat16
    for _ in range(2):
        for p, r in zip(model.parameters(), twin.parameters(), strict=True):
            g = torch.randn(p.shape).to(torch.bfloat16)
            p.grad, r.grad = g, g.float()
        opt.step()
        ref.step()
    for p, r in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(opt.state[p]["fp32_master"], r.detach(), rtol=1e-6, atol=ATOL)


def test_deepspeed_missing_is_a_clear_error_and_auto_falls_back(monkeypatch):
    op_builder = pytest.importorskip("deepspeed.ops.op_builder")
    import hetero.optim.compiled_kernel as compiled_kernel

    def broken(self):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(op_builder.CPUAdamBuilder, "load", broken)
    p = nn.Parameter(torch.randn(4))
    with pytest.raises(KernelUnavailable, match="kernel='deepspeed' needs DeepSpeed's cpu_adam"):
        OffloadAdamW([p], param_dtype=torch.bfloat16, kernel="deepspeed")
    assert p.dtype == torch.float32
    monkeypatch.setattr(compiled_kernel, "compiler_missing", lambda: "no g++")
    with pytest.raises(KernelUnavailable, match="kernel='compiled' needs a C"):
        OffloadAdamW([p], kernel="compiled")
    opt = OffloadAdamW([p], kernel="auto", param_dtype=torch.bfloat16)
    p.grad = torch.ones(4, dtype=torch.bfloat16)
    with pytest.warns(RuntimeWarning, match="falling back"):
        opt.step()
    assert opt.kernel == "torch"
    assert torch.equal(p, opt.state[p]["fp32_master"].bfloat16())


def test_a_group_with_offload_false_stays_in_place_and_trains_like_torch():
    """Offload is per group: the kept group stays FP32 where it is (no param_dtype cast, no
    master copy) and steps like torch.optim.AdamW; the other group is offloaded in bf16."""
    model, twin = _model(), _model()
    head, rest = list(model[2].parameters()), list(model[0].parameters())
    opt = OffloadAdamW([{"params": rest}, {"params": head, "offload": False}], lr=1e-2,
                       param_dtype=torch.bfloat16, kernel="torch")
    assert all(p.dtype == torch.bfloat16 for p in rest)
    assert all(p.dtype == torch.float32 for p in head)
    assert "fp32_master" in opt.state[rest[0]] and "fp32_master" not in opt.state[head[0]]
    ref = torch.optim.AdamW(twin[2].parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        for p, r in zip(head, twin[2].parameters(), strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            r.grad = p.grad.clone()
        for p in rest:
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
        opt.step()
        ref.step()
    for p, r in zip(head, twin[2].parameters(), strict=True):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=ATOL)
    # the layout survives a state-dict round trip, also through torch.optim.AdamW's groups
    saved = copy.deepcopy(opt.state_dict())
    assert [g["offload"] for g in saved["param_groups"]] == [True, False]
    opt.load_state_dict(torch.optim.AdamW(twin.parameters()).state_dict() | {
        "state": {}, "param_groups": [{k: v for k, v in g.items() if k != "offload"}
                                      for g in saved["param_groups"]]})
    assert [g["offload"] for g in opt.param_groups] == [True, False]
    with pytest.raises(ValueError, match="offload=False, which keeps FP32 parameters .* "
                                         "parameter 0 is torch.bfloat16"):
        OffloadAdamW([{"params": rest, "offload": False}])
    with pytest.raises(TypeError, match="offload must be a bool"):
        OffloadAdamW([{"params": head, "offload": "no"}])


def test_hetero_exports_optim():
    assert hetero.optim.OffloadAdamW is OffloadAdamW
