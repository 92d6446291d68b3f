"""MuLoCo: DiLoCo with Muon as the inner optimizer (Muon for matrices, AdamW for the rest).

MuLoCo (Thérien et al. 2025, https://arxiv.org/abs/2505.23725) keeps DiLoCo's outer step and
replaces the inner AdamW by Muon on the 2-D weight matrices; the other parameters (biases,
norms, and here whatever ``use_muon`` rejects) keep AdamW. :class:`MuonAdamW` is that inner
optimizer, one ``torch.optim.Optimizer`` over two ``functional_optim`` optimizers
(``fo.muon``, ``fo.adamw``) whose param groups it shares, so that one LR scheduler drives both;
:func:`muloco` builds it together with its :class:`DiLoCoAverager`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

import functional_optim as fo
from compat_api.algorithms.model_averaging.diloco import DiLoCoAverager

__all__ = ["MuonAdamW", "muloco"]


def _is_matrix(param: Tensor) -> bool:
    return param.ndim == 2


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the parameters ``use_muon`` selects (default: 2-D ones), AdamW on the others.

    ``param_groups`` is the Muon group (if any) followed by the AdamW group (if any), the same
    dicts the two inner optimizers step with, so schedulers and ``group["lr"]`` edits reach
    them. ``state_dict()`` holds both inner optimizers' state dicts.

    Args:
        params: the parameters (tensors that require grad; in a fixed order).
        lr: Muon's learning rate.
        adamw_lr: AdamW's learning rate (default ``lr``).
        momentum: Muon's momentum.
        weight_decay: decoupled weight decay of both.
        betas: AdamW's betas.
        eps: AdamW's eps.
        adjust_lr_fn: Muon's ``adjust_lr_fn`` (``"match_rms_adamw"`` makes one lr fit both).
        use_muon: which parameters Muon steps (each must be 2-D).

    Raises:
        ValueError: if there are no parameters, or ``use_muon`` selects a parameter that is
            not 2-D (and the two optimizers' own checks).
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-3,
        adamw_lr: float | None = None,
        momentum: float = 0.95,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        adjust_lr_fn: str | None = "match_rms_adamw",
        use_muon: Callable[[Tensor], bool] = _is_matrix,
    ) -> None:
        params = list(params)
        if not params:
            raise ValueError("MuonAdamW got an empty parameter list")
        matrices = [p for p in params if use_muon(p)]
        flat = [p for p in params if not use_muon(p)]
        bad = [tuple(p.shape) for p in matrices if p.ndim != 2]
        if bad:
            raise ValueError(f"Muon steps 2-D parameters only; use_muon selected shapes {bad}")
        self.muon = (
            fo.Optimizer(
                matrices,
                fo.muon(
                    lr=lr,
                    weight_decay=weight_decay,
                    momentum=momentum,
                    adjust_lr_fn=adjust_lr_fn,
                ),
            )
            if matrices
            else None
        )
        self.adamw = (
            fo.Optimizer(
                flat,
                fo.adamw(
                    lr=lr if adamw_lr is None else adamw_lr,
                    betas=betas,
                    eps=eps,
                    weight_decay=weight_decay,
                ),
            )
            if flat
            else None
        )
        super().__init__(params, {"lr": lr})
        self.param_groups = [g for opt in self._inner() for g in opt.param_groups]

    def _inner(self) -> list[fo.Optimizer]:
        return [opt for opt in (self.muon, self.adamw) if opt is not None]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of both optimizers (``closure`` re-evaluates the loss first)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self._inner():
            opt.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """``{"muon": ..., "adamw": ...}``: the inner optimizers' state dicts (None if empty)."""
        return {
            "muon": None if self.muon is None else self.muon.state_dict(),
            "adamw": None if self.adamw is None else self.adamw.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        for name, opt in (("muon", self.muon), ("adamw", self.adamw)):
            if (opt is None) != (state_dict[name] is None):
                raise ValueError(f"the saved state's {name} part does not fit this optimizer")
            if opt is not None:
                opt.load_state_dict(state_dict[name])
        self.param_groups = [g for opt in self._inner() for g in opt.param_groups]


def muloco(
    params: Iterable[torch.nn.Parameter],
    *,
    period: int,
    outer: fo.GradientTransformation | None = None,
    averager_kwargs: dict[str, Any] | None = None,
    **inner_kwargs: Any,
) -> tuple[MuonAdamW, DiLoCoAverager]:
    """MuLoCo's inner optimizer and outer averager for ``params``.

    The averager copies the starting parameters (``DiLoCoAverager(params=...)``), so every
    rank must call this at the same time, on identical weights.

    Args:
        params: the model's parameters (those that require grad are optimised and averaged).
        period: inner steps between two outer syncs (``H``).
        outer: the outer optimizer (default: DiLoCo's Nesterov SGD, lr 0.7, momentum 0.9).
        averager_kwargs: further :class:`DiLoCoAverager` arguments.
        **inner_kwargs: :class:`MuonAdamW` arguments (``lr``, ``weight_decay``, ...).

    Returns:
        ``(inner_optimizer, averager)``: call ``inner_optimizer.step()`` then
        ``averager.average_parameters(params)`` every step.
    """
    selected = [p for p in params if p.requires_grad]
    inner = MuonAdamW(selected, **inner_kwargs)  # checks first: the averager communicates
    averager = DiLoCoAverager(outer, period=period, params=selected, **(averager_kwargs or {}))
    return inner, averager
