"""The torch-named aliases against torch's own optimizer database (``optim_db``, torch 2.13).

For every ``OptimizerInfo`` in ``torch.testing._internal.common_optimizers.optim_db`` whose
class has an alias here (``fo.ALGORITHMS`` by ``torch_name``; every class has one, and
:func:`test_optim_db_classes_have_aliases` fails for a new class without):

* every CPU configuration, built as torch's ``_get_optim_inputs_including_global_cliquey_kwargs``
  builds it: each of ``optim_inputs_func(device="cpu")`` with all the implementation flags the
  info declares (``supported_impls``; ``fused`` where ``supports_fused_on`` has ``"cpu"``)
  False, then with each one True. ``foreach`` is kept although torch leaves it out on CPU: its
  ``_foreach`` ops run there, and it is a path of ours. torch's optimizer and
  ``fo.Optimizer(params, fo.<alias>(**kwargs))`` run the same steps on the same params
  (float32 and float64, one param that never gets a gradient) and gradients: the outcome must
  be the same (the same error at the same time, or the same params and ``state_dict``);
* ``capturable=True`` (``has_capturable_arg``) and each pair of implementation flags on the
  default configuration: the same outcome (torch refuses most of them on CPU: ``fused`` with
  ``foreach`` or ``differentiable`` at construction, ``capturable`` and
  ``foreach`` + ``differentiable`` at step);
* every error input of ``optim_error_inputs_func(device="cpu", dtype=torch.float32)``: the same
  exception type (or warning) and message, at construction or at step as the input says.

Exactness: BITWISE, as our kernels reproduce torch's paths (``foreach``, ``fused``, the
for-loop) op for op, but for ``differentiable=True`` of Adam, AdamW and NAdam: torch's
differentiable for-loop there computes the bias corrections in (float32) tensor maths where
ours uses Python floats, so those compare within :data:`DIFFERENTIABLE_TOL`.

A tensor ``lr`` is bitwise too: where torch computes a step size from it in tensor maths (Muon,
SparseAdam), the kernels get the tensor and do the same. The ``state_dict`` is torch's layout
throughout: SparseAdam's ``step`` a Python int, LBFGS's state in its first param's entry.
There are no known differences (no xfails).
"""

from __future__ import annotations

import copy
import itertools
import re
import sys
import types
import unittest
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import Tensor

import functional_optim as fo


def _import_common_optimizers() -> types.ModuleType:
    """torch's test-only module, imported without its side effects on this process.

    ``common_utils`` imports ``expecttest`` (a torch test requirement, not a runtime one: a
    stand-in with its ``TestCase`` is used when it is not installed), freezes
    ``torch.backends`` flags and wraps TorchScript calls; both are put back afterwards.
    """
    if "expecttest" not in sys.modules:
        try:
            import expecttest  # noqa: F401
        except ImportError:
            stand_in = types.ModuleType("expecttest")
            stand_in.TestCase = unittest.TestCase  # type: ignore[attr-defined]
            stand_in.ACCEPT = False  # type: ignore[attr-defined]
            sys.modules["expecttest"] = stand_in
    frozen = torch.backends.flags_frozen()
    script_calls = (torch._C.ScriptFunction.__call__, torch._C.ScriptMethod.__call__)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.testing._internal import common_optimizers
    finally:
        if not frozen:
            vars(torch.backends)["__allow_nonbracketed_mutation_flag"] = True
        torch._C.ScriptFunction.__call__ = script_calls[0]  # type: ignore[method-assign]
        torch._C.ScriptMethod.__call__ = script_calls[1]  # type: ignore[method-assign]
    return common_optimizers


_db = _import_common_optimizers()
OPTIM_DB: list[Any] = list(_db.optim_db)
CONSTRUCTION = _db.OptimizerErrorEnum.CONSTRUCTION_ERROR
STEP = _db.OptimizerErrorEnum.STEP_ERROR

#: torch class name -> our alias.
ALIASES: dict[str, Callable[..., fo.GradientTransformation]] = {
    a.torch_name: a.alias for a in fo.ALGORITHMS if a.alias is not None
}
#: (rtol, atol) for ``differentiable=True`` of :data:`DIFFERENTIABLE_TENSOR_MATHS` (see the
#: module docstring); measured: a few float32 ulps, ~4e-10 on float64 params.
DIFFERENTIABLE_TOL = (1e-5, 1e-6)
DIFFERENTIABLE_TENSOR_MATHS = frozenset({"Adam", "AdamW", "NAdam"})
STEPS = 4


