"""Package surfaces: sorted exports that import, torch's names and signatures, one-way imports."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import warnings

import pytest
import torch

import compat_api
import dist_runtime

ROOT = pathlib.Path(__file__).resolve().parents[1]

# torch module path -> our module path, for every module a user may import from.
MIRRORED_MODULES = {
    "torch.distributed.optim": "compat_api",
    "torch.distributed.optim.utils": "compat_api.utils",
    "torch.distributed.optim.optimizer": "compat_api.optimizer",
    "torch.distributed.optim.zero_redundancy_optimizer": "compat_api.zero_redundancy_optimizer",
    "torch.distributed.optim.post_localSGD_optimizer": "compat_api.post_localSGD_optimizer",
    "torch.distributed.algorithms.model_averaging.averagers": (
        "compat_api.algorithms.model_averaging.averagers"
    ),
    "torch.distributed.algorithms.model_averaging.hierarchical_model_averager": (
        "compat_api.algorithms.model_averaging.hierarchical_model_averager"
    ),
    "torch.distributed.algorithms.model_averaging.utils": (
        "compat_api.algorithms.model_averaging.utils"
    ),
    "torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook": (
        "compat_api.algorithms.ddp_comm_hooks.post_localSGD_hook"
    ),
    "torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook": (
        "compat_api.algorithms.ddp_comm_hooks.ddp_zero_hook"
    ),
}

# Public callables of each torch module that we must offer with the same signature.
TORCH_NAMES = {
    "torch.distributed.optim": [
        "DistributedOptimizer",
        "PostLocalSGDOptimizer",
        "ZeroRedundancyOptimizer",
        "as_functional_optim",
    ],
    "torch.distributed.optim.utils": ["register_functional_optim", "as_functional_optim"],
    "torch.distributed.algorithms.model_averaging.averagers": [
        "ModelAverager",
        "PeriodicModelAverager",
    ],
    "torch.distributed.algorithms.model_averaging.hierarchical_model_averager": [
        "HierarchicalModelAverager"
    ],
    "torch.distributed.algorithms.model_averaging.utils": [
        "average_parameters",
        "get_params_to_average",
        "average_parameters_or_parameter_groups",
    ],
    "torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook": [
        "PostLocalSGDState",
        "post_localSGD_hook",
    ],
    "torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook": [
        "hook_with_zero_step",
        "hook_with_zero_step_interleaved",
    ],
}


def _import_quietly(name: str) -> object:
    with warnings.catch_warnings():
        # torch 2.13 warns about TorchScript when its functional optimizers are imported.
        warnings.simplefilter("ignore", DeprecationWarning)
        return importlib.import_module(name)


@pytest.mark.parametrize("package", [compat_api, dist_runtime])
def test_all_is_sorted_and_every_name_imports(package: object) -> None:
    exported = list(package.__all__)  # type: ignore[attr-defined]
    assert exported == sorted(exported)
    assert len(set(exported)) == len(exported)
    for name in exported:
        assert getattr(package, name) is not None, name


def test_importing_our_packages_warns_nothing() -> None:
    # The suite turns warnings into errors, so a fresh import in a subprocess would fail loudly;
    # here: reloading the compat package and its modules emits no warning of ours.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for ours in MIRRORED_MODULES.values():
            importlib.reload(importlib.import_module(ours))


@pytest.mark.parametrize("torch_module", sorted(TORCH_NAMES))
def test_torch_names_exist_with_torch_signatures(torch_module: str) -> None:
    theirs = _import_quietly(torch_module)
    ours = importlib.import_module(MIRRORED_MODULES[torch_module])
    for name in TORCH_NAMES[torch_module]:
        assert hasattr(ours, name), f"{MIRRORED_MODULES[torch_module]} lacks {name}"
        their_obj, our_obj = getattr(theirs, name), getattr(ours, name)
        their_sig = inspect.signature(their_obj)
        our_sig = inspect.signature(our_obj)
        assert list(our_sig.parameters) == list(their_sig.parameters), name
        for param_name, param in their_sig.parameters.items():
            assert our_sig.parameters[param_name].default == param.default, (name, param_name)
            assert our_sig.parameters[param_name].kind == param.kind, (name, param_name)


def test_functional_optim_map_is_shared_and_complete() -> None:
    import functional_optim as fo

    assert compat_api.DistributedOptimizer.functional_optim_map is compat_api.functional_optim_map
    expected = {
        torch.optim.SGD: fo.FunctionalSGD,
        torch.optim.Adam: fo.FunctionalAdam,
        torch.optim.AdamW: fo.FunctionalAdamW,
        torch.optim.Adamax: fo.FunctionalAdamax,
        torch.optim.Adagrad: fo.FunctionalAdagrad,
        torch.optim.Adadelta: fo.FunctionalAdadelta,
        torch.optim.RMSprop: fo.FunctionalRMSprop,
        torch.optim.Rprop: fo.FunctionalRprop,
    }
    for torch_cls, functional_cls in expected.items():
        assert compat_api.functional_optim_map[torch_cls] is functional_cls


FUNCTIONAL_MODULES = {
    "adadelta": "Adadelta",
    "adagrad": "Adagrad",
    "adam": "Adam",
    "adamax": "Adamax",
    "adamw": "AdamW",
    "rmsprop": "RMSprop",
    "rprop": "Rprop",
    "sgd": "SGD",
}


@pytest.mark.parametrize(("module", "cls"), sorted(FUNCTIONAL_MODULES.items()))
def test_private_functional_names_mirror_torch(module: str, cls: str) -> None:
    name = f"_Functional{cls}"
    theirs = getattr(_import_quietly(f"torch.distributed.optim.functional_{module}"), name)
    ours = getattr(importlib.import_module(f"compat_api.functional_{module}"), name)
    assert getattr(compat_api, name) is ours
    assert compat_api.functional_optim_map[getattr(torch.optim, cls)] is ours
    their_sig, our_sig = inspect.signature(theirs.__init__), inspect.signature(ours.__init__)
    assert [(n, p.default, p.kind) for n, p in our_sig.parameters.items()] == [
        (n, p.default, p.kind) for n, p in their_sig.parameters.items()
    ]
    public = {n for n in dir(theirs) if not n.startswith("__")}
    assert public <= set(dir(ours)), public - set(dir(ours))


def _imported_modules(package_dir: pathlib.Path) -> set[str]:
    modules: set[str] = set()
    for path in package_dir.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules.add(node.module)
    return modules


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("functional_optim", ("torch.distributed", "dist_runtime", "compat_api")),
        ("dist_runtime", ("compat_api",)),
    ],
)
def test_imports_flow_one_way(package: str, forbidden: tuple[str, ...]) -> None:
    imported = _imported_modules(ROOT / "packages" / package / "src" / package)
    offenders = sorted(m for m in imported if m.startswith(forbidden))
    assert offenders == [], f"{package} must not import {offenders}"
