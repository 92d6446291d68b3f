"""Which hyperparameters of a transform state ``fo.Optimizer`` shows in its param groups.

A transform's hyperparameters live in its injected states (``InjectHyperparamsState``): the
state itself when the transform is injected (every alias is), else the outermost injected
states inside it (``chain(clip_by_global_norm(1.0), adamw(lr=1e-3))`` exposes AdamW's). A
name is exposed under torch's key (optax's ``learning_rate`` as ``lr``) when exactly one of
those states has it; a name that several have is *ambiguous* and not exposed, so that an LR
scheduler fails with a clear error instead of driving one of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from functional_optim._base import OptState
from functional_optim._transforms.hyperparams import injected_nodes, replace_injected

__all__ = ["GroupHyperparams"]

#: optax's hyperparameter names -> the param-group key torch's optimizers and schedulers use.
_TORCH_KEYS = {"learning_rate": "lr"}


@dataclass(frozen=True)
class GroupHyperparams:
    """Where each exposed param-group key lives in a transform state.

    Attributes:
        keys: group key -> ``(node index, hyperparameter name)``; a key several nodes have
            is not in it.
    """

    keys: dict[str, tuple[int, str]]

    @staticmethod
    def of(state: OptState) -> GroupHyperparams:
        """The layout of ``state`` (see the module docstring)."""
        nodes = injected_nodes(state)
        found: dict[str, list[tuple[int, str]]] = {}
        for i, node in enumerate(nodes):
            for name in node.hyperparams:
                key = name
                if name in _TORCH_KEYS and _TORCH_KEYS[name] not in node.hyperparams:
                    key = _TORCH_KEYS[name]
                found.setdefault(key, []).append((i, name))
        return GroupHyperparams({k: at[0] for k, at in found.items() if len(at) == 1})

    def values(self, state: OptState) -> dict[str, Any]:
        """The exposed keys and their current values in ``state``."""
        nodes = injected_nodes(state)
        return {key: nodes[i].hyperparams[name] for key, (i, name) in self.keys.items()}

    def synced(self, state: OptState, group: dict[str, Any]) -> OptState:
        """``state`` with the group's values of the exposed keys (the same object when none
        differs)."""
        nodes = injected_nodes(state)
        changed = False
        new = [dict(n.hyperparams) for n in nodes]
        for key, (i, name) in self.keys.items():
            if key in group and group[key] is not nodes[i].hyperparams[name]:
                new[i][name] = group[key]
                changed = True
        if not changed:
            return state
        return replace_injected(state, new)
