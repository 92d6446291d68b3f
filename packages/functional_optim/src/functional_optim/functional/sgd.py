"""FunctionalSGD: a TorchScript-compilable SGD that takes gradients explicitly.

Placeholder fixed by the workspace skeleton; the implementation replaces it.
"""


class FunctionalSGD:
    """SGD: explicit gradients, like torch.distributed.optim._FunctionalSGD."""

    def __init__(self) -> None:
        raise NotImplementedError("FunctionalSGD not implemented yet")
