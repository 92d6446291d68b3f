"""torch.distributed.optim.functional_adam: the private name torch exports, our class."""

from functional_optim.functional import FunctionalAdam as _FunctionalAdam

__all__ = ["_FunctionalAdam"]
