"""Every step path checks its inputs before it writes anything (issue 25, items 1, 3, 7, 8, 10).

The probe table runs each registered dense-gradient algorithm through every path (the alias's
fused ``tx.step``, ``fo.Optimizer.step``, ``fo.pure_step``, the pure ``tx.update``) with one
input wrong: a gradient, or one state tensor, of another size than its param needs. Each must
raise torch's ``RuntimeError`` and leave the params and every state tensor bitwise as they were.
Before the check (``functional_optim._step_checks``) torch's fused CPU kernels read and wrote
past the end of such buffers (garbage values, a segfault, a heap abort): a regression here may
crash the test process rather than fail it.
"""

from __future__ import annotations

import copy
import inspect
import math
import re
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import functional_optim as fo
from functional_optim._tree import NAMESPACE

from ._alias_registry import BY_NAME, REGISTRY, Entry
from ._parity import assert_states_equal, assert_tensors_equal

PATHS = ("tx.step", "fo.Optimizer.step", "pure_step", "tx.update")
#: flags that make an algorithm keep every state buffer it has (momentum, centered, amsgrad)
FULL_STATE: dict[str, dict[str, Any]] = {
    "sgd": {"momentum": 0.9},
    "rmsprop": {"momentum": 0.9, "centered": True},
    "adam": {"amsgrad": True},
    "adamw": {"amsgrad": True},
}
SIZE_ERROR = r"size of|must hold one value"
#: torch's classes that take sparse gradients
TAKES_SPARSE = ("sgd", "adagrad")
#: algorithms whose step takes gradients of another dtype than the param, as torch's
#: per-tensor path does (RMSprop not when centered: ``lerp_`` takes one dtype)
PROMOTES = ("sgd", "adagrad", "adadelta", "rmsprop", "rprop", "asgd")


def hyper(entry: Entry, **extra: Any) -> dict[str, Any]:
    return {**entry.base, **FULL_STATE.get(entry.name, {}), **extra}


def state_tensors(state: Any) -> list[Tensor]:
    """Every tensor in a transform state (counters, buffers; not its hyperparameters)."""
    if isinstance(state, fo.InjectHyperparamsState):
        state = state.inner_state
    leaves = optree.tree_leaves(state, none_is_leaf=True, namespace=NAMESPACE)
    return [x for x in leaves if isinstance(x, Tensor)]


def snapshot(params: list[Tensor], state: Any) -> list[Tensor]:
    return [t.detach().clone() for t in [*params, *state_tensors(state)]]


class Run:
    """One algorithm on one path, after a first good step (every lazy buffer exists)."""

    def __init__(self, entry: Entry, path: str, shapes: Any = None, **extra: Any) -> None:
        self.entry, self.path = entry, path
        gen = torch.Generator().manual_seed(0)
        shapes = entry.shapes[-3:] if shapes is None else shapes
        self.tx = entry.alias(**hyper(entry, **extra))
        leaf = path == "fo.Optimizer.step"
        self.params = [torch.randn(s, generator=gen).requires_grad_(leaf) for s in shapes]
        self.grads = [torch.randn(s, generator=gen) for s in shapes]
        if leaf:
            self.opt = fo.Optimizer(self.params, self.tx)
            self.set_grads()
            self.opt.step()
        else:
            first = [g.clone() for g in self.grads]
            with torch.no_grad():
                self._state = self.tx.step(self.params, first, self.tx.init(self.params))

    @property
    def state(self) -> Any:
        return self.opt.transform_states[0] if self.path == PATHS[1] else self._state

    def set_grads(self) -> None:
        """``p.grad = g`` where it is not that tensor already (a tensor corrupted in place stays:
        torch refuses to assign a gradient of another size)."""
        for p, g in zip(self.params, self.grads, strict=True):
            if p.grad is not g:
                p.grad_dtype = None  # take gradients of another dtype (the dtype table)
                p.grad = g

    def attempt(self) -> Any:
        """One more step (update) on the current grads and state."""
        with torch.no_grad():
            if self.path == "tx.step":
                return self.tx.step(self.params, self.grads, self.state)
            if self.path == "fo.Optimizer.step":
                self.set_grads()
                return self.opt.step()
            if self.path == "pure_step":
                return fo.pure_step(self.tx)(self.params, self.grads, self.state)
        return self.tx.update(self.grads, self.state, self.params)

    def targets(self) -> list[tuple[str, Tensor]]:
        """``(what, tensor)``: each gradient and each state tensor (live: corrupt in place)."""
        grads = [(f"grad {i}", g) for i, g in enumerate(self.grads)]
        return grads + [(f"state tensor {k}", t) for k, t in enumerate(state_tensors(self.state))]

    def assert_refused(
        self, error: type[Exception] = RuntimeError, match: str = SIZE_ERROR, what: str = ""
    ) -> None:
        """The next step raises ``error`` and changes no param and no state tensor."""
        before = snapshot(self.params, self.state)
        with pytest.raises(error, match=match):
            self.attempt()
        assert_tensors_equal(snapshot(self.params, self.state), before, what=what)


