"""``Optimizer``: run any ``GradientTransformation`` as a ``torch.optim.Optimizer``."""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from functional_optim._base import GradientTransformation, OptState, apply_updates
from functional_optim._group_hyperparams import GroupHyperparams
from functional_optim._lowbit.dtensor_state import export_sharded, import_sharded
from functional_optim._sharded_params import ShardedGroups
from functional_optim._torch_state import (
    check_torch_state,
    from_torch_state,
    to_torch_state,
    tree_nodes,
)
from functional_optim._transforms.rms import ScaleByAdagradState

__all__ = ["Optimizer"]

_GROUP_STATE_KEY = "fo_state"


class _LiveState(defaultdict[Any, Any]):
    """``Optimizer.state``: torch's per-param dicts, refreshed from the transform states on
    the first read after a step (so ``opt.state`` is live without a per-step cost)."""

    def __init__(self, owner: Optimizer, *args: Any) -> None:
        super().__init__(dict, *args)
        self._owner = weakref.ref(owner)

    def _fresh(self) -> None:
        owner = self._owner()
        if owner is not None and owner._state_stale:
            owner._export_state()

    def __getitem__(self, key: Any) -> Any:
        self._fresh()
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self._fresh()
        return super().__contains__(key)

    def __iter__(self) -> Iterator[Any]:
        self._fresh()
        return super().__iter__()

    def __len__(self) -> int:
        self._fresh()
        return super().__len__()

    def __repr__(self) -> str:
        self._fresh()
        return super().__repr__()

    def get(self, key: Any, default: Any = None) -> Any:
        self._fresh()
        return super().get(key, default)

    def keys(self) -> Any:
        self._fresh()
        return super().keys()

    def values(self) -> Any:
        self._fresh()
        return super().values()

    def items(self) -> Any:
        self._fresh()
        return super().items()


def _eager_state(state: OptState) -> bool:
    """Whether torch's class creates this state at construction (Adagrad's ``sum``), not at a
    param's first gradient."""
    return any(isinstance(node, ScaleByAdagradState) for node in tree_nodes(state))


class Optimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that applies a ``GradientTransformation`` to ``p.grad``.

    Each param group gets its own transform state (``tx.init(group["params"])``). A step uses
    the transform's fused ``step`` when it has one (the eight aliases do) and otherwise runs
    ``update(..., inplace=True)`` on clones of the gradients (``p.grad`` is left as it was)
    followed by ``apply_updates(..., inplace=True)``.

    Hyperparameters: when ``tx`` is injected (every alias is, or wrap your own factory with
    ``fo.inject_hyperparams``), its hyperparameters (``lr``, ``betas``, ...) are the optimizer's
    defaults and appear in every param group; before each step the group's values are copied
    into the transform's state, so ``torch.optim.lr_scheduler`` schedulers and per-group
    overrides (``{"params": ..., "lr": 0.1}``) reach the transform.

    State: ``state_dict()`` writes the transform state in torch's format (per-param dicts keyed
    by param index, torch's key names for the built-in transforms; group-level entries under
    ``param_groups[i]["fo_state"]``) and ``load_state_dict`` converts it back, so a round trip
    resumes bit-identically. ``load_state_dict`` checks the whole dict first and changes
    nothing when it does not fit (see there). ``self.state`` is refreshed from the transform
    state by ``state_dict()``.

    DTensor params (FSDP2, tensor parallel): a group's fused step runs on the local shards as
    plain tensors (the state stays DTensor outwardly); global and per-tensor norms add up the
    shards with one collective (see :mod:`functional_optim._sharded_params`).

    Args:
        params: an iterable of tensors or of param-group dicts, as for torch optimizers.
        tx: the transform.

    Raises:
        TypeError: if ``tx`` is not a ``GradientTransformation``.

    Example::

        >>> opt = fo.Optimizer(model.parameters(), fo.adam(lr=1e-3))
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
        >>> loss.backward(); opt.step(); sched.step(); opt.zero_grad()
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], tx: Any) -> None:
        if not isinstance(tx, GradientTransformation):
            raise TypeError(
                f"tx must be a GradientTransformation (e.g. fo.adam(lr=1e-3)), got "
                f"{type(tx).__name__}"
            )
        self._tx = tx
        self._tx_states: list[OptState] = []
        self._layouts: list[GroupHyperparams] = []
        self._group_values: list[dict[str, Any]] = []  # the values last written to the state
        self._state_stale = False
        # the params torch would hold state for: those that had a gradient at a step (torch
        # creates state then; Adagrad at construction)
        self._with_state: set[Tensor] = set()
        self._all_have_state = True
        self._sharded = ShardedGroups()  # DTensor groups step their local shards
        empty = tx.init([])
        super().__init__(params, GroupHyperparams.of(empty).values(empty))
        self.state = _LiveState(self, self.state)

    @property
    def transform(self) -> GradientTransformation:
        """The transform this optimizer runs."""
        return self._tx

    @property
    def transform_states(self) -> list[OptState]:
        """The transform state of each param group (live; do not mutate)."""
        return list(self._tx_states)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group and initialise its transform state (see torch's docs)."""
        super().add_param_group(param_group)
        state = self._tx.init(list(self.param_groups[-1]["params"]))
        layout = GroupHyperparams.of(state)
        group = self.param_groups[-1]  # a plain dict: torch.compile rewrites its keys
        for key, value in layout.values(state).items():
            group.setdefault(key, value)
        if _eager_state(state):
            self._with_state.update(self.param_groups[-1]["params"])
        else:
            self._all_have_state = False
        self._tx_states.append(state)
        self._layouts.append(layout)
        self._group_values.append(layout.values(state))

    def _synced(self, i: int, group: dict[str, Any]) -> OptState:
        """Group ``i``'s transform state with the group's hyperparameter values (only the
        identity of each value is compared when nothing changed)."""
        state = self._tx_states[i]
        last = self._group_values[i]
        if torch.compiler.is_compiling():
            # dynamo's view of torch.optim param groups says capturable=True (it turns torch's
            # CUDA optimizers capturable); our kernels do not depend on it: keep the built one
            group = {**group, "capturable": last.get("capturable", False)}
        if all(group.get(k, v) is v for k, v in last.items()):
            return state
        state = self._layouts[i].synced(state, group)
        self._group_values[i] = {k: group.get(k, v) for k, v in last.items()}
        return state

    def __getstate__(self) -> dict[str, Any]:
        """torch's pickled fields plus the transform and its states (``deepcopy`` and
        ``pickle`` give an optimizer that steps on)."""
        if self._state_stale:
            self._export_state()
        out = dict(super().__getstate__())
        out["state"] = defaultdict(dict, self.state)
        out.update(
            _tx=self._tx,
            _tx_states=self._tx_states,
            _layouts=self._layouts,
            _group_values=self._group_values,
            _with_state=self._with_state,
            _all_have_state=self._all_have_state,
            _state_stale=False,
        )
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickling, and torch's ``load_state_dict`` (its state is the one to keep: the
        transform states are rebuilt from it, not exported over it)."""
        super().__setstate__(state)
        self.state = _LiveState(self, self.state)
        if "_sharded" not in self.__dict__:
            self._sharded = ShardedGroups()
        self._state_stale = False

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step.

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.
        """
        with torch.set_grad_enabled(bool(self.defaults.get("differentiable", False))):
            return self._step(closure)

    def _step(self, closure: Callable[[], float] | None) -> float | None:
        fused = self._tx.step
        if getattr(fused, "needs_closure", False):  # e.g. fo.lbfgs: it calls the closure
            return self._closure_step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for i, group in enumerate(self.param_groups):
            params: list[Tensor] = group["params"]
            state = self._synced(i, group)
            local_step = self._sharded.prepared(i, params, state, fused)  # DTensor params
            if not self._all_have_state:
                self._note_gradients(params)
            if local_step is not None:
                state = local_step()
            elif fused is not None:
                state = fused(params, [p.grad for p in params], state)
            else:
                grads = [None if p.grad is None else p.grad.clone() for p in params]
                updates, state = self._tx.update(grads, state, params, inplace=True)
                apply_updates(params, updates, inplace=True)
            self._tx_states[i] = state
        self._state_stale = True
        return loss

    def _note_gradients(self, params: list[Tensor]) -> None:
        """Remember the params that had a gradient (they have state now, as in torch); stop
        looking once every param has."""
        self._with_state.update(p for p in params if p.grad is not None)
        total = sum(len(group["params"]) for group in self.param_groups)
        self._all_have_state = len(self._with_state) >= total

    def _closure_step(self, closure: Callable[[], float] | None) -> float | None:
        """One step of a transform that evaluates the closure itself (torch's LBFGS contract:
        one param group; returns the closure's first loss)."""
        if closure is None:
            raise TypeError("this transform re-evaluates the model: pass step(closure)")
        if len(self.param_groups) != 1:
            raise ValueError("LBFGS doesn't support per-parameter options (parameter groups)")
        losses: list[float] = []

        def recording() -> float:
            loss = closure()
            losses.append(loss)
            return loss

        group = self.param_groups[0]
        state = self._synced(0, group)
        fused = self._tx.step
        assert fused is not None
        self._tx_states[0] = fused(group["params"], recording, state)
        self._with_state.update(group["params"])
        self._state_stale = True
        return losses[0] if losses else None

    def _export_state(self) -> None:
        self._state_stale = False
        for group, state in zip(self.param_groups, self._tx_states, strict=True):
            params = group["params"]
            per_param, group_state = to_torch_state(state, list(params))
            for p, entry in zip(params, per_param, strict=True):
                if entry and p in self._with_state:
                    self.state[p] = entry
                else:
                    self.state.pop(p, None)
            if group_state:
                group[_GROUP_STATE_KEY] = group_state
            else:
                group.pop(_GROUP_STATE_KEY, None)

    def _import_state(self, templates: list[OptState]) -> None:
        states = []
        for group, template in zip(self.param_groups, templates, strict=True):
            params = list(group["params"])
            per_param = [dict(self.state[p]) if p in self.state else {} for p in params]
            self._with_state.update(p for p, d in zip(params, per_param, strict=True) if d)
            states.append(
                from_torch_state(template, params, per_param, group.get(_GROUP_STATE_KEY))
            )
        self._tx_states = states
        self._group_values = [
            layout.values(state) for layout, state in zip(self._layouts, states, strict=True)
        ]
        self._state_stale = False

    def _checked(self, state_dict: dict[str, Any]) -> tuple[dict[str, Any], list[OptState]]:
        """``state_dict`` with each saved group's missing hyperparameters taken from the
        current group, and the templates (``tx.init``) it was checked against.

        Raises:
            KeyError, ValueError, RuntimeError, TypeError: see :meth:`load_state_dict`.
        """
        groups, saved = self.param_groups, state_dict["param_groups"]
        state_dict = import_sharded(groups, state_dict)  # low-bit state of DTensor params
        if len(groups) != len(saved) or any(
            len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved, strict=True)
        ):
            return state_dict, []  # torch's load_state_dict raises its ValueError
        loaded = state_dict["state"]
        templates, first = [], 0
        for group, saved_group in zip(groups, saved, strict=True):
            params = list(group["params"])
            template = self._tx.init(params)
            per_param = [loaded.get(i) for i in saved_group["params"]]
            check_torch_state(template, params, per_param, saved_group.get(_GROUP_STATE_KEY), first)
            templates.append(template)
            first += len(params)
        names = set().union(*(layout.keys for layout in self._layouts))
        filled = [
            {**{k: g[k] for k in names if k in g and k not in s}, **s}
            for g, s in zip(groups, saved, strict=True)
        ]
        return {**state_dict, "param_groups": filled}, templates

    def state_dict(self) -> dict[str, Any]:
        """Return the state in torch's format (see the class docstring).

        Low-bit states of sharded DTensor params come in a layout DCP reshards (one code per
        element, as a DTensor; every block's scale): a collective for them, as DCP calls it
        on every rank (see :mod:`functional_optim._lowbit.dtensor_state`).
        """
        self._export_state()
        state_dict = super().state_dict()
        state_dict["state"] = export_sharded(self.param_groups, state_dict["state"])
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict` (or a compatible torch optimizer's).

        The whole dict is checked against this optimizer's transform before anything changes
        (after the load pre-hooks ran, as torch's own checks run): a param with saved state
        needs every per-param entry of this algorithm (torch's names), each the size this
        optimizer keeps (a lazily created buffer, as SGD's ``momentum_buffer``, may be absent),
        and a numeric ``step``. A saved param group that lacks one of the transform's
        hyperparameters keeps the current value.

        Args:
            state_dict: the state, in torch's format.

        Raises:
            KeyError: a per-param entry is missing, e.g. ``KeyError('step')`` for another
                algorithm's state (torch's error).
            ValueError: torch's errors for param groups that do not match; a ``step`` that is
                not a number.
            RuntimeError: a state tensor whose size is not the one kept for its param.
            TypeError: an entry that should be a tensor is not one.
        """
        templates: list[list[OptState]] = []

        def check(optimizer: torch.optim.Optimizer, loaded: dict[str, Any]) -> dict[str, Any]:
            checked, made = self._checked(loaded)
            templates.append(made)
            return checked

        # registered last, so it sees what the user's pre-hooks returned
        handle = self.register_load_state_dict_pre_hook(check)
        try:
            super().load_state_dict(state_dict)
        finally:
            handle.remove()
        self._import_state(templates[-1])
