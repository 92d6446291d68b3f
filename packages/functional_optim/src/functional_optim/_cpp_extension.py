"""Building the package's C++ CPU kernels: :func:`torch.utils.cpp_extension.load_inline` on
first use (tens of seconds, then cached by torch), or None where no compiler or ``ninja`` is
installed (the ``functional_optim[cpu-kernels]`` extra), so that callers take their torch-op
path instead."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

__all__ = ["EXACT_FLAGS", "ISA_FLAGS", "load"]

_LOG = logging.getLogger(__name__)

#: Floating point exactly as written: each operation rounded once, no fused multiply-add
#: unless the source calls one.
EXACT_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]

#: Instruction sets by torch's CPU capability: not ``-march=native``, so that a build cached in
#: a home directory shared by several machines runs on each machine of that capability.
ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"],
    "AVX2": ["-mavx2", "-mfma"],
}


def load(
    name: str,
    source: str,
    functions: Sequence[str],
    flags: Sequence[str],
    *,
    threads: bool = False,
) -> Any | None:
    """The extension module ``name`` built from ``source`` with ``EXACT_FLAGS + flags``, or
    None (logged) where it cannot be built.

    Args:
        name: the module's name (one per source and flag set: torch caches builds by name).
        source: the C++ source.
        functions: the functions to export.
        flags: extra compiler flags (instruction sets, macros).
        threads: build with OpenMP, so that ``at::parallel_for`` runs on torch's threads;
            where the compiler has no OpenMP (Apple's clang), the module is built without it
            (``<name>_serial``: the loop runs on the calling thread, with the same results).
    """
    if threads:
        module = _build(name, source, functions, [*flags, "-fopenmp"], ["-fopenmp"])
        if module is not None:
            return module
        _LOG.warning("building %s without OpenMP: its loops run on one thread", name)
        name = f"{name}_serial"
    return _build(name, source, functions, flags, [])


def _build(
    name: str, source: str, functions: Sequence[str], flags: Sequence[str], ldflags: list[str]
) -> Any | None:
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(  # type: ignore[no-untyped-call]
            name,
            cpp_sources=[source],
            functions=list(functions),
            extra_cflags=EXACT_FLAGS + list(flags),
            extra_ldflags=ldflags,
            verbose=False,
        )
    except Exception as error:  # no compiler, no ninja, a read-only cache: the torch ops
        _LOG.warning("C++ kernels %s are not available (%s)", name, error)
        return None
