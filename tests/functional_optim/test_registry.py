"""The algorithm registry drives exports, torch state names and the functional map."""

from __future__ import annotations

import inspect
import pathlib
import re
from typing import Any

import pytest
import torch

import compat_api
import functional_optim as fo
from functional_optim._registry import (
    BUILTIN_ALGORITHMS,
    BY_NAME,
    by_torch_name,
    torch_state_names,
)
from functional_optim._torch_state import _TORCH_NAMES


def test_algorithms_is_one_live_table() -> None:
    assert isinstance(fo.ALGORITHMS, fo.AlgorithmTable)
    assert tuple(fo.ALGORITHMS[: len(BUILTIN_ALGORITHMS)]) == BUILTIN_ALGORITHMS
    assert fo.ALGORITHMS[0] is BUILTIN_ALGORITHMS[0]
    assert "adam" in repr(fo.ALGORITHMS)


def test_names_are_unique_and_torch_classes_exist() -> None:
    names = [a.name for a in fo.ALGORITHMS]
    assert len(set(names)) == len(names)
    for algorithm in fo.ALGORITHMS:
        assert issubclass(getattr(torch.optim, algorithm.torch_name), torch.optim.Optimizer)
        assert by_torch_name(algorithm.torch_name) is algorithm
        assert BY_NAME[algorithm.name] is algorithm
    with pytest.raises(KeyError, match=r"torch\.optim\.LBFGSX"):
        by_torch_name("LBFGSX")


def _parts(algorithm: fo.Algorithm) -> list[Any]:
    parts: list[Any] = [algorithm.alias, algorithm.transform, algorithm.state_type]
    if algorithm.functional is not None:
        parts.append(algorithm.functional)
    return parts


@pytest.mark.parametrize("algorithm", BUILTIN_ALGORITHMS, ids=lambda a: a.name)
def test_every_part_is_exported(algorithm: fo.Algorithm) -> None:
    # Static exports: bound in the module namespaces themselves (not served by __getattr__).
    for part in _parts(algorithm):
        assert part.__name__ in fo.__all__, part.__name__
        assert vars(fo).get(part.__name__) is part, part.__name__
    if algorithm.kernel is not None:
        assert algorithm.kernel.__name__ in fo.kernels.__all__
        assert vars(fo.kernels).get(algorithm.kernel.__name__) is algorithm.kernel
    if algorithm.functional is not None:
        assert algorithm.functional.__name__ in fo.functional.__all__
        assert vars(fo.functional).get(algorithm.functional.__name__) is algorithm.functional


def assert_reachable_at_run_time(algorithm: fo.Algorithm) -> None:
    """An algorithm added by ``register_algorithm``: its parts are ``fo.<name>`` (the package's
    ``__getattr__``) and listed by ``dir(fo)``."""
    assert algorithm in fo.ALGORITHMS
    for part in _parts(algorithm):
        assert part.__name__ in dir(fo), part.__name__
        assert getattr(fo, part.__name__) is part, part.__name__


@pytest.mark.parametrize("algorithm", fo.ALGORITHMS, ids=lambda a: a.name)
def test_alias_speaks_torch_names(algorithm: fo.Algorithm) -> None:
    ours = inspect.signature(algorithm.alias).parameters
    theirs = inspect.signature(getattr(torch.optim, algorithm.torch_name).__init__).parameters
    missing = set(theirs) - set(ours) - {"self", "params"} - algorithm.torch_only_args
    assert not missing, f"{algorithm.name} lacks torch's {sorted(missing)}"
    for name in ours:
        assert name in theirs, name


def test_functional_map_is_the_registry() -> None:
    expected = {
        getattr(torch.optim, a.torch_name): a.functional
        for a in fo.ALGORITHMS
        if a.functional is not None
    }
    for key, cls in expected.items():
        assert compat_api.functional_optim_map[key] is cls


def test_torch_state_names_come_from_the_registry() -> None:
    assert torch_state_names() == _TORCH_NAMES
    for algorithm in fo.ALGORITHMS:
        assert algorithm.state_type in _TORCH_NAMES
        assert set(_TORCH_NAMES[algorithm.state_type]) == set(algorithm.state_type._fields)


@pytest.mark.parametrize(
    "algorithm", [a for a in fo.ALGORITHMS if a.kernel is not None], ids=lambda a: a.name
)
def test_kernel_arguments_are_declared_and_drive_the_step(algorithm: fo.Algorithm) -> None:
    spec = algorithm.kernel_spec
    assert spec is not None
    assert algorithm.kernel_spec is spec  # built once: each alias build reads it
    assert len(algorithm.kernel_args) == len(inspect.signature(algorithm.kernel).parameters)


def test_no_alias_module_restates_a_kernel_call() -> None:
    # The fused steps come from the entries' kernel_args: an alias module that calls a kernel
    # itself is a second place to edit. Its entry names the kernel (``kernel=kernels.adam``);
    # nothing else there may use it.
    aliases = pathlib.Path(fo.__file__).parent / "_aliases"
    for path in sorted(aliases.glob("*.py")):
        if path.name == "_kernel_step.py":  # the one generic adapter
            continue
        source = path.read_text()
        calls = re.findall(r"\bkernels\.\w+\(", source)
        calls += re.findall(r"^from functional_optim\.kernels\b.*", source, re.M)
        assert not calls, f"{path.name} calls a kernel itself ({calls}): declare kernel_args"
        assert not re.search(r"^def _\w+_step\(", source, re.M), path.name


def test_fused_step_names_what_is_missing() -> None:
    tx = fo.adam()
    by_name = {a.name: a for a in fo.ALGORITHMS}
    with pytest.raises(TypeError, match=r"takes the hyperparameters \['amsgrad', 'b1'"):
        by_name["adam"].fused(tx, lr=0.1)
    with pytest.raises(ValueError, match="the 'lbfgs' entry declares no kernel"):
        by_name["lbfgs"].fused(tx, lr=0.1)
