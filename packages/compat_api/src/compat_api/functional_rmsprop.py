"""torch.distributed.optim.functional_rmsprop: the private name torch exports, our class."""

from functional_optim.functional import FunctionalRMSprop as _FunctionalRMSprop

__all__ = ["_FunctionalRMSprop"]
