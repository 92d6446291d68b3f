"""Building the C++ kernels: with OpenMP where the compiler has it, else serially, else none."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from functional_optim import _cpp_extension


class _Compiler:
    """Stands in for ``load_inline``: records each build, fails those it is told to."""

    def __init__(self, fails: Sequence[str]) -> None:
        self.fails = fails
        self.builds: list[tuple[str, list[str], list[str]]] = []

    def __call__(
        self, name: str, source: str, functions: Sequence[str], flags: Sequence[str], ld: list[str]
    ) -> Any:
        self.builds.append((name, list(flags), ld))
        if any(f in self.fails for f in [*flags, "any"]):
            return None
        return f"module {name}"


@pytest.mark.parametrize(
    ("fails", "expected", "names"),
    [
        ((), "module k", ["k"]),
        (("-fopenmp",), "module k_serial", ["k", "k_serial"]),
        (("any",), None, ["k", "k_serial"]),
    ],
    ids=["openmp", "no openmp: serial", "no compiler"],
)
def test_threads_fall_back_to_a_serial_build(
    fails: Sequence[str], expected: Any, names: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    compiler = _Compiler(fails)
    monkeypatch.setattr(_cpp_extension, "_build", compiler)
    assert _cpp_extension.load("k", "src", ["f"], ["-mavx2"], threads=True) == expected
    assert [b[0] for b in compiler.builds] == names
    assert compiler.builds[0][1] == ["-mavx2", "-fopenmp"]
    assert compiler.builds[0][2] == ["-fopenmp"]
    if len(names) > 1:
        assert compiler.builds[1][1:] == (["-mavx2"], [])


def test_a_build_without_threads_is_tried_once(monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = _Compiler(("any",))
    monkeypatch.setattr(_cpp_extension, "_build", compiler)
    assert _cpp_extension.load("k", "src", ["f"], []) is None
    assert compiler.builds == [("k", [], [])]
