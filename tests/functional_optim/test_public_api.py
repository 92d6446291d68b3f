"""Public surface: every exported name imports, __all__ is sorted, no private leaks, and the
exports are static (bound by __init__.py's imports; nothing writes into a module namespace)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
from typing import Any, NamedTuple

import pytest

import functional_optim as fo
from functional_optim import _registration


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
    for name in (
        "adam", "chain", "Optimizer", "scale_by_adam", "linear_schedule", "clip",
        "exponential_decay", "add_noise",
    ):  # fmt: skip
        module = getattr(fo, name).__module__
        assert any(part.startswith("_") for part in module.split(".")[1:]), module


def _bound_at_top_level(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level: imports, assignments, functions and classes."""
    bound: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom | ast.Import):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign):
            bound.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            bound.add(node.target.id)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            bound.add(node.name)
    return bound


def _literal_all(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            assert isinstance(value, list)
            return value
    raise AssertionError("__init__.py has no literal __all__")


def test_every_exported_name_is_bound_statically() -> None:
    # What mypy and IDEs read: __init__.py's own imports and its literal __all__.
    tree = ast.parse(pathlib.Path(fo.__file__).read_text())
    names = _literal_all(tree)
    assert names == fo.__all__  # nothing appends to __all__ at run time
    assert not set(names) - _bound_at_top_level(tree)
    for name in names:
        assert name in vars(fo), name  # bound in the namespace, not served by __getattr__


def test_no_module_namespace_is_written_at_import_or_registration() -> None:
    assert not hasattr(fo, "publish_all")
    assert not hasattr(_registration, "publish_all")
    for module in (fo, fo.kernels, fo.functional):
        source = pathlib.Path(inspect.getfile(module)).read_text()
        assert "setattr(" not in source, module.__name__
    source = pathlib.Path(inspect.getfile(_registration)).read_text()
    assert "setattr(" not in source
    assert "delattr(" not in source


class ToyState(NamedTuple):
    count: Any


def scale_by_toy() -> fo.GradientTransformation:
    return fo.identity()


def toy_descent(learning_rate: float = 0.1) -> fo.GradientTransformation:
    return fo.scale(-learning_rate)


TOY = fo.Algorithm(
    name="toy_descent",
    torch_name="ToyDescent",
    alias=toy_descent,
    transform=scale_by_toy,
    state_type=ToyState,
    state_names={ToyState: {}},
)


def _namespaces() -> list[tuple[dict[str, int], list[str]]]:
    return [
        ({k: id(v) for k, v in vars(m).items()}, list(m.__all__))
        for m in (fo, fo.kernels, fo.functional)
    ]


def test_a_runtime_plugin_is_reachable_without_writing_into_modules() -> None:
    before = _namespaces()
    assert not hasattr(fo, "toy_descent")
    fo.register_algorithm(TOY)
    try:
        assert _namespaces() == before
        assert fo.toy_descent is toy_descent  # type: ignore[attr-defined]
        assert fo.scale_by_toy is scale_by_toy  # type: ignore[attr-defined]
        assert fo.ToyState is ToyState  # type: ignore[attr-defined]
        assert {"toy_descent", "scale_by_toy", "ToyState"} <= set(dir(fo))
        assert "toy_descent" not in fo.__all__
        assert fo.ALGORITHMS[-1] is TOY
    finally:
        fo.unregister_algorithm("toy_descent")
    assert _namespaces() == before
    assert not hasattr(fo, "toy_descent")
    assert TOY not in fo.ALGORITHMS


def test_unknown_names_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        fo.no_such_name  # type: ignore[attr-defined]  # noqa: B018
    assert not hasattr(fo, "publish_all")


def test_modules_are_named_by_purpose() -> None:
    clipping = sorted(n for n in fo.__all__ if n.startswith("clip"))
    assert clipping == ["clip", "clip_by_block_rms", "clip_by_global_norm"]
    for name in clipping:
        assert getattr(fo, name).__module__ == "functional_optim._transforms.clip", name
    schedules = importlib.import_module("functional_optim._schedules").__all__
    named = {n for n in fo.__all__ if n.endswith(("_schedule", "_schedules"))}
    assert named - {"scale_by_schedule"} <= set(schedules) <= set(fo.__all__)
    for name in schedules:
        module = getattr(fo, name).__module__
        assert module.startswith("functional_optim._schedules."), (name, module)


#: The most lines a module of functional_optim may have (small modules, one purpose each).
MAX_MODULE_LINES = 400


def test_no_module_is_over_400_lines() -> None:
    root = pathlib.Path(fo.__file__).parent
    lines = {
        path.relative_to(root).as_posix(): path.read_text().count("\n")
        for path in sorted(root.rglob("*.py"))
    }
    over = {name: count for name, count in lines.items() if count > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by purpose): {over}"
