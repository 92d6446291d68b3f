"""torch.distributed.optim.functional_adadelta: the private name torch exports, our class."""

from functional_optim.functional import FunctionalAdadelta as _FunctionalAdadelta

__all__ = ["_FunctionalAdadelta"]
