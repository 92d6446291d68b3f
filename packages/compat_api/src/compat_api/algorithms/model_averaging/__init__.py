"""Drop-ins for ``torch.distributed.algorithms.model_averaging`` (import the submodules)."""

__all__: list[str] = []
