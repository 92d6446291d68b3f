"""Drop-ins for ``torch.distributed.algorithms.ddp_comm_hooks`` (import the hook modules)."""

__all__: list[str] = []
