"""Drop-ins for ``torch.distributed.algorithms`` (model averaging, DDP communication hooks)."""

__all__: list[str] = []
