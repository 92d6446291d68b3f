"""The built-in registry entries, one module per family of algorithms.

Each module declares its entries (:class:`~functional_optim._algorithm.Algorithm`) next to the
parts they name; :data:`functional_optim._registry.BUILTIN_ALGORITHMS` lists them in order.
"""