def wrong_sizes(t: Tensor, scalar: bool) -> list[Tensor]:
    """Tensors the step must refuse in place of ``t``: fewer, more and reshaped elements for a
    buffer; none or two for a per-param scalar (a step counter)."""
    if scalar:
        return [torch.zeros(0), torch.zeros(2)]
    n = t.numel()
    fewer = torch.zeros(n // 2) if n > 1 else torch.zeros(0)
    reshaped = t.detach().reshape(-1) if t.dim() > 1 else t.detach().reshape(1, -1)
    return [fewer, torch.zeros(n + 5), reshaped.clone()]


def _corrupt(target: Tensor, bad: Tensor) -> None:
    with torch.no_grad():
        target.set_(bad.to(target.dtype))


# --- item 1 / 8: the probe table -------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("entry", REGISTRY, ids=lambda e: e.name)
def test_probe_every_wrong_size_is_refused_before_anything_changes(entry: Entry, path: str) -> None:
    tried = 0
    for k in range(len(Run(entry, path).targets())):
        what, target = Run(entry, path).targets()[k]
        scalar = what.startswith("state") and target.dim() == 0
        for bad in wrong_sizes(target, scalar):
            run = Run(entry, path)  # fresh: each case corrupts one live tensor
            _, live = run.targets()[k]
            _corrupt(live, bad)
            run.assert_refused(what=f"{entry.name} {path} {what} -> {list(bad.shape)}")
            tried += 1
    assert tried >= 3 * 3  # three params' gradients, at least


def _param_shapes(entry: Entry) -> st.SearchStrategy[list[tuple[int, ...]]]:
    dims = st.integers(1, 4)
    if entry.name == "muon":  # torch's Muon takes matrices only
        shape = st.tuples(dims, dims)
    else:
        shape = st.lists(dims, min_size=1, max_size=3).map(tuple)
    return st.lists(shape, min_size=1, max_size=3)


@settings(max_examples=150)
@given(data=st.data())
def test_random_mismatches_raise_before_anything_changes(data: st.DataObject) -> None:
    entry = data.draw(st.sampled_from(REGISTRY), label="algorithm")
    path = data.draw(st.sampled_from(PATHS), label="path")
    shapes = data.draw(_param_shapes(entry), label="param shapes")
    run = Run(entry, path, shapes)
    targets = run.targets()
    what, target = targets[data.draw(st.integers(0, len(targets) - 1), label="target")]
    scalar = what.startswith("state") and target.dim() == 0
    bad_shape = data.draw(
        st.lists(st.integers(0, 5), max_size=3)
        .map(tuple)
        .filter(lambda s: s != tuple(target.shape) and not (scalar and math.prod(s) == 1)),
        label="wrong shape",
    )
    _corrupt(target, torch.zeros(bad_shape))
    run.assert_refused(what=f"{what} -> {bad_shape}")


def test_issue_examples() -> None:
    """The issue's three reports, verbatim."""
    p = torch.zeros(1000)
    tx = fo.adam(lr=1.0)
    st_ = tx.init([p])
    with pytest.raises(RuntimeError, match=r"Adam: the size of the gradient of param 0 \(\[10\]\)"):
        tx.step([p], [torch.ones(10)], st_)
    assert torch.equal(p, torch.zeros(1000))

    sgd = fo.sgd(lr=0.1, momentum=0.9)
    small = sgd.step([torch.zeros(16)], [torch.ones(16)], sgd.init([torch.zeros(16)]))
    big = torch.zeros(65536)
    with pytest.raises(RuntimeError, match="SGD: the size of state 'momentum_buffer'"):
        sgd.step([big], [torch.ones(65536)], small)
    assert torch.equal(big, torch.zeros(65536))

    adam_state = fo.adam(lr=0.1).init([torch.zeros(16)])
    with pytest.raises(RuntimeError, match="Adam: the size of state 'exp_avg'"):
        fo.pure_step(fo.adam(lr=0.1))([torch.zeros(65536)], [torch.ones(65536)], adam_state)


# --- item 3: sparse gradients -----------------------------------------------------------------


def _torch_error(entry: Entry, grad: Callable[[Tensor], Tensor]) -> str | None:
    """torch's message for a step on ``grad(param)`` (None when torch takes it)."""
    p = torch.randn(entry.shapes[-1]).requires_grad_()
    opt = entry.torch_cls([p], **entry.base, **entry.loop)
    p.grad = grad(p.detach())
    try:
        opt.step()
    except RuntimeError as err:
        return str(err)
    return None


DENSE_ONLY = [e for e in REGISTRY if e.name not in TAKES_SPARSE]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("entry", DENSE_ONLY, ids=lambda e: e.name)
def test_sparse_gradients_raise_torchs_error_before_anything_changes(
    entry: Entry, path: str
) -> None:
    message = _torch_error(entry, lambda p: torch.ones_like(p).to_sparse())
    assert message is not None  # torch refuses them too (ASGD included)
    assert "sparse" in message
    run = Run(entry, path)
    run.grads[-1] = run.grads[-1].to_sparse()
    run.assert_refused(match=re.escape(message))


@pytest.mark.parametrize("name", TAKES_SPARSE)
def test_sparse_gradients_still_step_where_torch_takes_them(name: str) -> None:
    entry = BY_NAME[name]
    run = Run(entry, "tx.step", shapes=[(5,), (3,)], weight_decay=0.0)
    run.grads = [g.to_sparse() for g in run.grads]
    before = [p.clone() for p in run.params]
    run.attempt()
    assert all(not torch.equal(p, b) for p, b in zip(run.params, before, strict=True))


# --- item 8: the meta device -------------------------------------------------------------------


@pytest.mark.parametrize("path", ["tx.step", "pure_step", "tx.update"])
@pytest.mark.parametrize("entry", REGISTRY, ids=lambda e: e.name)
def test_a_meta_gradient_is_refused_before_anything_changes(entry: Entry, path: str) -> None:
    run = Run(entry, path)
    run.grads[0] = torch.empty(run.grads[0].shape, device="meta")
    run.assert_refused(match="is on meta but the param is on cpu")


def test_a_step_on_meta_tensors_is_refused() -> None:
    tx = fo.adam(lr=0.1)
    params = [torch.zeros(4, device="meta")]
    state = tx.init(params)
    for step in (tx.step, fo.pure_step(tx)):
        with pytest.raises(RuntimeError, match="meta device"):
            step(params, [torch.ones(4, device="meta")], state)


# --- item 10: gradients of another dtype ------------------------------------------------------

DTYPES = (torch.float64, torch.float16, torch.bfloat16, torch.int64)


def _torch_continues(
    run: Run, extra: dict[str, Any]
) -> tuple[RuntimeError | None, list[Tensor], Any]:
    """torch's default CPU path (``foreach=False``) from ``run``'s state, one step on
    ``run.grads`` (any dtype): ``(its error, params, optimizer)``."""
    entry = run.entry
    leaves = [p.detach().clone().requires_grad_() for p in run.params]
    opt = entry.torch_cls(leaves, **hyper(entry, **extra), **entry.loop)
    opt.load_state_dict(copy.deepcopy(run.opt.state_dict()))  # else they share our buffers
    for p, g in zip(leaves, run.grads, strict=True):
        p.grad_dtype = None
        p.grad = g.clone()
    try:
        opt.step()
    except RuntimeError as err:
        return err, leaves, opt
    return None, leaves, opt


#: Kernels that take one dtype where torch's per-tensor path promotes: refused.
ONE_DTYPE_KERNELS = ("adafactor", "muon")


def _torch_is_laxer(entry: Entry, kw: dict[str, Any], dtype: torch.dtype) -> bool:
    """Where we refuse gradients torch's per-tensor path takes: our Adafactor and Muon kernels,
    and torch's coupled weight decay (``grad.add(param, alpha=wd)``), which promotes a
    lower-precision gradient to the param's dtype before the ``lerp_`` that needs one dtype
    (Adam, NAdam, RAdam, Adamax, centered RMSprop)."""
    lower = torch.promote_types(dtype, torch.float32) == torch.float32
    return entry.name in ONE_DTYPE_KERNELS or (kw.get("weight_decay", 0) != 0 and lower)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("entry", REGISTRY, ids=lambda e: e.name)
def test_gradients_of_another_dtype_step_as_torch_does_or_raise_untouched(
    entry: Entry, dtype: torch.dtype
) -> None:
    """For every flag combination: where torch's default CPU path takes the gradients, the same
    numbers; where it raises (after changing its state), a RuntimeError before anything
    changes; where we are stricter than torch (:func:`_torch_is_laxer`), the same."""
    for kw in entry.combos():
        extra = {k: v for k, v in kw.items() if k not in entry.base}
        run = Run(entry, "fo.Optimizer.step", **extra)
        gen = torch.Generator().manual_seed(3)
        run.grads = [(torch.randn(g.shape, generator=gen) * 4).to(dtype) for g in run.grads]
        error, leaves, ref = _torch_continues(run, extra)
        promotes = entry.name in PROMOTES and not hyper(entry, **extra).get("centered")
        if error is None and not promotes:
            assert _torch_is_laxer(entry, kw, dtype), f"{kw}: torch takes {dtype} gradients"
        if error is not None or not promotes:
            run.assert_refused(match="dtype", what=str(kw))
            continue
        run.attempt()
        ours = [p.detach() for p in run.params]
        assert_tensors_equal(ours, [p.detach() for p in leaves], what=f"{kw}: params")
        saved = run.opt.state_dict()["state"]
        assert_states_equal(
            [saved.get(i, {}) for i in range(len(leaves))], [ref.state[p] for p in leaves]
        )


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.int64], ids=str)
def test_fused_aliases_take_other_grad_dtypes_on_every_step_path(
    name: str, dtype: torch.dtype
) -> None:
    """The issue's report: these raised inside the fused kernel after the state changed."""
    entry = BY_NAME[name]
    for path in ("tx.step", "fo.Optimizer.step"):
        run = Run(entry, path)
        run.grads = [g.to(dtype) for g in run.grads]
        run.attempt()  # no error


