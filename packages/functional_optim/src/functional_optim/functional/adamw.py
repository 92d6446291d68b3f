"""FunctionalAdamW: a TorchScript-compilable AdamW that takes gradients explicitly.

Placeholder fixed by the workspace skeleton; the implementation replaces it.
"""


class FunctionalAdamW:
    """AdamW: explicit gradients, like torch.distributed.optim._FunctionalAdamW."""

    def __init__(self) -> None:
        raise NotImplementedError("FunctionalAdamW not implemented yet")
