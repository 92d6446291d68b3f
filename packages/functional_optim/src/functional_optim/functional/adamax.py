"""FunctionalAdamax: a TorchScript-compilable Adamax that takes gradients explicitly.

Placeholder fixed by the workspace skeleton; the implementation replaces it.
"""


class FunctionalAdamax:
    """Adamax: explicit gradients, like torch.distributed.optim._FunctionalAdamax."""

    def __init__(self) -> None:
        raise NotImplementedError("FunctionalAdamax not implemented yet")
