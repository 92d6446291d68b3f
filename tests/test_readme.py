"""README.md and docs/*.md stay true: their python blocks run, links resolve, commands exist.

The ```python blocks of each page run in one fresh interpreter per page (warnings as errors, as
in the suite), each in its own namespace, in the order they appear, in an empty working
directory that must still be empty afterwards. Shell blocks (torchrun commands) are not run; the
import table is checked both ways: torch's path and ours import, and ours is a different object.
The README stays a front page (at most 400 lines); the install section names every dependency
the packages declare, and the examples import nothing their extra does not install.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
TABLE_ROW = re.compile(r"^\| `([\w.]+)` \| `([\w.]+)` \|$", re.MULTILINE)
MAX_README_LINES = 400

_RUNNER = textwrap.dedent(
    """
    import sys, warnings
    blocks = {blocks!r}
    for line, code in blocks:
        print(f"--- {name} block at line {{line}}", flush=True)
        exec(compile(code, f"{name}:{{line}}", "exec"), {{"__name__": "__readme__"}})
    print("--- all blocks ran", flush=True)
    """
)


def python_blocks(text: str = README) -> list[tuple[int, str]]:
    """``(first line, code)`` of every ```python block of ``text`` (the README by default)."""
    return [(text[: m.start(1)].count("\n") + 1, m.group(1)) for m in BLOCK.finditer(text)]


def _pages_with_blocks() -> list[Path]:
    return [page for page in PAGES if python_blocks(page.read_text())]


def _resolve(path: str) -> object:
    """Import ``a.b.C`` and return attribute ``C`` of module ``a.b``."""
    module, _, name = path.rpartition(".")
    with warnings.catch_warnings():
        # torch.distributed.optim's own import declares a TorchScript interface (torch's warning).
        warnings.filterwarnings(
            "ignore", message=r"`torch\.jit\.interface` is deprecated", category=DeprecationWarning
        )
        return getattr(importlib.import_module(module), name)


def run_blocks(blocks: list[tuple[int, str]], name: str, cwd: Path) -> None:
    """Run ``blocks`` in one fresh interpreter in ``cwd``; fail with its output if one raises."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(
        [
            sys.executable,
            *("-W", "error"),
            *("-W", "ignore:`torch.jit.script` is deprecated:DeprecationWarning"),
            # torch's own rpc.init_rpc gathers device maps over a backend object and warns.
            *("-W", "ignore:You are using a Backend:UserWarning"),
            "-c",
            _RUNNER.format(blocks=blocks, name=name),
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert "--- all blocks ran" in proc.stdout


def test_readme_has_a_block_per_layer() -> None:
    assert len(python_blocks()) >= 3


@pytest.mark.parametrize("page", _pages_with_blocks(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_run_and_write_nothing_in_cwd(page: Path, tmp_path: Path) -> None:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    name = page.relative_to(ROOT).as_posix()
    run_blocks(python_blocks(page.read_text()), name, cwd)
    left = sorted(p.relative_to(cwd).as_posix() for p in cwd.rglob("*"))
    assert not left, f"{name}'s blocks left files in the working directory: {left}"


def test_block_runner_fails_on_a_raising_block(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="ZeroDivisionError"):
        run_blocks([(1, "x = 1 / 0\n")], "fake.md", tmp_path)


def test_readme_is_a_front_page() -> None:
    lines = README.count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move details to docs/"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(text: str) -> set[str]:
    headings = re.findall(r"^#+ (.+)$", FENCE.sub("", text), re.MULTILINE)
    return {_slug(h) for h in headings}


def _resolves(page: Path, target: str) -> bool:
    """Whether a link of ``page`` names an existing file (and heading, for ``file.md#anchor``)."""
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.is_file():
        return False
    return not anchor or file.suffix != ".md" or anchor in _anchors(file.read_text())


def broken_links(page: Path) -> list[str]:
    """Relative links of ``page`` (outside code) to a missing file or heading."""
    text = re.sub(r"`[^`\n]*`", "", FENCE.sub("", page.read_text()))
    targets = [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]  # not https:
    return [target for target in targets if not _resolves(page, target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    assert not broken_links(page)


def test_link_check_finds_a_missing_file_and_heading(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Real heading\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md) [ok](b.md#real-heading) [x](missing.md) [y](b.md#nope)\n"
        "`[code](ignored.md)` [web](https://example.com)\n"
    )
    assert broken_links(page) == ["missing.md", "b.md#nope"]


def test_docs_link_every_page_from_the_readme() -> None:
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in LINK.findall(README)}
    assert {page.resolve() for page in DOCS} <= linked, "a docs/ page the README does not link"


def test_import_table_lists_real_drop_ins() -> None:
    rows = TABLE_ROW.findall(README)
    assert len(rows) >= 10
    for torch_path, our_path in rows:
        assert torch_path.startswith("torch."), torch_path
        theirs, ours = _resolve(torch_path), _resolve(our_path)
        assert ours is not theirs, f"{our_path} is torch's own object"
        assert type(ours) is type(theirs) or (callable(ours) and callable(theirs)), our_path
        assert torch_path.rpartition(".")[2].lstrip("_").replace("Functional", "") in our_path


def _optimizer_table() -> list[tuple[str, str, str]]:
    """``(kind, ours, optax's missing)`` rows of the "Building optimizers" table."""
    section = README.split("## Building optimizers", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (.+?) \| (.+?) \| (.+?) \|$", section, re.MULTILINE)
    return [row for row in rows if row[0] not in ("Kind", "---")]


def test_optimizer_table_names_exist_and_cover_every_algorithm() -> None:
    import functional_optim as fo

    rows = _optimizer_table()
    assert len(rows) >= 5
    ours = {name for _, cell, _ in rows for name in re.findall(r"(?<!with )`(\w+)`", cell)}
    missing = {name for _, _, cell in rows for name in re.findall(r"`(\w+)`", cell)}
    assert ours <= set(fo.__all__), sorted(ours - set(fo.__all__))
    assert not missing & set(fo.__all__), sorted(missing & set(fo.__all__))
    algorithms = {a.name for a in fo.ALGORITHMS}
    assert algorithms <= ours, sorted(algorithms - ours)
    assert {f"scale_by_{n}" for n in algorithms if hasattr(fo, f"scale_by_{n}")} <= ours


@pytest.mark.parametrize(
    "text",
    [
        "python -m pip install nox && nox -s demo",
        "\nnox ",
        ".ci/run",
        "--nnodes 2 --node-rank 0",
        "--rdzv-endpoint",
        "--master-addr",
    ],
)
def test_readme_mentions(text: str) -> None:
    assert text in README


def test_ci_runs_nox() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^nox$", script, re.MULTILINE), script


@pytest.mark.parametrize(
    "text",
    ["nox -s bench", "bench-out/REPORT.md", "<!-- BENCHMARKS:START", "<!-- BENCHMARKS:END -->"],
)
def test_benchmarks_page_mentions(text: str) -> None:
    assert text in (ROOT / "docs" / "benchmarks.md").read_text()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_commands_point_at_existing_scripts(page: Path) -> None:
    text = page.read_text()
    for script in set(re.findall(r"((?:examples|benchmarks|tests)/[\w/]+\.(?:py|sh))", text)):
        assert (ROOT / script).is_file(), script


# --- dependencies: the install section names them, the examples' extra covers their imports ---

WORKSPACE = {"functional-optim", "dist-runtime", "compat-api"}
#: import name -> distribution name, where they differ
DISTRIBUTION = {"sklearn": "scikit-learn"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower()


def _pyproject(path: Path) -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project: dict[str, Any] = tomllib.loads(path.read_text())["project"]
    return project


def declared() -> dict[str, set[str]]:
    """package folder -> the third-party distributions it declares (extras included)."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        project = _pyproject(path)
        requirements = list(project.get("dependencies", []))
        for extra in project.get("optional-dependencies", {}).values():
            requirements += extra
        out[path.parent.name] = {_name(r) for r in requirements} - WORKSPACE
    return out


def test_install_section_names_every_dependency() -> None:
    section = README.split("## Install", 1)[1].split("\n## ", 1)[0]
    names = set().union(*declared().values())
    assert {"torch", "optree", "numpy", "scikit-learn", "rich"} <= names
    unnamed = sorted(n for n in names if f"`{n}" not in section)
    assert not unnamed, f"README's Install section does not name {unnamed}"


def third_party_imports(folder: Path) -> set[str]:
    """Distribution names of the non-stdlib, non-workspace modules ``folder/*.py`` import."""
    local = {path.stem for path in folder.glob("*.py")}
    ours = {"functional_optim", "dist_runtime", "compat_api"}
    found: set[str] = set()
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            found |= {module.partition(".")[0] for module in modules}
    found -= local | ours | set(sys.stdlib_module_names) | {"__future__"}
    return {DISTRIBUTION.get(module, module).lower() for module in found}


def test_examples_import_only_what_the_examples_extra_installs() -> None:
    project = _pyproject(ROOT / "packages" / "compat_api" / "pyproject.toml")
    extra = {_name(r) for r in project["optional-dependencies"]["examples"]}
    installed = extra | set().union(*declared().values())
    imports = third_party_imports(ROOT / "examples")
    assert {"scikit-learn", "rich", "torch"} <= imports
    assert imports <= installed, sorted(imports - installed)
    assert {"scikit-learn", "rich", "matplotlib", "numpy"} <= extra


def test_demo_session_installs_the_examples_extra() -> None:
    demo = (ROOT / "noxfile.py").read_text().split("def demo(", 1)[1].split("\n@nox.session", 1)[0]
    assert '"packages/compat_api[examples]"' in demo
