"""Suite-wide settings: strict numerics, Hypothesis profiles, GPU skips, gloo world fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

from tests._world import World

settings.register_profile(
    "default",
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough", deadline=None, max_examples=500, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Strict numerics for the whole suite: deterministic kernels, no TF32 on GPU.
torch.use_deterministic_algorithms(True, warn_only=True)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build the C++ kernels (the low-bit Adam step, ``pure_step``'s out-of-place kernels) once,
    before any test spawns ranks that would wait on one another's build (about 30 s each on a
    fresh machine; cached by torch afterwards)."""
    try:
        import ninja  # noqa: F401
    except ImportError:
        return
    from functional_optim._lowbit import fused_cpu
    from functional_optim._out_of_place import cpu_extension

    fused_cpu.extension()
    cpu_extension.extension()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out the ``compile_matrix`` set unless ``-m`` asks for it (``nox -s compile``);
    skip tests marked ``gpu`` when CUDA is absent (they run for real where a GPU is lent)."""
    if "compile_matrix" not in (config.getoption("markexpr", "") or ""):
        matrix = [item for item in items if "compile_matrix" in item.keywords]
        if matrix:
            config.hook.pytest_deselected(items=matrix)
            items[:] = [item for item in items if "compile_matrix" not in item.keywords]
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# One gloo world per test module that asks for it (spawning is slow: each module reuses its own).
@pytest.fixture(scope="module")
def world2() -> Iterator[World]:
    """A 2-rank gloo world on 127.0.0.1, shared by the tests of one module."""
    with World(2) as world:
        yield world


@pytest.fixture(scope="module")
def world3() -> Iterator[World]:
    """A 3-rank gloo world on 127.0.0.1, shared by the tests of one module."""
    with World(3) as world:
        yield world
