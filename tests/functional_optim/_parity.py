"""Shared parity helpers: run ``torch.optim`` on fixed inputs and compare our results with it.

Stable API (other test modules import these; keep it small):

``SHAPES``
    Default parameter shapes: a 0-d tensor, an empty tensor, a vector, a matrix, a 3-d tensor.
``FLOAT_DTYPES``
    ``(torch.float32, torch.float64)``.
``make_params(shapes=SHAPES, dtype=torch.float32, seed=0) -> list[Tensor]``
    Detached random params (``randn``), deterministic for a seed.
``make_grads(params, steps, seed=1, none_every=0) -> list[list[Tensor | None]]``
    ``grads[step][i]`` shaped like ``params[i]``; with ``none_every=k > 0`` the grad of param
    ``i`` is None on steps where ``(step + i) % k == 0`` (to test skipped params).
``clone_tensors(tensors) -> list[Tensor | None]``
    Detached clones (None kept), so each side of a comparison starts from equal, unshared inputs.
``run_torch(optim_cls, params, grads, **hyper) -> TorchRun``
    Clones ``params`` into leaves, then for each step sets ``.grad`` from ``grads[step]`` and calls
    ``optimizer.step()``. Returns ``TorchRun(params, states, optimizer)`` where ``states[i]`` is
    ``optimizer.state[params[i]]`` as a plain dict (empty when the param never had a grad).
``assert_tensors_equal(actual, expected, rtol=0.0, atol=0.0, what="")``
    Compares two lists (None allowed, must match). ``rtol == atol == 0`` means BITWISE: values via
    ``torch.equal`` (NaNs at the same places count as equal) plus dtype and shape; otherwise
    ``torch.testing.assert_close`` with the given tolerances.
``assert_states_equal(actual, expected, rtol=0.0, atol=0.0, keys=None)``
    Compares two lists of per-param state dicts (same keys unless ``keys`` names the ones to
    compare); tensors as in ``assert_tensors_equal``.
``tolerance(dtype) -> tuple[float, float]``
    Documented float tolerance ``(rtol, atol)`` for results that match torch up to rounding
    (different but equivalent op order): float32 ``(1e-6, 1e-7)``... widened slightly per step
    count by callers if needed; float64 ``(1e-13, 1e-15)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

SHAPES: tuple[tuple[int, ...], ...] = ((), (0,), (7,), (4, 5), (2, 3, 4))
FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64)


class TorchRun(NamedTuple):
    """Result of :func:`run_torch`: final params, per-param state dicts, and the optimizer."""

    params: list[Tensor]
    states: list[dict[str, Any]]
    optimizer: torch.optim.Optimizer


def make_params(
    shapes: Sequence[tuple[int, ...]] = SHAPES, dtype: torch.dtype = torch.float32, seed: int = 0
) -> list[Tensor]:
    """Return detached random params (one per shape), deterministic for ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]


def make_grads(
    params: Sequence[Tensor], steps: int, seed: int = 1, none_every: int = 0
) -> list[list[Tensor | None]]:
    """Return ``grads[step][i]`` shaped like ``params[i]``; some None when ``none_every > 0``."""
    gen = torch.Generator().manual_seed(seed)
    out: list[list[Tensor | None]] = []
    for step in range(steps):
        row: list[Tensor | None] = []
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            row.append(None if none_every > 0 and (step + i) % none_every == 0 else g)
        out.append(row)
    return out


def clone_tensors(tensors: Sequence[Tensor | None]) -> list[Tensor | None]:
    """Return detached clones of ``tensors`` (None entries kept)."""
    return [None if t is None else t.detach().clone() for t in tensors]


def run_torch(
    optim_cls: type[torch.optim.Optimizer],
    params: Sequence[Tensor],
    grads: Sequence[Sequence[Tensor | None]],
    **hyper: Any,
) -> TorchRun:
    """Run ``optim_cls(clones of params, **hyper)`` for ``len(grads)`` steps on the given grads."""
    leaves = [p.detach().clone().requires_grad_(True) for p in params]
    opt = optim_cls(leaves, **hyper)
    for row in grads:
        for leaf, g in zip(leaves, row, strict=True):
            leaf.grad = None if g is None else g.detach().clone()
        opt.step()
    states = [dict(opt.state[p]) if p in opt.state else {} for p in leaves]
    return TorchRun([p.detach() for p in leaves], states, opt)


def _bitwise_equal(a: Tensor, b: Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() or a.is_complex():
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        if not torch.equal(nan_a, nan_b):
            return False
        return torch.equal(torch.where(nan_a, torch.zeros_like(a), a), b.masked_fill(nan_b, 0))
    return torch.equal(a, b)


def assert_tensors_equal(
    actual: Sequence[Tensor | None],
    expected: Sequence[Tensor | None],
    rtol: float = 0.0,
    atol: float = 0.0,
    what: str = "",
) -> None:
    """Assert two tensor lists match: bitwise when ``rtol == atol == 0``, else within tolerance."""
    assert len(actual) == len(expected), f"{what}: length {len(actual)} != {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if a is None or e is None:
            assert (a is None) == (e is None), f"{what}[{i}]: {a!r} vs {e!r}"
            continue
        if rtol == 0.0 and atol == 0.0:
            if not _bitwise_equal(a.detach().cpu(), e.detach().cpu()):
                diff = (a.detach().cpu().double() - e.detach().cpu().double()).abs()
                worst = diff.max().item() if diff.numel() else 0.0
                raise AssertionError(
                    f"{what}[{i}] not bitwise equal: dtype {a.dtype}/{e.dtype}, "
                    f"shape {tuple(a.shape)}/{tuple(e.shape)}, max abs diff {worst}"
                )
        else:
            try:
                torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True)
            except AssertionError as err:
                raise AssertionError(f"{what}[{i}]: {err}") from None


def assert_states_equal(
    actual: Sequence[dict[str, Any]],
    expected: Sequence[dict[str, Any]],
    rtol: float = 0.0,
    atol: float = 0.0,
    keys: Sequence[str] | None = None,
) -> None:
    """Assert two lists of per-param state dicts match (see :func:`assert_tensors_equal`)."""
    assert len(actual) == len(expected), f"state length {len(actual)} != {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if keys is None:
            assert sorted(a) == sorted(e), f"state[{i}] keys {sorted(a)} != {sorted(e)}"
            names: Sequence[str] = sorted(e)
        else:
            names = [k for k in keys if k in e]
            assert all(k in a for k in names), f"state[{i}] lacks some of {names}: {sorted(a)}"
        for k in names:
            av, ev = a[k], e[k]
            if isinstance(ev, Tensor) and isinstance(av, Tensor):
                if k == "step":
                    # torch keeps float steps; compare the value, not the dtype/device choice.
                    assert float(av) == float(ev), f"state[{i}]['step']: {av} vs {ev}"
                    continue
                assert_tensors_equal([av], [ev], rtol, atol, what=f"state[{i}][{k!r}]")
            else:
                assert av == ev, f"state[{i}][{k!r}]: {av!r} vs {ev!r}"


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """Return ``(rtol, atol)`` for results equal to torch's up to rounding of a reordered sum."""
    if dtype == torch.float64:
        return 1e-13, 1e-15
    return 1e-6, 1e-7
