"""FunctionalMuon: a TorchScript-compilable Muon over explicit gradients (torch has no
``_FunctionalMuon``; this follows the pattern of its eight with ``torch.optim.Muon``'s
arguments, defaults, messages and state)."""

from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor

from functional_optim.functional._local_shards import refuse_sharded
from functional_optim.functional._scripting import prepare_class
from functional_optim.functional._state import check_lengths, gather, make_param_group
from functional_optim.kernels.muon import muon_single


class FunctionalMuon:
    """Muon over explicit gradients (``torch.optim.Muon``'s arguments and state), 2-D params
    only; bitwise equal to ``torch.optim.Muon``.

    Args:
        params: the 2-D parameters to optimize (one group).
        lr: learning rate.
        weight_decay: decoupled weight decay.
        momentum: momentum factor.
        nesterov: orthogonalise the Nesterov look-ahead.
        ns_coefficients: ``(a, b, c)`` of the Newton-Schulz iteration.
        eps: floor of the normalising norm.
        ns_steps: Newton-Schulz iterations.
        adjust_lr_fn: ``None``/``"original"`` or ``"match_rms_adamw"``.
        _allow_empty_param_list: accept an empty ``params``.

    Raises:
        ValueError: for an invalid hyperparameter, a param that is not 2-D or an empty
            ``params`` (torch's messages).
    """

    def __init__(
        self,
        params: List[Tensor],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: Optional[str] = None,
        _allow_empty_param_list: bool = False,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not momentum >= 0.0:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if adjust_lr_fn is not None:  # noqa: SIM102 (TorchScript refines Optional[str] here)
            if adjust_lr_fn != "original" and adjust_lr_fn != "match_rms_adamw":
                raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        for p in params:
            if p.dim() != 2:
                raise ValueError(
                    "Muon only supports 2D parameters whereas we found a parameter with size: "
                    + str(p.size())
                )
        self.defaults: Dict[str, float] = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "eps": eps,
        }
        self.nesterov = nesterov
        self.ns_coefficients = ns_coefficients
        self.ns_steps = ns_steps
        self.adjust_lr_fn = adjust_lr_fn
        self.state: Dict[Tensor, Dict[str, Tensor]] = {}
        self.param_group = make_param_group(params, _allow_empty_param_list)

    @staticmethod
    def __prepare_scriptable__() -> type:
        """Hook for ``torch.jit.script``: compile with names resolved in this module."""
        return prepare_class(FunctionalMuon)

    def step(self, gradients: List[Optional[Tensor]]) -> None:
        """Update every parameter whose gradient is not None.

        Raises:
            ValueError: if ``gradients`` and the params differ in length.
        """
        params = self.param_group["params"]
        check_lengths(params, gradients)
        if not torch.jit.is_scripting():  # type: ignore[attr-defined]
            refuse_sharded(params, "Muon")
        params_with_grad, grads, buffers, _ = gather(
            self.state, params, gradients, ["momentum_buffer"], [0.0], False, False
        )
        d = self.defaults
        with torch.no_grad():
            muon_single(
                params_with_grad,
                grads,
                buffers[0],
                d["lr"],
                d["weight_decay"],
                d["momentum"],
                self.nesterov,
                self.ns_coefficients,
                self.ns_steps,
                d["eps"],
                self.adjust_lr_fn,
            )
