"""FunctionalRprop: a TorchScript-compilable Rprop that takes gradients explicitly.

Placeholder fixed by the workspace skeleton; the implementation replaces it.
"""


class FunctionalRprop:
    """Rprop: explicit gradients, like torch.distributed.optim._FunctionalRprop."""

    def __init__(self) -> None:
        raise NotImplementedError("FunctionalRprop not implemented yet")
