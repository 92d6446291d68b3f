"""torch.distributed.optim.functional_sgd: the private name torch exports, our class."""

from functional_optim.functional import FunctionalSGD as _FunctionalSGD

__all__ = ["_FunctionalSGD"]
