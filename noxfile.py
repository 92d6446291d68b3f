"""Workspace sessions: `nox` runs lint, typecheck, tests; `nox -s demo`, `nox -s bench`."""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = False

PACKAGES = [
    # [cpu-kernels]: ninja, to build the one-pass C++ step of 8-bit Adam on CPU
    "packages/functional_optim[cpu-kernels]",
    "packages/dist_runtime",
    "packages/compat_api",
]
CONSTRAINTS = ("-c", "constraints.txt")
PYTHON_DIRS = [
    path
    for path in ("packages", "tests", "benchmarks", "examples", "noxfile.py")
    if Path(path).exists()
]


def _install_workspace(session: nox.Session, *extra: str) -> None:
    """Install torch (pinned), the three packages editable, and ``extra`` requirements."""
    session.install(*CONSTRAINTS, "torch==2.13.0")
    editable: list[str] = []
    for package in PACKAGES:
        editable += ["-e", package]
    session.install(*CONSTRAINTS, *editable, *extra)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install("ruff")
    session.run("ruff", "check", *PYTHON_DIRS)
    session.run("ruff", "format", "--check", *PYTHON_DIRS)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict over packages/."""
    _install_workspace(session, "mypy")
    session.run(
        "mypy",
        "packages/functional_optim/src/functional_optim",
        "packages/dist_runtime/src/dist_runtime",
        "packages/compat_api/src/compat_api",
    )


@nox.session
def tests(session: nox.Session) -> None:
    """pytest over tests/ (distributed tests included; GPU tests skip without CUDA)."""
    # compat_api's [examples] extra: what the examples the tests run import (scikit-learn, rich,
    # matplotlib, numpy).
    _install_workspace(
        session, "-e", "packages/compat_api[examples]", "pytest", "pytest-timeout", "hypothesis"
    )
    session.run("pytest", *session.posargs, env={"OMP_NUM_THREADS": "1"})


@nox.session
def compile(session: nox.Session) -> None:
    """torch.compile (aot_eager) of every alias, against eager: the full compile matrix."""
    _install_workspace(session, "pytest", "pytest-timeout", "hypothesis")
    session.run(
        "pytest",
        "tests/functional_optim/test_compile.py",
        "-m",
        "compile or compile_matrix",
        "-s",
        *session.posargs,
        env={"OMP_NUM_THREADS": "1"},
    )


@nox.session
def demo(session: nox.Session) -> None:
    """Train a digits classifier on 2 processes: ZeRO, post-local SGD, RPC optimizer."""
    # compat_api's [examples] extra: scikit-learn (the digits), rich, matplotlib, numpy.
    _install_workspace(session, "-e", "packages/compat_api[examples]")
    session.run("python", "examples/demo.py", *session.posargs, env={"OMP_NUM_THREADS": "1"})


@nox.session
def bench(session: nox.Session) -> None:
    """Run every benchmark side by side with torch and write one markdown report."""
    # scikit-learn: benchmarks that train on its bundled digits data set.
    _install_workspace(session, "matplotlib", "scikit-learn")
    # fairscale: the peer row of benchmarks/zero_peers.py (skipped with a note without it).
    session.install(*CONSTRAINTS, "fairscale==0.4.13")
    # torchao, bitsandbytes: the peer rows of benchmarks/lowbit_states.py (reported without them).
    session.install(*CONSTRAINTS, "torchao==0.18.0", "bitsandbytes==0.50.2")
    # torchft: the peer row of benchmarks/lm_diloco.py (skipped with a note without it).
    session.install(*CONSTRAINTS, "torchft==0.2.0")
    # torchtitan (DistMuon), muon_fsdp2: the peer rows of benchmarks/sharded_muon.py (reported
    # with their error where they cannot run). --no-deps: torchtitan declares a training stack
    # (datasets, wandb, tensorboard, torchdata, ...) that its optimizer never imports; the import
    # of torchtitan.distributed needs only spmd_types and tyro (docstring-parser, typeguard).
    session.install(
        *CONSTRAINTS, "--no-deps", "torchtitan==0.3.0", "spmd_types==0.2.3", "muon_fsdp2==0.3.0",
        "tyro==1.0.17", "docstring-parser==0.18.0", "typeguard==4.6.1",
    )  # fmt: skip
    session.run("python", "benchmarks/run_all.py", *session.posargs)
