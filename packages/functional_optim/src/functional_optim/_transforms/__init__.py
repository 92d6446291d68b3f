"""Optax-style transform factories, one module per family (re-exported by the package)."""
