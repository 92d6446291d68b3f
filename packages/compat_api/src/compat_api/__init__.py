"""Drop-in replacements for torch.distributed.optim (torch 2.13)."""

__all__: list[str] = []
