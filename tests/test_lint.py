"""The project's own hygiene: ruff, mypy, snakemake --lint, and the README commands CI runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.workflow import REPO, SNAKEMAKE

BIN = Path(sys.executable).parent


def test_ruff_is_clean() -> None:
    proc = subprocess.run(
        [str(BIN / "ruff"), "check", "."], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout


def test_mypy_is_clean() -> None:
    """`mypy` over src/stagetrain as pyproject.toml's [tool.mypy] sets it (the contract modules
    strict): a key misspelt in a stage's TypedDict record, or a field of the wrong type, fails
    here. Its cache is the repository's .mypy_cache, as for `mypy` by hand: about 6 s cold,
    under 1 s warm (docs/development.md)."""
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_snakemake_lint_is_clean() -> None:
    proc = subprocess.run([SNAKEMAKE, "--lint"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Congratulations" in proc.stdout + proc.stderr


def test_ci_runs_the_readme_test_command() -> None:
    """The README opens with the run command and the test command; .ci/run runs the latter."""
    readme = (REPO / "README.md").read_text().splitlines()
    commands = [line for line in readme[:20] if line.startswith("python3.11 -m venv")]
    assert len(commands) == 2, commands
    run, test = commands
    assert "snakemake --cores all" in run
    assert test in (REPO / ".ci" / "run").read_text().splitlines()


def _module_imports(package: Path) -> dict[str, set[str]]:
    """{module: the stagetrain modules it imports at its top level, `if TYPE_CHECKING:` blocks
    included}; an import inside a function runs only when called, so it is left out."""
    import ast

    modules = {
        ".".join(p.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in package.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        statements = [*tree.body, *(s for n in tree.body if isinstance(n, ast.If) for s in n.body)]
        found = set()
        for node in statements:
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names}  # fmt: skip
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_no_import_cycle_in_the_package() -> None:
    """A cycle (grpo.steps <-> grpo.train, over Run) makes one module's meaning depend on which
    is imported first; shared types live in a module both import."""
    graph = _module_imports(REPO / "src" / "stagetrain")
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for other in sorted(graph[module]):
            assert state.get(other) != "open", " -> ".join([*path[path.index(other) :], other])
            if other not in state:
                visit(other, [*path, other])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_ruff_format_is_clean() -> None:
    """The code is ruff-formatted (`ruff format .`); a line it must leave alone says `# fmt: skip`."""
    proc = subprocess.run(
        [str(BIN / "ruff"), "format", "--check", "."], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout
