"""FunctionalRMSprop: a TorchScript-compilable RMSprop that takes gradients explicitly.

Placeholder fixed by the workspace skeleton; the implementation replaces it.
"""


class FunctionalRMSprop:
    """RMSprop: explicit gradients, like torch.distributed.optim._FunctionalRMSprop."""

    def __init__(self) -> None:
        raise NotImplementedError("FunctionalRMSprop not implemented yet")
