"""torch.distributed.optim.functional_adamw: the private name torch exports, our class."""

from functional_optim.functional import FunctionalAdamW as _FunctionalAdamW

__all__ = ["_FunctionalAdamW"]
