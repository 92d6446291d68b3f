"""The built-in entry of the quasi-Newton family: L-BFGS (closure-driven, no kernel)."""

from __future__ import annotations

from functional_optim._algorithm import Algorithm
from functional_optim._aliases.lbfgs import lbfgs, scale_by_lbfgs
from functional_optim._transforms.lbfgs import LbfgsState

__all__ = ["LBFGS"]

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
