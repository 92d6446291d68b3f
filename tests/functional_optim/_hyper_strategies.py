"""Hypothesis strategies that draw every hyperparameter of every registered algorithm.

``HYPERPARAMETERS[name]`` maps each argument of ``fo.<name>`` (the alias) to a strategy over
values torch accepts; ``hyperparameters(name)`` draws a full keyword dict, with the joint
constraints torch imposes (SGD's Nesterov needs momentum and no dampening). The tests check
that the table names every argument of every alias, so a new algorithm or argument cannot go
untested.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st


def _floats(lo: float, hi: float, zero: bool = True) -> st.SearchStrategy[float]:
    """Floats in ``[lo, hi]``, with 0 drawn often when ``zero`` (torch's off switch)."""
    body = st.floats(lo, hi, allow_nan=False, allow_infinity=False)
    return st.one_of(st.just(0.0), body) if zero else body


LR = _floats(1e-4, 0.5, zero=False)
WEIGHT_DECAY = _floats(1e-3, 0.5)
EPS = _floats(1e-6, 0.5, zero=False)  # wide, so a kernel that ignores eps is caught
BETA = st.floats(0.0, 0.99)
BETAS = st.tuples(BETA, BETA)
BOOL = st.booleans()

HYPERPARAMETERS: dict[str, dict[str, st.SearchStrategy[Any]]] = {
    "sgd": {
        "lr": LR,
        "momentum": _floats(0.05, 0.99),
        "dampening": _floats(0.01, 0.9),
        "weight_decay": WEIGHT_DECAY,
        "nesterov": BOOL,
        "maximize": BOOL,
    },
    "adam": {
        "lr": LR,
        "betas": BETAS,
        "eps": EPS,
        "weight_decay": WEIGHT_DECAY,
        "amsgrad": BOOL,
        "maximize": BOOL,
        "decoupled_weight_decay": BOOL,
    },
    "adamw": {
        "lr": LR,
        "betas": BETAS,
        "eps": EPS,
        "weight_decay": WEIGHT_DECAY,
        "amsgrad": BOOL,
        "maximize": BOOL,
    },
    "adagrad": {
        "lr": LR,
        "lr_decay": _floats(1e-3, 0.5),
        "weight_decay": WEIGHT_DECAY,
        "initial_accumulator_value": _floats(1e-3, 1.0),
        "eps": EPS,
        "maximize": BOOL,
    },
    "adadelta": {
        "lr": _floats(0.05, 2.0, zero=False),
        "rho": st.floats(0.0, 0.99),
        "eps": EPS,
        "weight_decay": WEIGHT_DECAY,
        "maximize": BOOL,
    },
    "adamax": {
        "lr": LR,
        "betas": BETAS,
        "eps": EPS,
        "weight_decay": WEIGHT_DECAY,
        "maximize": BOOL,
    },
    "rmsprop": {
        "lr": LR,
        "alpha": st.floats(0.05, 0.99),
        "eps": EPS,
        "weight_decay": WEIGHT_DECAY,
        "momentum": _floats(0.05, 0.99),
        "centered": BOOL,
        "maximize": BOOL,
    },
    "nadam": {
        "lr": LR,
        "betas": BETAS,
        "eps": EPS,
        "weight_decay": WEIGHT_DECAY,
        "momentum_decay": _floats(1e-3, 0.5),
        "decoupled_weight_decay": BOOL,
        "maximize": BOOL,
    },
    "radam": {
        "lr": LR,
        # beta2 > 2/3 reaches the rectified branch (rho_t > 5) within the tests' 10 steps
        "betas": st.tuples(BETA, st.one_of(st.floats(0.0, 0.6), st.floats(0.75, 0.95))),
        "eps": EPS,
        "weight_decay": WEIGHT_DECAY,
        "decoupled_weight_decay": BOOL,
        "maximize": BOOL,
    },
    "adafactor": {
        "lr": LR,
        "beta2_decay": st.floats(-1.0, -0.1),
        "eps": st.tuples(st.one_of(st.none(), st.floats(1e-8, 1e-1)), st.floats(0.0, 0.5)),
        "d": st.floats(1.0, 4.0),
        "weight_decay": WEIGHT_DECAY,
        "maximize": BOOL,
    },
    "muon": {
        "lr": LR,
        "weight_decay": WEIGHT_DECAY,
        "momentum": _floats(0.05, 0.99),
        "nesterov": BOOL,
        "ns_coefficients": st.tuples(
            st.floats(2.5, 3.5), st.floats(-5.0, -3.5), st.floats(1.5, 2.5)
        ),
        "eps": _floats(1e-8, 1e-2, zero=False),
        "ns_steps": st.integers(0, 7),
        "adjust_lr_fn": st.sampled_from([None, "original", "match_rms_adamw"]),
    },
    "sparse_adam": {
        "lr": LR,
        "betas": BETAS,
        "eps": EPS,
        "maximize": BOOL,
    },
    "lbfgs": {
        "lr": st.floats(0.05, 1.5),
        "max_iter": st.integers(1, 12),
        "max_eval": st.one_of(st.none(), st.integers(1, 20)),
        "tolerance_grad": st.sampled_from([1e-7, 1e-3, 0.5]),
        "tolerance_change": st.sampled_from([1e-9, 1e-4, 1e-2]),
        "history_size": st.integers(1, 6),
        "line_search_fn": st.sampled_from([None, "strong_wolfe"]),
    },
    "asgd": {
        "lr": LR,
        "lambd": _floats(1e-4, 0.5),
        "alpha": st.floats(0.1, 1.5),
        "t0": st.floats(0.0, 8.0),
        "weight_decay": WEIGHT_DECAY,
        "maximize": BOOL,
    },
    "rprop": {
        "lr": LR,
        "etas": st.tuples(st.floats(0.1, 0.95), st.floats(1.05, 3.0)),
        "step_sizes": st.tuples(st.floats(1e-7, 1e-2), st.floats(0.05, 60.0)),
        "maximize": BOOL,
    },
}


def _fix(name: str, kw: dict[str, Any]) -> dict[str, Any]:
    """Apply torch's joint constraints to a drawn dict."""
    if name == "sgd" and kw["nesterov"] and (kw["momentum"] <= 0 or kw["dampening"] != 0):
        kw = {**kw, "dampening": 0.0, "momentum": kw["momentum"] or 0.9}
    return kw


def declared_strategies(hyperparams: Any) -> dict[str, st.SearchStrategy[Any]]:
    """Strategies for a generated alias (its entry declares ``fo.Hyperparam`` values): each argument
    drawn from its default and its declared ``cases`` (booleans both ways)."""
    return {
        h.name: BOOL if isinstance(h.default, bool) else st.sampled_from((h.default, *h.cases))
        for h in hyperparams
    }


def strategies(name: str) -> dict[str, st.SearchStrategy[Any]]:
    """``HYPERPARAMETERS[name]``, else the strategies the registry entry's declared
    hyperparameters give (a KeyError for a hand-written alias without a row)."""
    if name in HYPERPARAMETERS:
        return HYPERPARAMETERS[name]
    import functional_optim as fo

    algorithm = next(a for a in fo.ALGORITHMS if a.name == name)
    if not algorithm.hyperparams:
        raise KeyError(f"add {name} to _hyper_strategies.HYPERPARAMETERS")
    return declared_strategies(algorithm.hyperparams)


def hyperparameters(name: str) -> st.SearchStrategy[dict[str, Any]]:
    """A strategy for a full keyword dict of ``fo.<name>``."""
    return st.fixed_dictionaries(strategies(name)).map(lambda kw: _fix(name, kw))
