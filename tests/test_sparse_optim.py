"""hetero.optim.LazyAdam and FTRL against references written here straight from the formulas (a
dense loop over the touched rows, in float64), for duplicate indices, several steps and several
param groups; LazyAdam on dense gradients against torch.optim.Adam; state_dict round trips."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from hetero.optim import FTRL, LazyAdam

V, D = 40, 5
DT = torch.float64

# ----------------------------------------------------------------------------- references


def lazy_adam_reference(w, m, v, grad_rows: dict[int, torch.Tensor], step: int, lr, betas, eps,
                        weight_decay, nesterov):
    """One LazyAdam step, row by row, for the rows present in the (summed) gradient."""
    b1, b2 = betas
    for r, g in grad_rows.items():
        g = g + weight_decay * w[r]
        m[r] = b1 * m[r] + (1 - b1) * g
        v[r] = b2 * v[r] + (1 - b2) * g * g
        numerator = b1 * m[r] + (1 - b1) * g if nesterov else m[r]
        w[r] = w[r] - lr / (1 - b1**step) * numerator / (v[r].sqrt() / math.sqrt(1 - b2**step)
                                                         + eps)


def ftrl_reference(w, accum, linear, grad_rows: dict[int, torch.Tensor], lr, lr_power, l1, l2,
                   weight_decay):
    """One FTRL-proximal step, row by row, as the reference framework documents it."""
    p = lr_power
    for r, g in grad_rows.items():
        g = g + weight_decay * w[r]
        new_accum = accum[r] + g * g
        linear[r] = linear[r] + g - (new_accum ** (-p) - accum[r] ** (-p)) / lr * w[r]
        quadratic = new_accum ** (-p) / lr + 2 * l2
        for j in range(w.shape[1]):
            u = linear[r, j]
            w[r, j] = (torch.sign(u) * l1 - u) / quadratic[j] if abs(u) > l1 else 0.0
        accum[r] = new_accum


def summed_rows(ids: torch.Tensor, grad_out: torch.Tensor) -> dict[int, torch.Tensor]:
    rows: dict[int, torch.Tensor] = {}
    for i, g in zip(ids.reshape(-1).tolist(), grad_out.reshape(-1, grad_out.shape[-1]),
                    strict=True):
        rows[i] = rows[i] + g if i in rows else g.clone()
    return rows


def two_tables():
    torch.manual_seed(0)
    return [nn.Embedding(V, D, sparse=True, dtype=DT) for _ in range(2)]


GROUPS = [{"lr": 0.05}, {"lr": 0.01, "weight_decay": 0.1}]

# ----------------------------------------------------------------------------- LazyAdam


@pytest.mark.parametrize("nesterov", [False, True])
def test_lazy_adam_matches_the_formulas_with_duplicates_steps_and_groups(nesterov):
    tables = two_tables()
    opt = LazyAdam([{"params": t.parameters(), **g} for t, g in zip(tables, GROUPS, strict=True)],
                   betas=(0.8, 0.95), eps=1e-6, use_nesterov=nesterov)
    refs = [(t.weight.detach().clone(), torch.zeros(V, D, dtype=DT), torch.zeros(V, D, dtype=DT))
            for t in tables]
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 5):
        opt.zero_grad()
        for table, (w, m, v), group in zip(tables, refs, GROUPS, strict=True):
            ids = torch.randint(0, 12, (6, 3), generator=gen)  # few rows: many duplicates
            grad_out = torch.randn(6, 3, D, generator=gen, dtype=DT)
            table(ids).backward(grad_out)
            lazy_adam_reference(w, m, v, summed_rows(ids, grad_out), step, group["lr"],
                                (0.8, 0.95), 1e-6, group.get("weight_decay", 0.0), nesterov)
        opt.step()
    for table, (w, m, v) in zip(tables, refs, strict=True):
        torch.testing.assert_close(table.weight.detach(), w)
        torch.testing.assert_close(opt.state[table.weight]["exp_avg"], m)
        torch.testing.assert_close(opt.state[table.weight]["exp_avg_sq"], v)
        assert opt.state[table.weight]["step"].item() == 4


def test_lazy_adam_leaves_untouched_rows_exactly_alone():
    table = nn.Embedding(V, D, sparse=True)
    opt = LazyAdam(table.parameters(), lr=0.1)
    before = table.weight.detach().clone()
    table(torch.tensor([2, 5, 5])).sum().backward()
    opt.step()
    changed = (table.weight.detach() != before).any(1).nonzero().flatten().tolist()
    assert changed == [2, 5]
    assert opt.state[table.weight]["exp_avg"][[0, 1, 3, 4, 6]].eq(0).all()


@pytest.mark.parametrize("make", [lambda p: LazyAdam(p), lambda p: FTRL(p)])
def test_sparse_steps_update_in_place_with_buffers_sized_by_the_touched_rows(make):
    """What lets a 10 M-row table train: no copy of the table or its state per step."""
    table = nn.Embedding(100_000, 4, sparse=True)
    opt = make(table.parameters())
    storage = table.weight.data_ptr()
    for step in range(2):
        opt.zero_grad()
        table(torch.randint(0, 100_000, (3, 8))).sum().backward()  # at most 24 rows
        opt.step()
        states = [s.data_ptr() for s in opt.state[table.weight].values() if s.dim()]
        if step == 0:
            first_states = states
    assert table.weight.data_ptr() == storage and states == first_states
    buffers = [b for held in opt._row_buffers.values() for b in held]
    assert buffers and all(b.shape[0] <= 30 for b in buffers)


def test_lazy_adam_on_dense_gradients_equals_torch_adam():
    torch.manual_seed(0)
    ours_model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    torch_model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    torch_model.load_state_dict(ours_model.state_dict())

    def groups(model):
        return [{"params": model[0].parameters(), "weight_decay": 0.1},
                {"params": model[2].parameters(), "lr": 3e-3}]

    ours = LazyAdam(groups(ours_model), lr=1e-2, betas=(0.85, 0.99))
    reference = torch.optim.Adam(groups(torch_model), lr=1e-2, betas=(0.85, 0.99))
    for _ in range(5):
        x = torch.randn(16, 6)
        for model, opt in ((ours_model, ours), (torch_model, reference)):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_uncoalesced_and_multi_sparse_dim_gradients():
    """Hand-made sparse gradients: duplicates in any order, and two sparse dims (element rows)."""
    w = torch.randn(6, 4, dtype=DT, requires_grad=True)
    opt = LazyAdam([w], lr=0.1)
    reference = (w.detach().clone(), torch.zeros(6, 4, dtype=DT), torch.zeros(6, 4, dtype=DT))
    values = torch.randn(3, 4, dtype=DT)
    w.grad = torch.sparse_coo_tensor(torch.tensor([[4, 1, 4]]), values, (6, 4),
                                     check_invariants=True)
    opt.step()
    lazy_adam_reference(*reference, {1: values[1], 4: values[0] + values[2]}, 1, 0.1,
                        (0.9, 0.999), 1e-8, 0.0, False)
    torch.testing.assert_close(w.detach(), reference[0])

    x = torch.randn(3, 4, dtype=DT, requires_grad=True)
    ftrl = FTRL([x], learning_rate=0.5)
    dense = torch.zeros(3, 4, dtype=DT)
    dense[0, 1], dense[2, 3] = 1.5, -2.0
    x.grad = dense.to_sparse()  # sparse_dim 2: every element is a row
    before = x.detach().clone()
    ftrl.step()
    touched = (x.detach() != before)
    assert touched.nonzero().tolist() == [[0, 1], [2, 3]]


# ----------------------------------------------------------------------------- FTRL


@pytest.mark.parametrize("lr_power, l1, l2", [(-0.5, 0.0, 0.0), (-0.5, 0.02, 0.1),
                                               (-0.3, 0.01, 0.0), (0.0, 0.0, 0.05)])
def test_ftrl_matches_the_formulas_with_duplicates_steps_and_groups(lr_power, l1, l2):
    tables = two_tables()
    groups = [{"learning_rate": 0.05}, {"lr": 0.2, "weight_decay": 0.05}]
    opt = FTRL([{"params": t.parameters(), **g} for t, g in zip(tables, groups, strict=True)],
               initial_accum=0.2, lr_power=lr_power, l1=l1, l2=l2)
    refs = [(t.weight.detach().clone(), torch.full((V, D), 0.2, dtype=DT),
             torch.zeros(V, D, dtype=DT)) for t in tables]
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        opt.zero_grad()
        for table, (w, a, u), lr, wd in zip(tables, refs, (0.05, 0.2), (0.0, 0.05), strict=True):
            ids = torch.randint(0, 10, (4, 4), generator=gen)
            grad_out = torch.randn(4, 4, D, generator=gen, dtype=DT)
            table(ids).backward(grad_out)
            ftrl_reference(w, a, u, summed_rows(ids, grad_out), lr, lr_power, l1, l2, wd)
        opt.step()
    for table, (w, a, u) in zip(tables, refs, strict=True):
        torch.testing.assert_close(table.weight.detach(), w)
        torch.testing.assert_close(opt.state[table.weight]["accum"], a)
        torch.testing.assert_close(opt.state[table.weight]["linear"], u)


def test_ftrl_l1_makes_touched_weights_exactly_zero():
    table = nn.Embedding(V, D, sparse=True)
    before = table.weight.detach().clone()
    opt = FTRL(table.parameters(), learning_rate=0.1, l1=100.0)
    table(torch.tensor([3, 8, 3])).sum().backward()
    opt.step()
    assert table.weight[[3, 8]].eq(0).all()  # |u| <= l1: exactly 0, not a small number
    untouched = [r for r in range(V) if r not in (3, 8)]
    assert torch.equal(table.weight[untouched], before[untouched])


def test_ftrl_on_dense_gradients_matches_the_formulas():
    torch.manual_seed(0)
    w = torch.randn(4, 3, dtype=DT, requires_grad=True)
    opt = FTRL([w], learning_rate=0.1, l1=0.05, l2=0.01)
    ref = (w.detach().clone(), torch.full((4, 3), 0.1, dtype=DT), torch.zeros(4, 3, dtype=DT))
    for _ in range(3):
        g = torch.randn(4, 3, dtype=DT)
        w.grad = g.clone()
        opt.step()
        ftrl_reference(*ref, dict(enumerate(g)), 0.1, -0.5, 0.05, 0.01, 0.0)
    torch.testing.assert_close(w.detach(), ref[0])


def test_ftrl_learning_rate_follows_a_scheduler():
    w = torch.zeros(3, requires_grad=True)
    opt = FTRL([w], learning_rate=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1 * (s + 1))
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    opt.step()  # no gradients yet: nothing moves
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


# ----------------------------------------------------------------------------- both


@pytest.mark.parametrize("make", [lambda p: LazyAdam(p, lr=0.05, weight_decay=0.01),
                                  lambda p: FTRL(p, learning_rate=0.1, l1=0.001)])
def test_state_dict_round_trip_continues_the_run_exactly(make):
    def run(table, opt, steps, seed):
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            opt.zero_grad()
            table(torch.randint(0, V, (8,), generator=gen)).pow(2).sum().backward()
            opt.step()

    torch.manual_seed(0)
    straight = nn.Embedding(V, D, sparse=True)
    resumed = nn.Embedding(V, D, sparse=True)
    resumed.load_state_dict(straight.state_dict())
    opt_straight = make(straight.parameters())
    run(straight, opt_straight, 3, seed=5)
    run(straight, opt_straight, 3, seed=6)
    first = make(resumed.parameters())
    run(resumed, first, 3, seed=5)
    saved = first.state_dict()
    second = make(resumed.parameters())
    second.load_state_dict(saved)
    run(resumed, second, 3, seed=6)
    assert torch.equal(straight.weight, resumed.weight)


def test_lazy_adam_state_dict_loads_into_torch_adam_and_back():
    """Both directions continue the run: stepping the loaded optimizer equals stepping on."""
    torch.manual_seed(0)
    w = torch.randn(4, 2, requires_grad=True)
    grads = [torch.randn(4, 2) for _ in range(4)]
    ours = LazyAdam([w], lr=0.1, betas=(0.8, 0.9), weight_decay=0.01)
    for g in grads[:2]:
        w.grad = g
        ours.step()
    theirs_w = w.detach().clone().requires_grad_()
    theirs = torch.optim.Adam([theirs_w])
    # deepcopy: load_state_dict keeps the very state tensors (same dtype and device), and the
    # three optimizers must not update one set of moments together
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))  # lr, betas, decay, moments
    back_w = w.detach().clone().requires_grad_()
    back = LazyAdam([back_w])
    back.load_state_dict(copy.deepcopy(theirs.state_dict()))  # torch's groups lack nesterov
    for g in grads[2:]:
        for p, opt in ((w, ours), (theirs_w, theirs), (back_w, back)):
            p.grad = g.clone()
            opt.step()
    assert torch.allclose(theirs_w, w, rtol=0, atol=1e-6)
    assert torch.equal(back_w, w)
    assert theirs.state[theirs_w]["step"] == ours.state[w]["step"] == 4


def test_nesterov_is_also_use_nesterov():
    w = torch.zeros(2, requires_grad=True)
    assert LazyAdam([w], nesterov=True).param_groups[0]["nesterov"] is True
    assert LazyAdam([w], use_nesterov=True).param_groups[0]["nesterov"] is True
    assert LazyAdam([{"params": [w], "use_nesterov": True}]).param_groups[0]["nesterov"] is True
    with pytest.raises(ValueError, match="not both"):
        LazyAdam([w], nesterov=False, use_nesterov=True)


def test_ftrl_arguments_after_params_are_keyword_only_and_lr_is_learning_rate():
    w = torch.zeros(2, requires_grad=True)
    with pytest.raises(TypeError, match="positional"):
        FTRL([w], 0.01)  # used to set initial_accum without saying so
    assert FTRL([w], lr=0.3).param_groups[0]["lr"] == 0.3
    assert FTRL([w], learning_rate=0.3).param_groups[0]["lr"] == 0.3
    assert FTRL([{"params": [w], "learning_rate": 0.2}]).param_groups[0]["lr"] == 0.2
    with pytest.raises(ValueError, match="not both"):
        FTRL([w], lr=0.1, learning_rate=0.2)


@pytest.mark.parametrize("sparse", [False, True])
def test_ftrl_zero_accumulator_and_zero_gradient_row_stays_finite(sparse):
    """initial_accum=0 and a row whose gradient is zero: m' = u' = 0 and the formula is 0/0;
    MindSpore's kernel (and now ours) gives the weight 0 there."""
    table = nn.Embedding(4, 3, sparse=sparse)
    opt = FTRL(table.parameters(), lr=0.1, initial_accum=0.0)
    ids = torch.tensor([0, 1, 2])
    weights = torch.tensor([[1.0], [0.0], [2.0]])  # row 1 is looked up with a zero gradient
    (table(ids) * weights).sum().backward()
    opt.step()
    assert torch.isfinite(table.weight).all(), table.weight
    assert torch.equal(table.weight[1], torch.zeros(3))
    assert (table.weight[0] != 0).all() and (table.weight[2] != 0).all()