# --- item 7: a 1-element tensor lr; Adafactor's lr=inf ----------------------------------------


def _outcome(entry: Entry, path: str, **extra: Any) -> list[Tensor]:
    run = Run(entry, path, **extra)
    out = run.attempt()
    if path == "pure_step":
        return [*out[0], *state_tensors(out[1])]
    if path == "tx.update":
        return [*out[0], *state_tensors(out[1])]
    return snapshot(run.params, run.state)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("entry", REGISTRY, ids=lambda e: e.name)
def test_a_one_element_tensor_lr_works_as_a_0d_one(entry: Entry, path: str) -> None:
    lr = float(entry.base.get("lr", 1e-2))
    ours = _outcome(entry, path, lr=torch.tensor([lr]))
    assert_tensors_equal(ours, _outcome(entry, path, lr=torch.tensor(lr)), what=path)


@pytest.mark.parametrize("path", PATHS)
def test_adafactor_with_an_infinite_lr_stays_finite_as_torchs(path: str) -> None:
    entry = BY_NAME["adafactor"]
    run = Run(entry, path, lr=math.inf)
    out = run.attempt()
    params = out[0] if path == "pure_step" else run.params
    if path == "tx.update":
        params = fo.apply_updates(run.params, out[0])
    assert all(torch.isfinite(p).all() for p in params)
    ref = Run(entry, "fo.Optimizer.step", lr=math.inf)  # runs the fused kernel, like torch
    ref.attempt()
    assert_tensors_equal([p.detach() for p in params], [p.detach() for p in ref.params],
                         rtol=1e-5, atol=1e-6)  # fmt: skip


