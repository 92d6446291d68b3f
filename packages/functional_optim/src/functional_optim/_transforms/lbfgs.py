"""L-BFGS over the flattened params, closure-driven, as ``torch.optim.LBFGS`` runs it.

``lbfgs_minimize(params, closure, memory, ...)`` runs up to ``max_iter`` L-BFGS iterations
(two-loop recursion over the last ``history_size`` curvature pairs, a fixed step or a
strong-Wolfe line search) and returns the closure's first loss. ``memory`` is torch's state
dict of the first param (``func_evals``, ``n_iter``, ``d``, ``t``, ``old_dirs``, ``old_stps``,
``ro``, ``H_diag``, ``prev_flat_grad``, ``prev_loss``, ``al``), updated in place, so a
``state_dict`` maps onto torch's. The arithmetic follows torch's order: results are bitwise
equal. :func:`check_memory` and :func:`loaded_memory` check and take such a dict loaded from a
state dict (``functional_optim._torch_state``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from numbers import Real
from typing import Any, NamedTuple

import torch
from torch import Tensor

from functional_optim._transforms.line_search import strong_wolfe

__all__ = ["LbfgsState", "check_memory", "lbfgs_minimize", "loaded_memory"]

Closure = Callable[[], Any]


class LbfgsState(NamedTuple):
    """State of the ``lbfgs`` alias: torch's LBFGS state dict (mutated by each step)."""

    memory: dict[str, Any]


#: The memory's flat vectors over all params, the lists of them, and its counts.
_FLAT = ("d", "prev_flat_grad")
_FLAT_LISTS = ("old_dirs", "old_stps")
_COUNTS = ("func_evals", "n_iter")


def _check_flat(key: str, where: str, value: Any, numel: int) -> None:
    if not isinstance(value, Tensor):
        raise TypeError(
            f"state {key!r} of {where} is a {type(value).__name__}, not a tensor; load a state "
            "dict saved by an optimizer of this algorithm"
        )
    if value.numel() != numel:
        raise RuntimeError(
            f"the size of state {key!r} of {where} ({list(value.shape)}) must match the params' "
            f"total size ({numel}); the state dict was saved for other params: load it into an "
            "optimizer over the same params, in order"
        )


def check_memory(memory: Mapping[str, Any], params: Sequence[Any], where: str) -> None:
    """Check a loaded memory (torch's LBFGS state of the first param) against ``params``.

    Torch takes any dict and fails at a later step; this refuses, before anything is loaded,
    counts that are not numbers and flat vectors (``d``, ``prev_flat_grad``, the entries of
    ``old_dirs`` and ``old_stps``) that are not as long as the params together. Other entries
    are taken as they are.

    Raises:
        ValueError: a count is not a number.
        TypeError: a flat vector is not a tensor (or a list of them not a list).
        RuntimeError: a flat vector's size is not the params'.
    """
    for key in _COUNTS:
        value = memory.get(key, 0)
        if not isinstance(value, Real) and not (isinstance(value, Tensor) and value.numel() == 1):
            raise ValueError(
                f"state {key!r} of {where} must be a number, got {type(value).__name__} {value!r}"
            )
    numel = sum(
        2 * p.numel() if p.is_complex() else p.numel() for p in params if isinstance(p, Tensor)
    )
    for key in _FLAT:
        if memory.get(key) is not None:
            _check_flat(key, where, memory[key], numel)
    for key in _FLAT_LISTS:
        if memory.get(key) is not None:
            if not isinstance(memory[key], list):
                raise TypeError(f"state {key!r} of {where} must be a list of tensors")
            for i, item in enumerate(memory[key]):
                _check_flat(f"{key}[{i}]", where, item, numel)


def _flat_dtype(params: Sequence[Any]) -> torch.dtype | None:
    """The dtype of the params as one flat real vector (``torch.cat`` of their real views)."""
    dtypes = [p.real.dtype for p in params if isinstance(p, Tensor)]
    if not dtypes or not all(d.is_floating_point for d in dtypes):
        return None
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


def _as_flat(value: Any, dtype: torch.dtype | None, copy: bool) -> Any:
    if isinstance(value, Tensor):
        if dtype is not None and value.is_floating_point():
            return value.to(dtype, copy=copy)
        return value.clone() if copy else value
    if isinstance(value, list):
        return [_as_flat(v, dtype, copy) for v in value]
    return value


def loaded_memory(memory: Mapping[str, Any], params: Sequence[Any]) -> dict[str, Any]:
    """The memory to step on from a loaded one (checked by :func:`check_memory`).

    A new dict with new lists (a step appends to them), ``d`` and ``prev_flat_grad`` copied
    (a step writes into ``prev_flat_grad``: an optimizer that saved the dict and steps on does
    not change the one that loaded it), other tensors shared as torch's ``load_state_dict``
    shares them. The flat vectors get the params' flat dtype back: torch's ``load_state_dict``
    casts every state tensor of a param to that param's dtype, so with params of several
    dtypes (float32 first, float64 after) they arrive in the first param's dtype and torch's
    LBFGS fails at its next step (``dot``: Double and Float); cast back they take the step
    (what the cast rounded stays rounded).
    """
    dtype = _flat_dtype(params)
    out: dict[str, Any] = {}
    for key, value in memory.items():
        if key in _FLAT or key in _FLAT_LISTS:
            value = _as_flat(value, dtype, copy=key in _FLAT)
        out[key] = list(value) if isinstance(value, list) else value
    return out


