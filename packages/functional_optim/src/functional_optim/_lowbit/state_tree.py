"""The per-param fields of an inner transform state, and the quantised moments' state types.

A low-bit state is ``(inner, moment_1, moment_2, ...)``: the inner transform's state with the
leaves of its quantised params' moments set to None, and one ``Quantized_<key>`` NamedTuple
per moment field with two per-param fields, ``<key>_codes`` and ``<key>_scales`` (``<key>``
is torch's name of the field, e.g. ``exp_avg``), so ``fo.Optimizer.state_dict()`` holds, per
param, ``exp_avg_codes`` / ``exp_avg_scales`` where torch holds ``exp_avg``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from functional_optim._base import OptState
from functional_optim._torch_state import _keys
from functional_optim._transforms.hyperparams import InjectHyperparamsState
from functional_optim._tree import TreeSpec

__all__ = [
    "FieldRef",
    "get_field",
    "moment_type",
    "per_param_fields",
    "replace_fields",
    "up_to",
]

#: torch's names of the fields that never hold a negative value (unsigned code maps)
NON_NEGATIVE = frozenset(
    {"exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta", "exp_inf", "nu"}
)


class FieldRef(NamedTuple):
    """A per-param field of a (chained) state: component path, field name, torch's key."""

    path: str
    field: str
    key: str


def up_to(spec: TreeSpec, tree: Any) -> list[Any]:
    """The leaves of ``tree`` at ``spec``'s leaf positions (``spec.flatten_up_to``)."""
    return list(spec.flatten_up_to(tree))


def per_param_fields(state: OptState, spec: TreeSpec) -> list[FieldRef]:
    """The fields of ``state`` that hold one leaf per param of ``spec``."""
    return [
        FieldRef(path, field, k.key)
        for (path, field), k in _keys(state, spec).items()
        if k.kind == "param"
    ]


def _walk(node: Any, fn: Callable[[str, Any], Any], path: tuple[int, ...] = ()) -> Any:
    if isinstance(node, InjectHyperparamsState):
        return node._replace(inner_state=_walk(node.inner_state, fn, path))
    if isinstance(node, tuple) and hasattr(node, "_fields"):
        return fn(".".join(map(str, path)), node)
    if isinstance(node, (tuple, list)):
        return type(node)(_walk(c, fn, (*path, i)) for i, c in enumerate(node))
    return node


def get_field(state: OptState, ref: FieldRef) -> Any:
    """The value of field ``ref`` in ``state``."""
    found: list[Any] = []

    def look(path: str, comp: Any) -> Any:
        if path == ref.path:
            found.append(getattr(comp, ref.field))
        return comp

    _walk(state, look)
    return found[0]


def replace_fields(state: OptState, values: dict[FieldRef, Any]) -> OptState:
    """``state`` with the fields of ``values`` replaced (one rebuild of each component)."""
    by_path: dict[str, dict[str, Any]] = {}
    for ref, value in values.items():
        by_path.setdefault(ref.path, {})[ref.field] = value

    def put(path: str, comp: Any) -> Any:
        new = by_path.get(path)
        return comp._replace(**new) if new else comp

    return _walk(state, put)


_TYPES: dict[str, type] = {}


def moment_type(key: str) -> Any:
    """The NamedTuple type ``Quantized_<key>(<key>_codes, <key>_scales)`` (made once; found by
    pickle through this module's ``__getattr__``)."""
    found = _TYPES.get(key)
    if found is None:
        name = f"Quantized_{key}"
        made: Any = NamedTuple(name, [(f"{key}_codes", Any), (f"{key}_scales", Any)])  # type: ignore[misc]
        made.__module__ = __name__
        made.__qualname__ = name
        made.__doc__ = f"The codes and block scales of the quantised ``{key}`` of each param."
        found = _TYPES[key] = made
    return found


def __getattr__(name: str) -> Any:
    if name.startswith("Quantized_"):
        return moment_type(name[len("Quantized_") :])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