# --- item 10: truthy flags, the number of betas -------------------------------------------------


def _flags(entry: Entry) -> list[str]:
    return sorted(name for name, values in entry.flags.items() if set(values) == {False, True})


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("entry", "flag"),
    [(e, f) for e in REGISTRY for f in _flags(e)],
    ids=lambda x: x if isinstance(x, str) else x.name,
)
def test_truthy_flags_act_as_true(entry: Entry, flag: str, path: str) -> None:
    """torch reads ``amsgrad="yes"`` as true; the fused kernels take bools only."""
    ours = _outcome(entry, path, **{flag: "yes"})
    assert_tensors_equal(ours, _outcome(entry, path, **{flag: True}), what=f"{flag} {path}")


BETAS = sorted(a.name for a in fo.ALGORITHMS if "betas" in inspect.signature(a.alias).parameters)


@pytest.mark.parametrize("name", BETAS)
def test_more_than_two_betas_are_refused_at_construction(name: str) -> None:
    alias = getattr(fo, name)
    with pytest.raises(ValueError, match=r"too many values to unpack \(expected 2\)"):
        alias(betas=(0.9, 0.99, 0.5))
    with pytest.raises(IndexError):  # torch's error for fewer
        alias(betas=(0.9,))


# --- item 1: user chains (``chain``'s in-place step and ``pure_step``) ------------------------

