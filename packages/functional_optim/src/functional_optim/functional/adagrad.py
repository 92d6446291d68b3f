"""FunctionalAdagrad: a TorchScript-compilable Adagrad that takes gradients explicitly.

Placeholder fixed by the workspace skeleton; the implementation replaces it.
"""


class FunctionalAdagrad:
    """Adagrad: explicit gradients, like torch.distributed.optim._FunctionalAdagrad."""

    def __init__(self) -> None:
        raise NotImplementedError("FunctionalAdagrad not implemented yet")
