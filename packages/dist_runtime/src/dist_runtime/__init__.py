"""torch.distributed runtime: process groups, partitioning, flat buckets, averaging, RPC."""

__all__: list[str] = []