def _cpu_flags(info: Any) -> list[str]:
    """The implementation flags torch's CPU configurations cross (``foreach`` kept)."""
    return [f for f in info.supported_impls if f != "fused" or "cpu" in info.supports_fused_on]


def _key(text: str) -> str:
    return re.sub(r"[^\w.=-]+", "_", text).strip("_")


@dataclass(frozen=True)
class Case:
    """One configuration: an optim_db entry and the constructor keywords."""

    info: Any = field(compare=False)
    kwargs: dict[str, Any] = field(compare=False)
    desc: str

    @property
    def name(self) -> str:
        return self.info.name  # type: ignore[no-any-return]

    def __str__(self) -> str:
        return _key(f"{self.name}-{self.desc}")


def _mark(info: Any) -> tuple[Any, ...]:
    """Marks of a class's cases (none: every optim_db class is covered)."""
    del info
    return ()


def _config_cases() -> Iterator[Any]:
    for info in OPTIM_DB:
        flags = _cpu_flags(info)
        for optim_input in info.optim_inputs_func(device="cpu"):
            base = {**copy.deepcopy(optim_input.kwargs), **dict.fromkeys(flags, False)}
            variants = [("", base)] + [(f" & {f}", {**base, f: True}) for f in flags]
            for suffix, kwargs in variants:
                case = Case(info, kwargs, f"{optim_input.desc}{suffix}")
                yield pytest.param(case, id=str(case), marks=_mark(info))


def _flag_cases() -> Iterator[Any]:
    """capturable=True, and every pair of implementation flags, on the default configuration."""
    for info in OPTIM_DB:
        flags = list(info.supported_impls)
        extra: list[dict[str, Any]] = []
        if info.has_capturable_arg:
            extra += [{"capturable": True}] + [{"capturable": True, f: True} for f in flags]
            extra.append({"capturable": True, "foreach": False})
        extra += [{a: True, b: True} for a, b in itertools.combinations(flags, 2)]
        for kwargs in extra:
            desc = " & ".join(f"{k}={v}" for k, v in kwargs.items())
            case = Case(info, kwargs, desc)
            yield pytest.param(case, id=str(case), marks=_mark(info))


def _error_cases() -> Iterator[Any]:
    for info in OPTIM_DB:
        errors = info.optim_error_inputs_func(device="cpu", dtype=torch.float32)
        for i, error in enumerate(errors):
            when = "construction" if error.error_on == CONSTRUCTION else "step"
            desc = f"{info.name}-{i}-{when}-{error.optimizer_error_input.desc}"
            yield pytest.param(info, error, id=_key(desc), marks=_mark(info))


# --- running one configuration on both sides -------------------------------------------------


