"""JAX-style functional optimizers for PyTorch.

Three layers: pure kernels (:mod:`functional_optim.kernels`), an optax-like
``GradientTransformation`` API over optree pytrees, and TorchScript functional optimizers.
"""

from functional_optim import kernels
from functional_optim.functional import (
    FunctionalAdadelta,
    FunctionalAdagrad,
    FunctionalAdam,
    FunctionalAdamax,
    FunctionalAdamW,
    FunctionalRMSprop,
    FunctionalRprop,
    FunctionalSGD,
)

__all__ = [
    "FunctionalAdadelta",
    "FunctionalAdagrad",
    "FunctionalAdam",
    "FunctionalAdamW",
    "FunctionalAdamax",
    "FunctionalRMSprop",
    "FunctionalRprop",
    "FunctionalSGD",
    "kernels",
]
