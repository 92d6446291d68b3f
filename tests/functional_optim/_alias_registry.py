"""The package's algorithm registry as test tables: alias, torch's class, flag combinations.

Shared by test_aliases, test_optimizer and test_meta_gradient.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

import functional_optim as fo

from ._parity import SHAPES, make_params


class Entry(NamedTuple):
    name: str
    alias: Callable[..., fo.GradientTransformation]
    torch_cls: type[torch.optim.Optimizer]
    base: dict[str, Any]  # hyperparameters used in every combination
    flags: dict[str, tuple[Any, ...]]  # flag -> values; the product is tested
    has_fused: bool  # torch has a fused CPU kernel (our step path then matches fused=True)
    shapes: tuple[tuple[int, ...], ...] = SHAPES  # five param shapes torch accepts

    @property
    def single_path_only(self) -> bool:
        """torch's class has no ``foreach`` argument (Muon, a toy registered by a test)."""
        return (
            self.name in SINGLE_PATH_ONLY
            or "foreach" not in inspect.signature(self.torch_cls.__init__).parameters
        )

    @property
    def loop(self) -> dict[str, bool]:
        """torch's per-tensor path (Muon has only that one, and no ``foreach`` argument)."""
        return {} if self.single_path_only else {"foreach": False}

    @property
    def step_path(self) -> dict[str, bool]:
        """The torch path our fused ``step`` is bitwise equal to."""
        return {"fused": True} if self.has_fused else self.loop

    @property
    def paths(self) -> list[dict[str, bool]]:
        """Every torch path a ``FunctionalX`` can select: default, and ``foreach``."""
        return [self.step_path] if self.single_path_only else [self.step_path, {"foreach": True}]

    def params(self, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
        """Random params of this entry's shapes."""
        return make_params(self.shapes, dtype=dtype, seed=seed)

    def combos(self) -> list[dict[str, Any]]:
        names = sorted(self.flags)
        out = []
        for values in itertools.product(*(self.flags[n] for n in names)):
            kw = {**self.base, **dict(zip(names, values, strict=True))}
            if self.name == "sgd" and kw["nesterov"] and (kw["momentum"] <= 0 or kw["dampening"]):
                continue
            out.append(kw)
        return out


#: name -> (base hyperparameters, flag -> values): what the combination tests vary, per entry
#: of the package's algorithm registry (``fo.ALGORITHMS``); every entry must have one.
CASE_TABLES: dict[str, tuple[dict[str, Any], dict[str, tuple[Any, ...]]]] = {
    "sgd": (
        {"lr": 0.05},
        {
            "momentum": (0.0, 0.9),
            "dampening": (0.0, 0.1),
            "nesterov": (False, True),
            "weight_decay": (0.0, 0.1),
            "maximize": (False, True),
        },
    ),
    "adam": (
        {"lr": 0.01, "betas": (0.8, 0.95)},
        {
            "amsgrad": (False, True),
            "weight_decay": (0.0, 0.1),
            "maximize": (False, True),
            "decoupled_weight_decay": (False, True),
        },
    ),
    "adamw": (
        {"lr": 0.01},
        {"amsgrad": (False, True), "weight_decay": (0.0, 0.1), "maximize": (False, True)},
    ),
    "adagrad": (
        {"lr": 0.05},
        {
            "lr_decay": (0.0, 0.01),
            "weight_decay": (0.0, 0.1),
            "initial_accumulator_value": (0.0, 0.1),
            "maximize": (False, True),
        },
    ),
    "adadelta": (
        {"lr": 0.5, "rho": 0.8},
        {"weight_decay": (0.0, 0.1), "maximize": (False, True)},
    ),
    "adamax": ({"lr": 0.01}, {"weight_decay": (0.0, 0.1), "maximize": (False, True)}),
    "rmsprop": (
        {"lr": 0.01, "alpha": 0.9},
        {
            "centered": (False, True),
            "momentum": (0.0, 0.9),
            "weight_decay": (0.0, 0.1),
            "maximize": (False, True),
        },
    ),
    "rprop": ({"lr": 0.01}, {"maximize": (False, True)}),
    "nadam": (
        {"lr": 0.01, "momentum_decay": 0.01},
        {
            "weight_decay": (0.0, 0.1),
            "decoupled_weight_decay": (False, True),
            "maximize": (False, True),
        },
    ),
    "radam": (
        {"lr": 0.01, "betas": (0.9, 0.8)},
        {
            "weight_decay": (0.0, 0.1),
            "decoupled_weight_decay": (False, True),
            "maximize": (False, True),
        },
    ),
    "adafactor": (
        {"lr": 0.05, "beta2_decay": -0.7, "d": 1.5},
        {
            "eps": ((None, 1e-3), (1e-4, 0.05)),
            "weight_decay": (0.0, 0.1),
            "maximize": (False, True),
        },
    ),
    "muon": (
        {"lr": 0.05, "momentum": 0.9},
        {
            "nesterov": (False, True),
            "weight_decay": (0.0, 0.1),
            "adjust_lr_fn": (None, "match_rms_adamw"),
        },
    ),
    "asgd": (
        {"lr": 0.05, "lambd": 0.01, "t0": 3.0},
        {"weight_decay": (0.0, 0.1), "maximize": (False, True)},
    ),
}


#: torch's Adafactor divides by a param's size: no empty param there.
NONEMPTY_SHAPES = ((), (3,), (7,), (4, 5), (2, 3, 4))
#: torch's Muon takes 2-D params only.
MATRIX_SHAPES = ((3, 4), (5, 2), (4, 4), (1, 6), (6, 1))
SINGLE_PATH_ONLY = frozenset({"muon"})
SHAPES_BY_NAME = {"adafactor": NONEMPTY_SHAPES, "muon": MATRIX_SHAPES}


def derived_table(
    algorithm: fo.Algorithm,
) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    """The case table of an entry that declares its hyperparameters (a generated alias): every
    boolean both ways, every other hyperparameter at its default and its declared ``cases``."""
    flags: dict[str, tuple[Any, ...]] = {}
    for h in algorithm.hyperparams:
        values = (False, True) if isinstance(h.default, bool) else (h.default, *h.cases)
        if len(values) > 1:
            flags[h.name] = values
    return {}, flags


def entry_for(algorithm: fo.Algorithm) -> Entry:
    """The test-table entry of a registered algorithm: its ``CASE_TABLES`` row, else the table
    its declared hyperparameters give.

    Raises:
        KeyError: for an entry with a hand-written alias and no ``CASE_TABLES`` row.
    """
    if algorithm.name in CASE_TABLES:
        base, flags = CASE_TABLES[algorithm.name]
    elif algorithm.hyperparams:
        base, flags = derived_table(algorithm)
    else:
        raise KeyError(f"add a CASE_TABLES row for {algorithm.name} (its alias is hand-written)")
    return Entry(
        algorithm.name,
        algorithm.alias,
        getattr(torch.optim, algorithm.torch_name),
        base,
        flags,
        algorithm.has_fused,
        SHAPES_BY_NAME.get(algorithm.name, SHAPES),
    )


#: Every registered dense-gradient algorithm (a KeyError here: a new entry with a hand-written
#: alias lacks its CASE_TABLES row; an entry that declares its hyperparameters needs none).
#: Sparse-gradient (SparseAdam) and closure-driven (LBFGS) ones have their own tests
#: (test_sparse_adam.py, test_lbfgs.py), which check they cover every such entry.
REGISTRY: list[Entry] = [
    entry_for(a) for a in fo.ALGORITHMS if not (a.sparse_grads or a.needs_closure)
]

BY_NAME = {e.name: e for e in REGISTRY}


def all_cases() -> list[tuple[str, dict[str, Any]]]:
    """``(name, hyperparameters)`` for every optimizer and flag combination."""
    return [(e.name, kw) for e in REGISTRY for kw in e.combos()]


def case_id(name: str, kw: dict[str, Any]) -> str:
    flags = [k if v is True else f"{k}={v}" for k, v in sorted(kw.items()) if v not in (False,)]
    return name + "[" + ",".join(flags) + "]"
