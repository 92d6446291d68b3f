"""FunctionalAdadelta: a TorchScript-compilable Adadelta that takes gradients explicitly.

Placeholder fixed by the workspace skeleton; the implementation replaces it.
"""


class FunctionalAdadelta:
    """Adadelta: explicit gradients, like torch.distributed.optim._FunctionalAdadelta."""

    def __init__(self) -> None:
        raise NotImplementedError("FunctionalAdadelta not implemented yet")
