"""torch.distributed.optim.functional_adamax: the private name torch exports, our class."""

from functional_optim.functional import FunctionalAdamax as _FunctionalAdamax

__all__ = ["_FunctionalAdamax"]
