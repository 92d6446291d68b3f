"""torch.distributed.optim.functional_rprop: the private name torch exports, our class."""

from functional_optim.functional import FunctionalRprop as _FunctionalRprop

__all__ = ["_FunctionalRprop"]
