"""Which stagetrain modules a stage script runs, found by reading the sources, and one digest of them.

Snakemake reruns a job when its script changes, but nearly all of a stage's
logic is in the library. Each rule therefore passes, as a param, a digest of
its script and of every stagetrain module it reaches: an edited module reruns
exactly the stages that run it ("Params have changed"). The modules are found
statically (ast), never imported, so the dry run stays fast: `import` and
`from ... import` statements, relative ones included, and string constants that
name a stagetrain module (the training stages start their ranks with
`python -m stagetrain.<stage>.train`). Importing a module runs its packages'
`__init__.py`, so those count too. Data files the library reads (the schema,
the hardware catalog) are not followed.

Parsing the ~100 modules is a fifth of a `snakemake -n`, and every command
builds the DAG, so what each source imports can be kept in a folder between
commands (`kept`), one file per source keyed by its path and bytes: an edited
source is parsed again, an unchanged one is not.
"""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

from stagetrain.io import kept_json

PACKAGE = "stagetrain"


def _module_file(root: Path, name: str) -> Path | None:
    """The file of module `name` (dotted, starting with the package) under `root`, the package's parent."""
    if name != PACKAGE and not name.startswith(PACKAGE + "."):
        return None
    base = root.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _package_inits(root: Path, name: str) -> list[Path]:
    """The `__init__.py` of every package on the way to module `name`."""
    parts = name.split(".")
    inits = (root.joinpath(*parts[:i], "__init__.py") for i in range(1, len(parts)))
    return [p for p in inits if p.is_file()]


def _name(path: Path, root: Path) -> str:
    """A source's name in a digest: its path in the package, or a script's file name."""
    return str(path.relative_to(root) if path.is_relative_to(root) else path.name)


def _imported_names(path: Path, root: Path, kept: Path | None) -> set[str]:
    """Dotted names a source file imports or names in a string (candidates; not all are modules),
    kept in the folder `kept` when given, by the source's name and bytes."""
    data = path.read_bytes()
    if kept is None:
        return _parsed_names(path, root, data)
    key = hashlib.sha256(f"{_name(path, root)}\0".encode() + data).hexdigest()
    return kept_json(
        kept / f"{key}.json", functools.partial(_parsed_names, path, root, data), set, sorted
    )


def _parsed_names(path: Path, root: Path, data: bytes) -> set[str]:
    """`_imported_names`, read from the syntax tree."""
    tree = ast.parse(data, filename=str(path))
    inside = path.is_relative_to(root)  # a script outside the package has no relative imports
    package = ".".join(path.relative_to(root).with_suffix("").parts) if inside else ""
    if inside and path.name != "__init__.py":
        package = package.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and str(node.value).startswith(PACKAGE + "."):
            names.add(str(node.value))
    return names


@functools.cache
def _direct_modules(path: Path, root: Path, kept: Path | None) -> frozenset[Path]:
    """The stagetrain module files one source file reaches directly."""
    found: set[Path] = set()
    for name in _imported_names(path, root, kept):
        module = _module_file(root, name)
        if module:
            found.add(module)
            found.update(_package_inits(root, name))
    return frozenset(found)


def modules_of(script: Path, root: Path, kept: Path | None = None) -> list[Path]:
    """Every stagetrain module file `script` reaches, transitively, sorted (`kept`: see
    `_imported_names`)."""
    seen: set[Path] = set()
    queue = [Path(script).resolve()]
    while queue:
        for module in _direct_modules(queue.pop(), root, kept):
            if module not in seen:
                seen.add(module)
                queue.append(module)
    return sorted(seen)


def code_digest(script: str | Path, root: str | Path, kept: Path | None = None) -> str:
    """sha256 over the script and every module it reaches (relative path and bytes of each).
    `kept`: a folder that keeps what each source imports between processes."""
    root = Path(root).resolve()
    digest = hashlib.sha256()
    for path in [Path(script).resolve(), *modules_of(Path(script), root, kept)]:
        digest.update(f"{_name(path, root)}\0".encode())
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()