def _shapes(info: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """A few params: float32 and float64, the last never gets a gradient (Muon: 2-D only)."""
    if info.name == "Muon":
        return [((3, 4), torch.float32), ((5, 2), torch.float32), ((2, 3), torch.float64),
                ((2, 2), torch.float32)]  # fmt: skip
    return [((3, 4), torch.float32), ((5,), torch.float32), ((2, 3), torch.float64),
            ((4,), torch.float32)]  # fmt: skip


@dataclass
class Inputs:
    params: list[Tensor]
    grads: list[list[Tensor | None]]  # per step (not used by closure-driven optimizers)


def _inputs(case: Case) -> Inputs:
    gen = torch.Generator().manual_seed(zlib.crc32(str(case).encode()))
    shapes = _shapes(case.info)
    params = [torch.randn(s, dtype=d, generator=gen) for s, d in shapes]
    grads: list[list[Tensor | None]] = []
    for _ in range(STEPS):
        row: list[Tensor | None] = []
        for p in params[:-1]:
            g = torch.randn(p.shape, dtype=p.dtype, generator=gen)
            if case.info.only_supports_sparse_grads:  # SparseAdam: COO gradients, some rows
                g = (g * (torch.rand(p.shape, generator=gen) < 0.5)).to_sparse()
            row.append(g)
        grads.append([*row, None])
    return Inputs(params, grads)


def _loss(params: list[Tensor]) -> Tensor:
    """A smooth loss of all params but the last (which keeps no gradient): closure optimizers."""
    total = torch.zeros((), dtype=torch.float64)
    for i, p in enumerate(params[:-1]):
        total = total + ((p - 0.1 * i) ** 2).sum() + 0.05 * (p**4).sum() + p.sum() * p.mean()
    return total


@dataclass
class Outcome:
    """What one side did: the error and when (``"construction"``/``"step"``), or the result."""

    when: str | None = None
    error: BaseException | None = None
    params: list[Tensor] = field(default_factory=list)
    state_dict: dict[str, Any] = field(default_factory=dict)
    losses: list[Any] = field(default_factory=list)

    def describe(self) -> str:
        if self.error is None:
            return "no error"
        return f"{type(self.error).__name__} at {self.when}: {self.error}"


Resume = Callable[[list[Tensor]], Any]


def _run(
    case: Case, build: Callable[[list[Tensor], dict[str, Any]], Any], resume: Resume | None = None
) -> Outcome:
    """Construct with ``build(params, kwargs)`` and step ``STEPS`` times, recording the outcome.

    With ``resume``: half-way, ``resume(params)`` (an optimizer with default arguments) loads
    the ``state_dict`` and takes the remaining steps, as a resumed training run does."""
    inputs = _inputs(case)
    closure_driven = case.info.step_requires_closure
    params = [p.clone().requires_grad_(closure_driven) for p in inputs.params]
    kwargs = copy.deepcopy(case.kwargs)  # a tensor lr is not shared between the two sides
    try:
        opt = build(params, kwargs)
    except Exception as error:  # compared with torch's
        return Outcome("construction", error)
    losses = []
    opts = [opt]  # the closure steps the current one
    for t, row in enumerate(inputs.grads):
        if resume is not None and t == STEPS // 2:
            saved = copy.deepcopy(opt.state_dict())
            opt = resume(params)
            opt.load_state_dict(saved)
            opts.append(opt)
        try:
            if closure_driven:

                def closure() -> Tensor:
                    opts[-1].zero_grad()
                    loss = _loss(params)
                    loss.backward()
                    return loss

                losses.append(opt.step(closure))
            else:
                for p, g in zip(params, row, strict=True):
                    p.grad = None if g is None else g.clone()
                opt.step()
        except Exception as error:  # compared with torch's
            return Outcome("step", error)
    detached = [p.detach() for p in params]
    return Outcome(None, None, detached, opt.state_dict(), losses)


def _build_ours(case: Case) -> Callable[[list[Tensor], dict[str, Any]], Any]:
    alias = ALIASES[case.name]
    return lambda params, kwargs: fo.Optimizer(params, alias(**kwargs))


def _torch(case: Case) -> Outcome:
    return _run(case, lambda params, kwargs: case.info.optim_cls(params, **kwargs))


def _ours(case: Case) -> Outcome:
    return _run(case, _build_ours(case))


_RUNS: dict[str, tuple[Outcome, Outcome]] = {}


def _both(case: Case) -> tuple[Outcome, Outcome]:
    """Both sides' outcomes (cached: the params and state_dict tests share one run)."""
    key = str(case) + repr(sorted(case.kwargs.items(), key=lambda kv: kv[0]))
    if key not in _RUNS:
        _RUNS[key] = (_ours(case), _torch(case))
    return _RUNS[key]


def _tolerance(case: Case) -> tuple[float, float]:
    tensor_maths = case.name in DIFFERENTIABLE_TENSOR_MATHS
    return DIFFERENTIABLE_TOL if tensor_maths and case.kwargs.get("differentiable") else (0.0, 0.0)


def _assert_same_error(ours: Outcome, theirs: Outcome) -> None:
    assert ours.describe() == theirs.describe(), "ours vs torch's"
    assert type(ours.error) is type(theirs.error)


def _assert_close(actual: Any, expected: Any, tol: tuple[float, float], where: str) -> None:
    if isinstance(expected, Tensor):
        assert isinstance(actual, Tensor), f"{where}: {type(actual).__name__}, torch a tensor"
        assert (actual.dtype, actual.shape, actual.layout) == (
            expected.dtype,
            expected.shape,
            expected.layout,
        ), where
        a, e = actual.detach(), expected.detach()
        if a.is_sparse:
            a, e = a.to_dense(), e.to_dense()
        if tol == (0.0, 0.0):
            assert torch.equal(a, e), f"{where}: not bitwise equal (max diff {(a - e).abs().max()})"
        else:
            torch.testing.assert_close(a, e, rtol=tol[0], atol=tol[1], msg=where)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), where
        assert sorted(actual, key=str) == sorted(expected, key=str), f"{where}: keys"
        for k in expected:
            _assert_close(actual[k], expected[k], tol, f"{where}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), where
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_close(a, e, tol, f"{where}[{i}]")
    else:
        assert type(actual) is type(expected), f"{where}: {actual!r} vs torch's {expected!r}"
        assert actual == expected, f"{where}: {actual!r} vs torch's {expected!r}"


def _stepped_state(state_dict: dict[str, Any], torch_state: dict[str, Any]) -> dict[Any, Any]:
    """Our per-param state of the params torch keeps state for."""
    return {k: v for k, v in state_dict["state"].items() if k in torch_state["state"]}


# --- the tests --------------------------------------------------------------------------------


def test_optim_db_classes_have_aliases() -> None:
    """Every optim_db class has an alias."""
    classes = {info.name for info in OPTIM_DB}
    assert classes - set(ALIASES) == set()


@pytest.mark.parametrize("info", OPTIM_DB, ids=lambda info: info.name)
def test_signature_and_param_groups_are_torchs(info: Any) -> None:
    """The alias takes torch's arguments (names, kinds, defaults, order) and its param groups
    carry torch's keys and default values."""
    import inspect

    alias = ALIASES[info.name]
    theirs = inspect.signature(info.optim_cls.__init__).parameters.values()
    expected = [(p.name, p.kind, p.default) for p in theirs if p.name not in ("self", "params")]
    ours = [(p.name, p.kind, p.default) for p in inspect.signature(alias).parameters.values()]
    assert ours == expected
    p = torch.zeros(2, 3)
    torch_group = info.optim_cls([p.clone()]).param_groups[0]
    our_group = fo.Optimizer([p.clone()], alias()).param_groups[0]
    _assert_close(our_group, torch_group, (0.0, 0.0), "param_groups[0]")


@pytest.mark.parametrize("case", list(_config_cases()))
def test_config_params_match_torch(case: Case) -> None:
    ours, theirs = _both(case)
    if theirs.error is not None or ours.error is not None:
        _assert_same_error(ours, theirs)
        return
    tol = _tolerance(case)
    for i, (a, e) in enumerate(zip(ours.params, theirs.params, strict=True)):
        _assert_close(a, e, tol, f"params[{i}]")
    _assert_close(ours.losses, theirs.losses, tol, "closure losses")


@pytest.mark.parametrize("case", list(_config_cases()))
def test_config_state_dict_matches_torch(case: Case) -> None:
    """torch's ``state_dict``: the per-param state of every param torch keeps state for, and
    every param-group entry (implementation flags included)."""
    ours, theirs = _both(case)
    if theirs.error is not None or ours.error is not None:
        _assert_same_error(ours, theirs)
        return
    tol = _tolerance(case)
    expected = theirs.state_dict
    assert set(expected["state"]) <= set(ours.state_dict["state"]), "state of params"
    _assert_close(_stepped_state(ours.state_dict, expected), expected["state"], tol, "state")
    _assert_close(ours.state_dict["param_groups"], expected["param_groups"], tol, "param_groups")


def _never_stepped_cases() -> Iterator[Any]:
    for info in OPTIM_DB:
        case = Case(info, {}, "default")
        yield pytest.param(case, id=info.name, marks=_mark(info))


@pytest.mark.parametrize("case", list(_never_stepped_cases()))
def test_state_dict_has_state_for_the_same_params(case: Case) -> None:
    ours, theirs = _both(case)
    assert ours.error is None, ours.describe()
    assert theirs.error is None, theirs.describe()
    assert sorted(ours.state_dict["state"]) == sorted(theirs.state_dict["state"])


@pytest.mark.parametrize("case", list(_config_cases()))
def test_torch_resumes_from_our_state_dict(case: Case) -> None:
    """torch's class built with its defaults, loading our ``state_dict`` half-way, continues
    as it does from its own: our param groups carry every flag and hyperparameter it reads
    (``load_state_dict`` casts some state to the params' dtype, so the reference is torch
    resumed from torch's ``state_dict``, not an uninterrupted run). Where torch fails to resume
    from its own (LBFGS: the cast gives its float64 flat vectors the first param's float32,
    and its next ``dot`` raises), it fails from ours the same way."""
    ours, theirs = _both(case)
    if ours.error is not None or theirs.error is not None:  # nothing to resume: same error
        _assert_same_error(ours, theirs)
        return

    def default(params: list[Tensor]) -> Any:
        return case.info.optim_cls(params)

    from_ours = _run(case, _build_ours(case), resume=default)
    from_torch = _run(case, lambda ps, kw: case.info.optim_cls(ps, **kw), resume=default)
    if from_torch.error is not None:
        _assert_same_error(from_ours, from_torch)
        return
    assert from_ours.error is None, from_ours.describe()
    tol = _tolerance(case)  # the first half ran on each side's own path
    for i, (a, e) in enumerate(zip(from_ours.params, from_torch.params, strict=True)):
        _assert_close(a, e, tol, f"params[{i}]")
    _assert_close(from_ours.losses, from_torch.losses, tol, "closure losses")


@pytest.mark.parametrize("case", list(_flag_cases()))
def test_flag_combinations_match_torch(case: Case) -> None:
    """capturable, and two implementation flags at once: torch's error (type, message, at
    construction or step), or torch's results."""
    ours, theirs = _both(case)
    if theirs.error is not None or ours.error is not None:
        _assert_same_error(ours, theirs)
        return
    tol = _tolerance(case)
    for i, (a, e) in enumerate(zip(ours.params, theirs.params, strict=True)):
        _assert_close(a, e, tol, f"params[{i}]")


def _expect(error: Any) -> AbstractContextManager[Any]:
    if issubclass(error.error_type, Warning):
        return pytest.warns(error.error_type, match=error.error_regex)
    return pytest.raises(error.error_type, match=error.error_regex)


@pytest.mark.parametrize(("info", "error"), list(_error_cases()))
def test_error_input_matches_torch(info: Any, error: Any) -> None:
    """torch's error inputs: our alias in fo.Optimizer raises the exception (or warning) torch's
    info names, with a message matching its regex, when the info says (torch checked too)."""
    optim_input = error.optimizer_error_input
    alias = ALIASES[info.name]
    builds: list[Callable[[], Any]] = [
        lambda: fo.Optimizer(optim_input.params, alias(**copy.deepcopy(optim_input.kwargs))),
        lambda: info.optim_cls(optim_input.params, **copy.deepcopy(optim_input.kwargs)),
    ]
    for build in builds:
        if error.error_on == CONSTRUCTION:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a warning input: the warning is the error
                if issubclass(error.error_type, Warning):
                    warnings.simplefilter("always", error.error_type)
                with _expect(error):
                    build()
        else:
            assert error.error_on == STEP
            opt = build()
            with _expect(error):
                opt.step()


def _fused_cpu_cases() -> Iterator[Any]:
    for info, dtype in itertools.product(OPTIM_DB, (torch.complex64, torch.float16)):
        if "fused" in _cpu_flags(info):
            yield pytest.param(info, dtype, id=f"{info.name}-{dtype}", marks=_mark(info))


@pytest.mark.parametrize(("info", "dtype"), list(_fused_cpu_cases()))
def test_fused_refuses_what_torch_refuses(info: Any, dtype: torch.dtype) -> None:
    """``fused=True`` on params the fused kernels cannot take (complex): torch's RuntimeError at
    the first step, before anything changes; float16 is taken (the same results)."""
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(6, generator=gen).to(dtype)
    grad = torch.randn(6, generator=gen).to(dtype)
    outcomes = []
    for build in (
        lambda ps: fo.Optimizer(ps, ALIASES[info.name](fused=True)),
        lambda ps: info.optim_cls(ps, fused=True),
    ):
        p = start.clone()
        p.grad = grad.clone()
        opt = build([p])
        try:
            opt.step()
            outcomes.append(("stepped", p))
        except RuntimeError as error:
            assert torch.equal(p, start), "changed before raising"
            outcomes.append((str(error), None))
    (ours, our_p), (theirs, their_p) = outcomes
    assert ours == theirs
    if their_p is not None:
        _assert_close(our_p, their_p, (0.0, 0.0), "params")
