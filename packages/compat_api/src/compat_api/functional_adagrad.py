"""torch.distributed.optim.functional_adagrad: the private name torch exports, our class."""

from functional_optim.functional import FunctionalAdagrad as _FunctionalAdagrad

__all__ = ["_FunctionalAdagrad"]
