"""Public surface: every exported name imports, __all__ is sorted, no private leaks."""

from __future__ import annotations

import importlib

import functional_optim as fo


def test_every_exported_name_imports() -> None:
    module = importlib.import_module("functional_optim")
    for name in fo.__all__:
        assert getattr(module, name) is not None, name
    namespace: dict[str, object] = {}
    exec("from functional_optim import *", namespace)
    assert set(fo.__all__) <= set(namespace)


def test_all_is_sorted_unique_and_public() -> None:
    assert fo.__all__ == sorted(fo.__all__)
    assert len(set(fo.__all__)) == len(fo.__all__)
    assert not [n for n in fo.__all__ if n.startswith("_")]


def test_required_names_present() -> None:
    required = {
        "GradientTransformation", "chain", "identity", "apply_updates", "scale",
        "scale_by_learning_rate", "scale_by_adam", "trace", "add_decayed_weights",
        "clip_by_global_norm", "scale_by_adamax", "scale_by_rms", "scale_by_adagrad",
        "scale_by_adadelta", "scale_by_rprop", "constant_schedule", "linear_schedule",
        "cosine_decay_schedule", "warmup_cosine_decay_schedule", "Optimizer", "kernels",
        "sgd", "adam", "adamw", "adagrad", "adadelta", "adamax", "rmsprop", "rprop",
        "FunctionalSGD", "FunctionalAdam",
    }  # fmt: skip
    assert required <= set(fo.__all__)


def test_implementation_lives_in_private_modules() -> None:
    for name in ("adam", "chain", "Optimizer", "scale_by_adam", "linear_schedule"):
        module = getattr(fo, name).__module__
        assert any(part.startswith("_") for part in module.split(".")[1:]), module
