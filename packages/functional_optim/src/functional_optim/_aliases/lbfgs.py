"""``lbfgs``: torch.optim.LBFGS as a closure-driven transform (``fo.Optimizer.step(closure)``)."""

from __future__ import annotations

import torch
from torch import Tensor

from functional_optim._algorithm import Algorithm
from functional_optim._aliases._common import scalar_lr
from functional_optim._base import GradientTransformation, OptState
from functional_optim._recipes import transform_factory
from functional_optim._transforms.hyperparams import inject_hyperparams
from functional_optim._transforms.lbfgs import LbfgsState, lbfgs_minimize
from functional_optim._tree import PyTree, tree_leaves

__all__ = ["LBFGS", "lbfgs", "scale_by_lbfgs"]

_NEEDS_CLOSURE = (
    "lbfgs re-evaluates the model several times per step: call "
    "fo.Optimizer(params, fo.lbfgs()).step(closure), or tx.step(params, closure, state)"
)


@transform_factory
def scale_by_lbfgs(
    lr: float | Tensor = 1.0,
    max_iter: int = 20,
    max_eval: int | None = None,
    tolerance_grad: float = 1e-7,
    tolerance_change: float = 1e-9,
    history_size: int = 100,
    line_search_fn: str | None = None,
) -> GradientTransformation:
    """L-BFGS as a transform whose ``step(params, closure, state)`` takes a closure in place
    of the gradients (it evaluates the model several times per step); ``update`` raises.

    Args: as :func:`lbfgs` (``max_eval`` None: ``max_iter * 5 // 4``). ``lr`` is used as it is
    given (an int, a float or a 0-d tensor), as torch uses it: the step ``t`` kept in the state
    is of its type.

    Returns:
        A ``GradientTransformation`` with state :class:`LbfgsState`.
    """
    evals = max_iter * 5 // 4 if max_eval is None else max_eval

    def init(params: PyTree) -> LbfgsState:
        del params
        return LbfgsState({})

    def update(
        updates: PyTree, state: OptState, params: PyTree = None, *, inplace: bool = False
    ) -> tuple[PyTree, OptState]:
        raise TypeError(_NEEDS_CLOSURE)

    def step(params: PyTree, grads: PyTree, state: OptState) -> OptState:
        closure = grads  # this transform's "gradients" are the closure that computes them
        if not callable(closure):
            raise TypeError(_NEEDS_CLOSURE)
        leaves = [p for p in tree_leaves(params) if isinstance(p, Tensor)]
        with torch.no_grad():
            lbfgs_minimize(
                leaves,
                closure,
                state.memory,
                lr,
                max_iter,
                evals,
                tolerance_grad,
                tolerance_change,
                history_size,
                line_search_fn,
            )
        return state

    return GradientTransformation(init, update, step)


def _build_lbfgs(
    lr: float | Tensor,
    max_iter: int,
    max_eval: int | None,
    tolerance_grad: float,
    tolerance_change: float,
    history_size: int,
    line_search_fn: str | None,
) -> GradientTransformation:
    if callable(lr):
        raise TypeError("lbfgs's lr is a fixed step scale; pass a float, not a schedule")
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not lr >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    return scale_by_lbfgs(
        scalar_lr(lr),  # torch's _to_scalar: a number or a 0-d tensor, used as it is
        max_iter,
        max_eval,
        tolerance_grad,
        tolerance_change,
        history_size,
        line_search_fn,
    )


@transform_factory
def lbfgs(
    lr: float | Tensor = 1,
    max_iter: int = 20,
    max_eval: int | None = None,
    tolerance_grad: float = 1e-7,
    tolerance_change: float = 1e-9,
    history_size: int = 100,
    line_search_fn: str | None = None,
) -> GradientTransformation:
    """L-BFGS (``torch.optim.LBFGS``), driven by a closure: ``fo.Optimizer(params,
    fo.lbfgs()).step(closure)`` runs torch's algorithm (fixed step or ``"strong_wolfe"`` line
    search) and returns the closure's first loss; ``tx.step(params, closure, state)`` does the
    same on a params pytree. There is no pure ``update`` (it raises ``TypeError``).

    Args:
        lr: step scale.
        max_iter: most iterations per step.
        max_eval: most closure calls per step (None: ``max_iter * 5 // 4``, as torch).
        tolerance_grad: stop when the largest gradient entry is this small.
        tolerance_change: stop when the loss or the params change less than this.
        history_size: curvature pairs kept.
        line_search_fn: None or ``"strong_wolfe"``.

    Returns:
        An injected ``GradientTransformation`` (hyperparameters in ``state.hyperparams``).

    Raises:
        ValueError: with torch's messages.
        TypeError: if ``lr`` is a schedule.
    """
    if max_eval is None:
        max_eval = max_iter * 5 // 4  # resolved at construction, as torch's defaults hold it
    tx = inject_hyperparams(_build_lbfgs)(
        lr=lr,
        max_iter=max_iter,
        max_eval=max_eval,
        tolerance_grad=tolerance_grad,
        tolerance_change=tolerance_change,
        history_size=history_size,
        line_search_fn=line_search_fn,
    )
    assert tx.step is not None
    tx.step.needs_closure = True  # type: ignore[attr-defined]  # read by fo.Optimizer.step
    return tx


# -- the registry entry (functional_optim._registry lists it) ------------------------------

#: The entry mirroring torch.optim.LBFGS.
LBFGS = Algorithm(
    name="lbfgs",
    torch_name="LBFGS",
    alias=lbfgs,
    transform=scale_by_lbfgs,
    state_type=LbfgsState,
    state_names={LbfgsState: {"memory": "memory"}},
    needs_closure=True,
)  # fmt: skip
