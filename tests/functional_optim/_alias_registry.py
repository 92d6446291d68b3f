"""One table of the eight optimizers: our alias, torch's class, and every flag combination.

Shared by test_aliases, test_optimizer and test_meta_gradient.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

import functional_optim as fo


class Entry(NamedTuple):
    name: str
    alias: Callable[..., fo.GradientTransformation]
    torch_cls: type[torch.optim.Optimizer]
    base: dict[str, Any]  # hyperparameters used in every combination
    flags: dict[str, tuple[Any, ...]]  # flag -> values; the product is tested
    has_fused: bool  # torch has a fused CPU kernel (our step path then matches fused=True)

    def combos(self) -> list[dict[str, Any]]:
        names = sorted(self.flags)
        out = []
        for values in itertools.product(*(self.flags[n] for n in names)):
            kw = {**self.base, **dict(zip(names, values, strict=True))}
            if self.name == "sgd" and kw["nesterov"] and (kw["momentum"] <= 0 or kw["dampening"]):
                continue
            out.append(kw)
        return out


REGISTRY: list[Entry] = [
    Entry(
        "sgd",
        fo.sgd,
        torch.optim.SGD,
        {"lr": 0.05},
        {
            "momentum": (0.0, 0.9),
            "dampening": (0.0, 0.1),
            "nesterov": (False, True),
            "weight_decay": (0.0, 0.1),
            "maximize": (False, True),
        },
        True,
    ),
    Entry(
        "adam",
        fo.adam,
        torch.optim.Adam,
        {"lr": 0.01, "betas": (0.8, 0.95)},
        {"amsgrad": (False, True), "weight_decay": (0.0, 0.1), "maximize": (False, True)},
        True,
    ),
    Entry(
        "adamw",
        fo.adamw,
        torch.optim.AdamW,
        {"lr": 0.01},
        {"amsgrad": (False, True), "weight_decay": (0.0, 0.1), "maximize": (False, True)},
        True,
    ),
    Entry(
        "adagrad",
        fo.adagrad,
        torch.optim.Adagrad,
        {"lr": 0.05},
        {
            "lr_decay": (0.0, 0.01),
            "weight_decay": (0.0, 0.1),
            "initial_accumulator_value": (0.0, 0.1),
            "maximize": (False, True),
        },
        True,
    ),
    Entry(
        "adadelta",
        fo.adadelta,
        torch.optim.Adadelta,
        {"lr": 0.5, "rho": 0.8},
        {"weight_decay": (0.0, 0.1), "maximize": (False, True)},
        False,
    ),
    Entry(
        "adamax",
        fo.adamax,
        torch.optim.Adamax,
        {"lr": 0.01},
        {"weight_decay": (0.0, 0.1), "maximize": (False, True)},
        False,
    ),
    Entry(
        "rmsprop",
        fo.rmsprop,
        torch.optim.RMSprop,
        {"lr": 0.01, "alpha": 0.9},
        {
            "centered": (False, True),
            "momentum": (0.0, 0.9),
            "weight_decay": (0.0, 0.1),
            "maximize": (False, True),
        },
        False,
    ),
    Entry(
        "rprop",
        fo.rprop,
        torch.optim.Rprop,
        {"lr": 0.01},
        {"maximize": (False, True)},
        False,
    ),
]

BY_NAME = {e.name: e for e in REGISTRY}


def all_cases() -> list[tuple[str, dict[str, Any]]]:
    """``(name, hyperparameters)`` for every optimizer and flag combination."""
    return [(e.name, kw) for e in REGISTRY for kw in e.combos()]


def case_id(name: str, kw: dict[str, Any]) -> str:
    flags = [k if v is True else f"{k}={v}" for k, v in sorted(kw.items()) if v not in (False,)]
    return name + "[" + ",".join(flags) + "]"