#: name -> (chain, whether ``pure_step`` fuses it): one chain per tail rule of ``_fusion``
CHAINS: dict[str, tuple[Callable[[], fo.GradientTransformation], bool]] = {
    "adamw chain": (
        lambda: fo.chain(
            fo.clip_by_global_norm(1.0),
            fo.scale_by_adam(amsgrad=True),
            fo.add_decayed_weights(0.01),
            fo.scale_by_learning_rate(0.1),
        ),
        True,
    ),
    "chain ending in an alias": (
        lambda: fo.chain(fo.clip_by_global_norm(1.0), fo.adamw(lr=0.1)),
        True,
    ),
    "lion chain": (
        lambda: fo.chain(fo.scale_by_lion(), fo.add_decayed_weights(0.01), fo.scale(-0.1)),
        False,
    ),
    "rmsprop chain": (
        lambda: fo.chain(fo.scale_by_rms(centered=True), fo.scale_by_learning_rate(0.1)),
        False,
    ),
    "adamax chain": (lambda: fo.chain(fo.scale_by_adamax(), fo.scale_by_learning_rate(0.1)), False),
    "decay chain": (
        lambda: fo.chain(fo.add_decayed_weights(0.01), fo.scale_by_learning_rate(0.1)),
        False,
    ),
}


@pytest.mark.parametrize("name", sorted(CHAINS))
def test_chains_refuse_wrong_sizes_before_anything_changes(name: str) -> None:
    build, fused = CHAINS[name]
    steps = ["tx.step", "pure_step"] if fused else ["tx.step"]
    shapes = [(7,), (4, 5)]
    for path in steps:
        for k in range(len(shapes) + len(state_tensors(_chain_run(build, shapes)[2]))):
            params, grads, state = _chain_run(build, shapes)
            live = [*grads, *state_tensors(state)]
            scalar = k >= len(grads) and live[k].dim() == 0
            for bad in wrong_sizes(live[k], scalar):
                params, grads, state = _chain_run(build, shapes)
                _corrupt([*grads, *state_tensors(state)][k], bad)
                before = snapshot(params, state)
                step = build().step if path == "tx.step" else fo.pure_step(build())
                assert step is not None
                with pytest.raises(RuntimeError, match=SIZE_ERROR):
                    step(params, grads, state)
                assert_tensors_equal(snapshot(params, state), before, what=f"{name} {path} {k}")


def _chain_run(
    build: Callable[[], fo.GradientTransformation], shapes: list[tuple[int, ...]]
) -> tuple[list[Tensor], list[Tensor], Any]:
    """Params, grads and the state after one good in-place step of ``build()``."""
    gen = torch.Generator().manual_seed(0)
    tx = build()
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    assert tx.step is not None
    state = tx.step(params, [g.clone() for g in grads], tx.init(params))
    return params, grads, state


def test_an_adam_tail_refuses_sparse_gradients_with_torchs_message() -> None:
    build = CHAINS["adamw chain"][0]
    params, grads, state = _chain_run(build, [(7,)])
    before = snapshot(params, state)
    for step in (build().step, fo.pure_step(build())):
        assert step is not None
        with pytest.raises(RuntimeError, match="Adam does not support sparse gradients"):
            step(params, [grads[0].to_sparse()], state)
    assert_tensors_equal(snapshot(params, state), before)


# --- the guarded fast path: after a streak of good steps ---------------------------------------