@pytest.mark.parametrize("make, match, error", [
    (lambda p: LazyAdam(p, lr=-1.0), "invalid lr=-1.0", ValueError),
    (lambda p: LazyAdam(p, betas=(0.9, 1.0)), r"invalid betas\[1\]=1.0", ValueError),
    (lambda p: LazyAdam(p, betas=(0.9,)), "betas must be two numbers", ValueError),
    (lambda p: LazyAdam(p, eps=-1e-8), "invalid eps", ValueError),
    (lambda p: LazyAdam(p, weight_decay="0.1"), "weight_decay must be a number", TypeError),
    (lambda p: LazyAdam(p, use_nesterov=1), "nesterov must be a bool", TypeError),
    (lambda p: FTRL(p, learning_rate=0.0), r"invalid lr=0.0 \(must be > 0.0\)",
     ValueError),
    (lambda p: FTRL(p, lr_power=0.5), r"invalid lr_power=0.5 \(must be <= 0\)", ValueError),
    (lambda p: FTRL(p, initial_accum=-0.1), "invalid initial_accum", ValueError),
    (lambda p: FTRL(p, l1=-1.0), "invalid l1", ValueError),
    (lambda p: FTRL(p, l2=float("nan")), "invalid l2", ValueError),
    (lambda p: FTRL(p, weight_decay=True), "weight_decay must be a number", TypeError),
])
def test_bad_hyper_parameters_are_refused(make, match, error):
    with pytest.raises(error, match=match):
        make([torch.zeros(2, requires_grad=True)])


@pytest.mark.parametrize("make", [lambda p: LazyAdam(p), lambda p: FTRL(p)])
def test_a_bad_param_group_is_not_half_added(make):
    opt = make([torch.zeros(2, requires_grad=True)])
    with pytest.raises(ValueError, match="invalid"):
        opt.add_param_group({"params": [torch.zeros(3, requires_grad=True)], "lr": -1.0})
    assert len(opt.param_groups) == 1


def test_target_says_where_the_update_runs():
    host = [torch.zeros(2, requires_grad=True)]
    assert LazyAdam(host).target == "CPU" and FTRL(host).target == "CPU"


@pytest.mark.cuda
def test_target_and_sparse_update_on_the_gpu():
    table = nn.Embedding(V, D, sparse=True).cuda()
    opt = LazyAdam(table.parameters(), lr=0.1)
    assert opt.target == "DEVICE"
    mixed = LazyAdam([table.weight, torch.zeros(2, requires_grad=True)])
    assert mixed.target == "CPU+DEVICE"
    before = table.weight.detach().clone()
    table(torch.tensor([1, 1, 3], device="cuda")).sum().backward()
    opt.step()
    changed = (table.weight.detach() != before).any(1).nonzero().flatten().tolist()
    assert changed == [1, 3]
