"""torch's state layouts that are not one tensor per param, and a tensor ``lr`` in tensor maths.

* LBFGS: ``state_dict()`` keeps the whole state in the first param's entry (torch's keys and
  types: ``func_evals``/``n_iter`` ints, ``t`` of ``lr``'s type, ...), no ``fo_state``; torch
  resumes from ours, ours from torch's and ours from ours, bitwise. With params of several
  dtypes torch's ``load_state_dict`` casts the flat vectors to the first param's dtype and
  torch's LBFGS fails at its next step; ours casts them back and steps on.
* SparseAdam: ``step`` is a Python int (loaded from an int or a tensor).
* Muon and SparseAdam with a tensor ``lr``: torch computes the step size (and Muon's
  ``1 - lr * weight_decay``) in the tensor's dtype; ours too, bitwise, also through
  ``torch.jit.script``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import functional_optim as fo
from functional_optim import kernels

from ._parity import assert_tensors_equal

# --- LBFGS -----------------------------------------------------------------------------------


def _lbfgs_params(dtypes: tuple[torch.dtype, ...] = (torch.float64,) * 3) -> list[Tensor]:
    gen = torch.Generator().manual_seed(5)
    shapes = [(3, 2), (4,), (2, 2)][: len(dtypes)]
    return [
        torch.randn(s, generator=gen, dtype=torch.float64).to(d).requires_grad_()
        for s, d in zip(shapes, dtypes, strict=True)
    ]


def _closure(params: list[Tensor], opts: list[Any]) -> Callable[[], Tensor]:
    """A smooth loss of all params but the last (it never gets a gradient)."""

    def closure() -> Tensor:
        opts[-1].zero_grad()
        loss = torch.zeros((), dtype=torch.float64)
        for i, p in enumerate(params[:-1]):
            loss = loss + ((p - 0.1 * i) ** 2).sum() + 0.05 * (p**4).sum() + p.sum() * p.mean()
        loss.backward()
        return loss

    return closure


LBFGS_CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "lr 0.5, history 2": {"lr": 0.5, "history_size": 2, "max_iter": 6},
    "tensor lr": {"lr": torch.tensor(0.8)},
    "strong_wolfe": {"line_search_fn": "strong_wolfe", "history_size": 3},
    "converged": {"tolerance_grad": 1e3},  # stops at the first gradient: func_evals, n_iter
}


def _torch_lbfgs(params: list[Tensor], **kw: Any) -> torch.optim.Optimizer:
    return torch.optim.LBFGS(params, **copy.deepcopy(kw))


def _our_lbfgs(params: list[Tensor], **kw: Any) -> fo.Optimizer:
    return fo.Optimizer(params, fo.lbfgs(**copy.deepcopy(kw)))


def _run_lbfgs(
    build: Callable[..., Any],
    kw: dict[str, Any],
    steps: int = 4,
    resume: Callable[..., Any] | None = None,
    dtypes: tuple[torch.dtype, ...] = (torch.float64,) * 3,
) -> tuple[list[Tensor], list[Any], Any]:
    """``steps`` steps; with ``resume``, half-way a new optimizer loads the (deep-copied)
    state dict and steps on. Returns the params, the losses and the last optimizer."""
    params = _lbfgs_params(dtypes)
    opts = [build(params, **kw)]
    losses = []
    for t in range(steps):
        if resume is not None and t == steps // 2:
            saved = copy.deepcopy(opts[-1].state_dict())
            opts.append(resume(params, **kw))
            opts[-1].load_state_dict(saved)
        losses.append(opts[-1].step(_closure(params, opts)))
    return [p.detach() for p in params], losses, opts[-1]


def _same(actual: Any, expected: Any, where: str) -> None:
    """Equal values of the same types (tensors bitwise, with dtype and shape)."""
    assert type(actual) is type(expected), f"{where}: {actual!r} vs torch's {expected!r}"
    if isinstance(expected, Tensor):
        assert_tensors_equal([actual], [expected], what=where)
    elif isinstance(expected, dict):
        assert sorted(actual) == sorted(expected), f"{where}: keys"
        for k in expected:
            _same(actual[k], expected[k], f"{where}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} vs torch's {expected!r}"


@pytest.mark.parametrize("kw", LBFGS_CONFIGS.values(), ids=LBFGS_CONFIGS.keys())
def test_lbfgs_state_dict_is_torchs(kw: dict[str, Any]) -> None:
    ours, our_losses, our_opt = _run_lbfgs(_our_lbfgs, kw)
    theirs, their_losses, their_opt = _run_lbfgs(_torch_lbfgs, kw)
    assert_tensors_equal(ours, theirs, what="params")
    _same(our_losses, their_losses, "losses")
    got, expected = our_opt.state_dict(), their_opt.state_dict()
    assert list(got["state"]) == list(expected["state"]) == [0]
    _same(got["state"], expected["state"], "state")
    _same(got["param_groups"], expected["param_groups"], "param_groups")  # no fo_state
    _same(dict(our_opt.state[our_opt.param_groups[0]["params"][0]]), expected["state"][0], "live")


def test_lbfgs_never_stepped_has_no_state() -> None:
    opt = _our_lbfgs(_lbfgs_params())
    assert opt.state_dict()["state"] == {}
    assert "fo_state" not in opt.state_dict()["param_groups"][0]


@pytest.mark.parametrize("kw", LBFGS_CONFIGS.values(), ids=LBFGS_CONFIGS.keys())
@pytest.mark.parametrize(
    ("first", "then"),
    [(_our_lbfgs, _torch_lbfgs), (_torch_lbfgs, _our_lbfgs), (_our_lbfgs, _our_lbfgs)],
    ids=["torch from ours", "ours from torch's", "ours from ours"],
)
def test_lbfgs_resumes_bitwise(
    kw: dict[str, Any], first: Callable[..., Any], then: Callable[..., Any]
) -> None:
    """Same-dtype params: ``load_state_dict`` casts nothing, so a resumed run is the
    uninterrupted one (torch's own run), bit for bit, and keeps torch's state."""
    expected, expected_losses, their_opt = _run_lbfgs(_torch_lbfgs, kw)
    got, losses, opt = _run_lbfgs(first, kw, resume=then)
    assert_tensors_equal(got, expected, what="params")
    _same(losses, expected_losses, "losses")
    _same(opt.state_dict()["state"], their_opt.state_dict()["state"], "state")


def test_lbfgs_saved_state_is_not_shared_with_the_loader() -> None:
    """An optimizer that saved its state and steps on does not change one that loaded it
    (torch's LBFGS writes into ``prev_flat_grad``; the load copies it)."""
    params = _lbfgs_params()
    opt = _our_lbfgs(params)
    opt.step(_closure(params, [opt]))
    saved = opt.state_dict()  # not copied
    again = [p.detach().clone().requires_grad_() for p in params]
    other = _our_lbfgs(again)
    other.load_state_dict(saved)
    for _ in range(2):
        opt.step(_closure(params, [opt]))
        other.step(_closure(again, [other]))
    assert_tensors_equal([p.detach() for p in again], [p.detach() for p in params])


def test_lbfgs_with_params_of_two_dtypes_resumes_where_torch_cannot() -> None:
    dtypes = (torch.float32, torch.float64, torch.float32)
    with pytest.raises(RuntimeError, match="same dtype") as theirs:
        _run_lbfgs(_torch_lbfgs, {}, dtypes=dtypes, resume=_torch_lbfgs)
    with pytest.raises(RuntimeError) as from_ours:
        _run_lbfgs(_our_lbfgs, {}, dtypes=dtypes, resume=_torch_lbfgs)
    assert str(from_ours.value) == str(theirs.value)
    # ours casts the flat vectors back (the float32 cast lost bits: close, not bitwise)
    got, _, opt = _run_lbfgs(_our_lbfgs, {}, dtypes=dtypes, resume=_our_lbfgs)
    expected, _, _ = _run_lbfgs(_our_lbfgs, {}, dtypes=dtypes)
    assert_tensors_equal(got, expected, rtol=1e-4, atol=1e-5, what="params")
    assert opt.state_dict()["state"][0]["d"].dtype == torch.float64


def _mutated(saved: dict[str, Any], **entries: Any) -> dict[str, Any]:
    out = copy.deepcopy(saved)
    out["state"][0].update(entries)
    return out


BAD_LBFGS: dict[str, tuple[dict[str, Any], type[Exception], str]] = {
    "d resized": ({"d": torch.zeros(3, dtype=torch.float64)}, RuntimeError, "size of state 'd'"),
    "prev_flat_grad a list": ({"prev_flat_grad": [0.0] * 10}, TypeError, "not a tensor"),
    "old_dirs entry resized": ({"old_dirs": [torch.zeros(2)]}, RuntimeError, "old_dirs"),
    "old_stps a tensor": ({"old_stps": torch.zeros(10)}, TypeError, "list of tensors"),
    "n_iter 'abc'": ({"n_iter": "abc"}, ValueError, "must be a number"),
}


@pytest.mark.parametrize("bad", BAD_LBFGS.values(), ids=BAD_LBFGS.keys())
def test_a_bad_lbfgs_state_is_refused_before_anything_changes(
    bad: tuple[dict[str, Any], type[Exception], str],
) -> None:
    entries, error, match = bad
    params = _lbfgs_params()
    opt = _our_lbfgs(params, history_size=3)
    for _ in range(2):
        opt.step(_closure(params, [opt]))
    good = copy.deepcopy(opt.state_dict())
    with pytest.raises(error, match=match):
        opt.load_state_dict(_mutated(good, **entries))
    _same(opt.state_dict(), good, "unchanged")
    opt.step(_closure(params, [opt]))  # and it still steps


def test_foreign_first_param_state_of_the_right_sizes_loads() -> None:
    """torch takes whatever the first param's dict holds; so do we (no entry is required)."""
    params = _lbfgs_params()
    opt = _our_lbfgs(params)
    opt.load_state_dict(
        {"state": {0: {"n_iter": 0}}, "param_groups": opt.state_dict()["param_groups"]}
    )
    opt.step(_closure(params, [opt]))
    assert opt.state_dict()["state"][0]["n_iter"] >= 1


# --- SparseAdam's step -----------------------------------------------------------------------


def _sparse_run(build: Callable[[list[Tensor]], Any], steps: int = 3) -> tuple[list[Tensor], Any]:
    gen = torch.Generator().manual_seed(3)
    params = [torch.randn(4, 3, generator=gen, dtype=torch.float64) for _ in range(2)]
    leaves = [p.clone().requires_grad_() for p in params]
    opt = build(leaves)
    for _ in range(steps):
        for p in leaves:
            g = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.grad = (g * (torch.rand(p.shape, generator=gen) < 0.5)).to_sparse()
        opt.step()
    return [p.detach() for p in leaves], opt


def test_sparse_adam_step_is_an_int_and_loads_from_either() -> None:
    ours, opt = _sparse_run(lambda ps: fo.Optimizer(ps, fo.sparse_adam(lr=0.01)))
    theirs, ref = _sparse_run(lambda ps: torch.optim.SparseAdam(ps, lr=0.01))
    assert_tensors_equal(ours, theirs)
    _same(opt.state_dict()["state"], ref.state_dict()["state"], "state")
    assert opt.state_dict()["state"][0]["step"] == 3
    as_tensor = copy.deepcopy(opt.state_dict())
    as_tensor["state"][0]["step"] = torch.tensor(7.0)
    opt.load_state_dict(as_tensor)
    step = opt.state_dict()["state"][0]["step"]
    assert type(step) is int
    assert step == 7


# --- a tensor lr (Muon, SparseAdam) ----------------------------------------------------------


def _dense_run(
    build: Callable[[list[Tensor]], Any], dtype: torch.dtype, lr: Tensor, sparse: bool
) -> list[Tensor]:
    gen = torch.Generator().manual_seed(11)
    params = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in [(3, 4), (5, 2)]]
    opt = build(params)
    for t in range(3):
        if t == 2:
            with torch.no_grad():
                lr.mul_(0.5)  # read each step, as torch reads it
        for p in params:
            g = torch.randn(p.shape, generator=gen).to(dtype)
            p.grad = (g * (torch.rand(p.shape, generator=gen) < 0.5)).to_sparse() if sparse else g
        opt.step()
    return [p.detach() for p in params]


TENSOR_LRS = {
    "float32 0-d": lambda: torch.tensor(0.013),
    "float32 1-element": lambda: torch.tensor([0.013]),
    "float64 0-d": lambda: torch.tensor(0.013, dtype=torch.float64),
}
LR_DTYPES = [torch.float64, torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", LR_DTYPES, ids=str)
@pytest.mark.parametrize("make_lr", TENSOR_LRS.values(), ids=TENSOR_LRS.keys())
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_muon_tensor_lr_bitwise_equal_to_torch(
    dtype: torch.dtype, make_lr: Callable[[], Tensor], adjust_lr_fn: str | None
) -> None:
    kw = {"weight_decay": 0.3, "adjust_lr_fn": adjust_lr_fn}
    lr_ours, lr_theirs = make_lr(), make_lr()
    ours = _dense_run(lambda ps: fo.Optimizer(ps, fo.muon(lr=lr_ours, **kw)), dtype, lr_ours, False)
    theirs = _dense_run(
        lambda ps: torch.optim.Muon(ps, lr=lr_theirs, **kw), dtype, lr_theirs, False
    )
    assert_tensors_equal(ours, theirs)


@pytest.mark.parametrize("dtype", LR_DTYPES, ids=str)
@pytest.mark.parametrize("make_lr", TENSOR_LRS.values(), ids=TENSOR_LRS.keys())
def test_sparse_adam_tensor_lr_bitwise_equal_to_torch(
    dtype: torch.dtype, make_lr: Callable[[], Tensor]
) -> None:
    lr_ours, lr_theirs = make_lr(), make_lr()
    ours = _dense_run(lambda ps: fo.Optimizer(ps, fo.sparse_adam(lr=lr_ours)), dtype, lr_ours, True)
    theirs = _dense_run(lambda ps: torch.optim.SparseAdam(ps, lr=lr_theirs), dtype, lr_theirs, True)
    assert_tensors_equal(ours, theirs)


def test_float_lr_still_float_maths() -> None:
    """A float lr of the value of a float32 tensor lr gives another result on float64 params
    (the point of the tensor path), and torch's float result."""
    lr = torch.tensor(0.013)
    by_tensor = _dense_run(lambda ps: fo.Optimizer(ps, fo.muon(lr=lr)), torch.float64, lr, False)
    box = torch.tensor(0.013, dtype=torch.float64)  # a float lr, halved at the same step

    def as_float(ps: list[Tensor]) -> Any:
        return fo.Optimizer(ps, fo.muon(lr=0.013))

    by_float = _dense_run(as_float, torch.float64, box, False)
    reference = _dense_run(lambda ps: torch.optim.Muon(ps, lr=0.013), torch.float64, box, False)
    assert_tensors_equal(by_float, reference)
    assert not all(torch.equal(a, b) for a, b in zip(by_tensor, by_float, strict=True))


def _scripted(fn: Any) -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`torch.jit.script` is deprecated")
        return torch.jit.script(fn)


@pytest.mark.parametrize("lr", [0.02, torch.tensor(0.02)], ids=["float", "tensor"])
def test_scripted_kernels_take_a_float_or_a_tensor_lr(lr: float | Tensor) -> None:
    gen = torch.Generator().manual_seed(4)
    params = [torch.randn(3, 4, generator=gen, dtype=torch.float64)]
    grads = [torch.randn(3, 4, generator=gen, dtype=torch.float64)]
    runs = []
    for muon in (kernels.muon_single, _scripted(kernels.muon_single)):
        ps, bufs = [p.clone() for p in params], [torch.zeros_like(p) for p in params]
        muon(ps, grads, bufs, lr, 0.1, 0.9, True, (3.4445, -4.775, 2.0315), 5, 1e-7, None)
        runs.append(ps)
    assert_tensors_equal(runs[1], runs[0], what="muon_single scripted")
    sparse = [g.to_sparse() for g in grads]
    runs = []
    for adam in (kernels.sparse_adam, _scripted(kernels.sparse_adam)):
        ps = [p.clone() for p in params]
        state = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
        adam(ps, sparse, *state, [torch.zeros(())], 1e-8, 0.9, 0.999, lr, False)
        runs.append(ps)
    assert_tensors_equal(runs[1], runs[0], what="sparse_adam scripted")
