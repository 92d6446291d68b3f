"""Private building blocks of :class:`compat_api.zero_redundancy_optimizer.ZeroRedundancyOptimizer`.

- ``validation``: argument checks with torch's exception types and messages.
- ``layout``: the partition of the parameter groups over ranks and its lookup tables.
- ``join``: the Join hook.
"""
