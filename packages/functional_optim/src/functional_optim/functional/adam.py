"""FunctionalAdam: a TorchScript-compilable Adam that takes gradients explicitly.

Placeholder fixed by the workspace skeleton; the implementation replaces it.
"""


class FunctionalAdam:
    """Adam: explicit gradients, like torch.distributed.optim._FunctionalAdam."""

    def __init__(self) -> None:
        raise NotImplementedError("FunctionalAdam not implemented yet")