@pytest.fixture
def checker(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh shared checker (so each case builds its guards after exactly the streak), with
    a count of the full checks it runs."""
    from functional_optim import _fusion, _step_checks
    from functional_optim._aliases import _kernel_step

    fresh = _step_checks.StepChecker()
    fresh.full_checks = 0  # type: ignore[attr-defined]
    real = _step_checks.check_step

    def counted(*args: Any, **kwargs: Any) -> bool:
        fresh.full_checks += 1  # type: ignore[attr-defined]
        return real(*args, **kwargs)

    monkeypatch.setattr(_step_checks, "check_step", counted)
    monkeypatch.setattr(_kernel_step, "CHECKER", fresh)
    monkeypatch.setattr(_fusion, "CHECKER", fresh)
    return fresh


#: Adafactor's factored state has None entries by design (no guards: the full check each step)
UNGUARDED = ("adafactor",)


def _warm(run: Run, checker: Any) -> None:
    """Good steps until the check runs as guards: one more good step runs no full check."""
    checker._seen.clear()  # an earlier case's layout may have doubled its streak
    for _ in range(checker.STREAK + 1):
        run.attempt()
    before = checker.full_checks
    run.attempt()
    if run.entry.name not in UNGUARDED:
        assert checker.full_checks == before, "the guards did not take over"


@pytest.mark.parametrize("path", ["tx.step", "fo.Optimizer.step"])
@pytest.mark.parametrize("entry", REGISTRY, ids=lambda e: e.name)
def test_the_guards_refuse_every_wrong_size_too(entry: Entry, path: str, checker: Any) -> None:
    """Each gradient and state tensor resized in place after the guards took over."""
    for k in range(len(Run(entry, path).targets())):
        run = Run(entry, path)
        _warm(run, checker)
        what, live = run.targets()[k]
        scalar = what.startswith("state") and live.dim() == 0
        _corrupt(live, wrong_sizes(live, scalar)[0])
        before = checker.full_checks
        run.assert_refused(what=f"{entry.name} {path} {what}")
        assert checker.full_checks > before


@pytest.mark.parametrize("entry", REGISTRY, ids=lambda e: e.name)
def test_the_guards_refuse_another_dtype_sparse_and_meta(entry: Entry, checker: Any) -> None:
    for make, match in [
        (lambda g: g.to(torch.float64), "dtype"),
        (lambda g: g.to_sparse(), "sparse"),
        (lambda g: torch.empty(g.shape, device="meta"), "meta"),
    ]:
        run = Run(entry, "tx.step")
        _warm(run, checker)
        run.grads[1] = make(run.grads[1])
        promotes = entry.name in PROMOTES and not hyper(entry).get("centered")
        if (promotes and match == "dtype") or (entry.name in TAKES_SPARSE and match == "sparse"):
            run.attempt()  # taken, as torch takes it
            continue
        run.assert_refused(match=match)


def test_pure_step_guards_refuse_a_state_built_for_other_params(checker: Any) -> None:
    tx = fo.adam(lr=0.1)
    step = fo.pure_step(tx)
    params, grads = [torch.randn(64), torch.randn(8, 8)], [torch.randn(64), torch.randn(8, 8)]
    state = tx.init(params)
    for _ in range(checker.STREAK + 2):
        params, state = step(params, grads, state)
    before = checker.full_checks
    params, state = step(params, grads, state)
    assert checker.full_checks == before
    other = tx.init([torch.zeros(2), torch.zeros(8, 8)])
    with pytest.raises(RuntimeError, match=r"size of state 'exp_avg' of param 0 \(\[2\]\)"):
        step(params, grads, other)


def test_guards_that_keep_failing_are_rebuilt_ever_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lists that keep changing (same layout, other shapes) do not pay for a guard build (about
    15 full checks) at every change: the streak to rebuild doubles at each failure."""
    from functional_optim import _step_checks

    builds = []
    real = _step_checks.TensorGuards

    def counted(*args: Any, **kwargs: Any) -> Any:
        builds.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_step_checks, "TensorGuards", counted)
    checker = _step_checks.StepChecker()
    rules = _step_checks.GradRules("Test")
    first = torch.zeros(3)
    layouts = [[first, torch.zeros(4)], [first, torch.zeros(4, 1)]]
    for i in range(400):
        params = layouts[(i // 10) % 2]
        grads = [torch.zeros_like(p) for p in params]
        assert checker(rules, params, grads, [("buf", "param", grads)])
    assert 0 < len(builds) <= 3 * 7  # three lists a build; builds at streaks 8, 16, ..., 256
    assert len(builds) % 3 == 0