class _Flat:
    """The params seen as one flat vector (complex params as their real views)."""

    def __init__(self, params: list[Tensor]) -> None:
        self.params = params
        self.numel = sum(2 * p.numel() if torch.is_complex(p) else p.numel() for p in params)

    def grad(self) -> Tensor:
        views = []
        for p in self.params:
            if p.grad is None:
                view = p.new_zeros(p.numel())
            elif p.grad.is_sparse:
                view = p.grad.to_dense().view(-1)
            else:
                view = p.grad.view(-1)
            if torch.is_complex(view):
                view = torch.view_as_real(view).view(-1)
            views.append(view)
        return torch.cat(views, 0)

    def add(self, step_size: Any, update: Tensor) -> None:
        offset = 0
        for p in self.params:
            real = torch.view_as_real(p) if torch.is_complex(p) else p
            n = real.numel()
            real.add_(update[offset : offset + n].view_as(real), alpha=step_size)
            offset += n

    def clone(self) -> list[Tensor]:
        return [p.clone(memory_format=torch.contiguous_format) for p in self.params]

    def set(self, values: list[Tensor]) -> None:
        for p, v in zip(self.params, values, strict=True):
            p.copy_(v)


def _direction(memory: dict[str, Any], flat_grad: Tensor, history_size: int) -> Tensor:
    """Update the curvature pairs with the last step and return the two-loop direction."""
    old_dirs, old_stps, ro = memory["old_dirs"], memory["old_stps"], memory["ro"]
    y = flat_grad.sub(memory["prev_flat_grad"])
    s = memory["d"].mul(memory["t"])
    ys = y.dot(s)
    if ys > 1e-10:
        if len(old_dirs) == history_size:
            old_dirs.pop(0)
            old_stps.pop(0)
            ro.pop(0)
        old_dirs.append(y)
        old_stps.append(s)
        ro.append(1.0 / ys)
        memory["H_diag"] = ys / y.dot(y)
    if "al" not in memory:
        memory["al"] = [None] * history_size
    al = memory["al"]
    q = flat_grad.neg()
    for i in range(len(old_dirs) - 1, -1, -1):
        al[i] = old_stps[i].dot(q) * ro[i]
        q.add_(old_dirs[i], alpha=-al[i])
    r = torch.mul(q, memory["H_diag"])
    for i in range(len(old_dirs)):
        be_i = old_dirs[i].dot(r) * ro[i]
        r.add_(old_stps[i], alpha=al[i] - be_i)
    return r


def lbfgs_minimize(
    params: list[Tensor],
    closure: Closure,
    memory: dict[str, Any],
    lr: float | Tensor,
    max_iter: int,
    max_eval: int,
    tolerance_grad: float,
    tolerance_change: float,
    history_size: int,
    line_search_fn: str | None,
) -> Any:
    """Run one ``torch.optim.LBFGS.step``: up to ``max_iter`` iterations on ``params``.

    Args:
        params: the params (their ``.grad`` is read after each closure call).
        closure: re-evaluates the model (gradients enabled) and returns the loss.
        memory: torch's LBFGS state dict, updated in place.
        lr, max_iter, max_eval, tolerance_grad, tolerance_change, history_size,
            line_search_fn: as ``torch.optim.LBFGS``.

    Returns:
        The loss of the first closure call.

    Raises:
        RuntimeError: for a ``line_search_fn`` other than ``"strong_wolfe"`` (torch's message).
    """
    flat = _Flat(params)

    def evaluate() -> Any:
        with torch.enable_grad():
            return closure()

    memory.setdefault("func_evals", 0)
    memory.setdefault("n_iter", 0)
    orig_loss = evaluate()
    loss = float(orig_loss)
    current_evals = 1
    memory["func_evals"] += 1
    flat_grad = flat.grad()
    if flat_grad.abs().max() <= tolerance_grad:
        return orig_loss
    n_iter = 0
    while n_iter < max_iter:
        n_iter += 1
        memory["n_iter"] += 1
        if memory["n_iter"] == 1:
            memory.update(d=flat_grad.neg(), old_dirs=[], old_stps=[], ro=[], H_diag=1)
        else:
            memory["d"] = _direction(memory, flat_grad, history_size)
        d = memory["d"]
        if memory.get("prev_flat_grad") is None:
            memory["prev_flat_grad"] = flat_grad.clone(memory_format=torch.contiguous_format)
        else:
            memory["prev_flat_grad"].copy_(flat_grad)
        prev_loss = memory["prev_loss"] = loss
        t: Any = lr
        if memory["n_iter"] == 1:
            first: Any = min(1.0, 1.0 / flat_grad.abs().sum())
            t = first * lr
        memory["t"] = t
        gtd = flat_grad.dot(d)
        if gtd > -tolerance_change:
            break
        ls_evals = 0
        opt_cond = False
        if line_search_fn is not None:
            if line_search_fn != "strong_wolfe":
                raise RuntimeError("only 'strong_wolfe' is supported")
            x_init = flat.clone()

            def directional(x: list[Tensor], step: Any, direction: Tensor) -> tuple[float, Tensor]:
                flat.add(step, direction)
                value = float(evaluate())
                grad = flat.grad()
                flat.set(x)
                return value, grad

            loss, flat_grad, t, ls_evals = strong_wolfe(
                directional, x_init, t, d, loss, flat_grad, gtd, max_ls=max_eval - current_evals
            )
            memory["t"] = t
            flat.add(t, d)
            opt_cond = bool(flat_grad.abs().max() <= tolerance_grad)
        else:
            flat.add(t, d)
            if n_iter != max_iter:
                loss = float(evaluate())
                flat_grad = flat.grad()
                opt_cond = bool(flat_grad.abs().max() <= tolerance_grad)
                ls_evals = 1
        current_evals += ls_evals
        memory["func_evals"] += ls_evals
        if n_iter == max_iter or current_evals >= max_eval or opt_cond:
            break
        if d.mul(t).abs().max() <= tolerance_change:
            break
        if abs(loss - prev_loss) < tolerance_change:
            break
    return orig_loss
