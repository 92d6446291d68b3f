"""The TorchScript module that runs a functional optimizer on one worker's parameters.

A scripted class instance only leaves Python when it is an attribute of a scripted module, so the
functional optimizer is wrapped in this module and the module is scripted. Its ``step`` fetches
the context's gradients and updates the parameters without the GIL.

No ``from __future__ import annotations`` here: TorchScript compiles this source.
"""

from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed.autograd as dist_autograd
from torch import Tensor, nn

__all__ = ["ScriptLocalOptimizerModule"]


class ScriptLocalOptimizerModule(nn.Module):
    """Holds the local parameters and a functional optimizer built on them.

    Args:
        optim_cls: a TorchScript-compatible functional optimizer class, called as
            ``optim_cls(params, *args, **kwargs)``; it must have ``step(gradients)``.
        params: the local parameter tensors.
        args: positional constructor arguments after ``params``.
        kwargs: keyword constructor arguments.
    """

    def __init__(
        self,
        optim_cls: Any,
        params: List[Tensor],
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
    ) -> None:
        super().__init__()
        self._local_params = params
        self.optim = optim_cls(params, *args, **kwargs)

    @torch.jit.export
    def step(self, autograd_ctx_id: int) -> None:
        """Apply the gradients of ``autograd_ctx_id``; parameters without one are skipped."""
        all_local_grads = dist_autograd.get_gradients(autograd_ctx_id)  # type: ignore[attr-defined]
        grads: List[Optional[Tensor]] = []
        for param in self._local_params:
            if param in all_local_grads:
                grads.append(all_local_grads[param])
            else:
                grads.append(None)
        self.optim.step(grads)

    @torch.jit.export
    def step_with_gradients(self, gradients: List[Optional[Tensor]]) -> None:
        """Apply explicit gradients, one (or None) per local parameter.

        (Use this rather than ``scripted.optim.step`` from Python: in torch 2.13 state that a
        functional optimizer creates in such a call does not persist to the next one.)
        """
        self.optim.step(gradients)
