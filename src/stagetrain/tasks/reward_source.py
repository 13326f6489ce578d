"""Where a user's reward function comes from, and whether it can take TRL's call.

A `function:` names a file of the user's, `path/to/file.py:name`, or an installed module,
`package.module:name` (`trl.rewards:accuracy_reward`). With `kwargs` the named object is a
factory, called once with them, and what it returns is the reward
(`get_repetition_penalty_reward(ngram_size=2)`).

Every reward is called as TRL calls it, by keyword only (`rewards.KEYWORDS` and the
family's columns), so at DAG time each one's parameters are checked against that call: a
file is read with `ast` and never run (the user's code runs only in the stage), an
installed module is imported and its object's `inspect.signature` read. A function that
could not take the call would otherwise fail only after pretraining, in the first GRPO step.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from stagetrain.errors import StageError

KEYWORDS = (
    "prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric",
    "answer", "level", "finished",
)  # fmt: skip
"""The keywords every reward call passes beside the rows' columns: TRL's, then stagetrain's own."""

MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def parse_function(spec: str, key: str) -> tuple[str, str]:
    """'path/file.py:name' or 'package.module:name' -> (file or module, name), or one line naming `key`."""
    source, sep, name = spec.rpartition(":")
    if sep and name.isidentifier() and (source.endswith(".py") or MODULE.fullmatch(source)):
        return source, name
    raise StageError(
        f"{key}: expected 'path/to/file.py:function_name' or 'package.module:function_name', got {spec!r}"
    )


def is_file(source: str) -> bool:
    """Whether a parsed source is a file of the user's (else an installed module)."""
    return source.endswith(".py")


@dataclass(frozen=True, slots=True)
class Params:
    """What a callable's parameters accept, from `ast` or `inspect` alike."""

    named: frozenset[str]
    """Parameters that can be passed by keyword."""
    required: frozenset[str]
    """Those of them without a default."""
    positional_only: tuple[str, ...]
    """Required parameters that cannot be passed by keyword at all."""
    var_keyword: bool
    """It takes **kwargs."""


def lacks(params: Params, keywords: tuple[str, ...] = KEYWORDS) -> str | None:
    """What keeps a callable of `params` from taking TRL's keyword call, or None. Required
    parameters outside `keywords` are taken for columns of the rows (not known at DAG time)."""
    if params.positional_only:
        return f"it has positional-only parameters ({', '.join(params.positional_only)}): every argument is passed by keyword"
    if params.var_keyword:
        return None
    missing = [k for k in keywords if k not in params.named]
    if missing:
        return f"it lacks **kwargs, or parameters {', '.join(missing)} (every reward is called with them)"
    return None


def ast_params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> Params:
    """A `def`'s parameters, read without running it."""
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    defaulted = {p.arg for p in positional[len(positional) - len(a.defaults) :]}
    defaulted |= {p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None}
    named = [p.arg for p in [*a.args, *a.kwonlyargs]]
    return Params(named=frozenset(named), required=frozenset(named) - defaulted,
                  positional_only=tuple(p.arg for p in a.posonlyargs if p.arg not in defaulted),
                  var_keyword=a.kwarg is not None)  # fmt: skip


def signature_params(function: Callable[..., Any]) -> Params:
    """An imported callable's parameters (a class instance's `__call__`, without self)."""
    ps = list(inspect.signature(function).parameters.values())
    keyword = [p for p in ps if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return Params(named=frozenset(p.name for p in keyword),
                  required=frozenset(p.name for p in keyword if p.default is p.empty),
                  positional_only=tuple(p.name for p in ps if p.kind is p.POSITIONAL_ONLY and p.default is p.empty),
                  var_keyword=any(p.kind is p.VAR_KEYWORD for p in ps))  # fmt: skip


def _refuse(key: str, what: str, params: Params, keywords: tuple[str, ...]) -> None:
    reason = lacks(params, keywords)
    if reason:
        hint = (
            ""
            if params.positional_only or params.named & set(keywords)
            else " (a factory of rewards? give its kwargs)"
        )
        raise StageError(f"config: {key}: {what} cannot take TRL's keyword call: {reason}{hint}")


def _factory(key: str, what: str, params: Params, kwargs: Mapping[str, Any]) -> None:
    """A factory's parameters take `kwargs` by name."""
    unknown = [k for k in kwargs if k not in params.named and not params.var_keyword]
    missing = sorted(params.required - set(kwargs))
    if unknown or missing or params.positional_only:
        wrong = [*(f"no parameter {k!r}" for k in unknown), *(f"no value for {k!r}" for k in missing),
                 *(f"positional-only {k!r}" for k in params.positional_only)]  # fmt: skip
        raise StageError(
            f"config: {key}: {what} cannot be called with kwargs {dict(kwargs)!r} ({'; '.join(wrong)})"
        )


def _file_tree(path: str, key: str) -> ast.Module:
    try:
        return ast.parse(Path(path).read_bytes(), filename=path)
    except FileNotFoundError:
        raise StageError(f"config: {key}: no such reward file {path!r}") from None
    except (OSError, SyntaxError, ValueError) as err:
        line = f" line {err.lineno}" if isinstance(err, SyntaxError) else ""
        raise StageError(
            f"config: {key}: cannot read reward file {path!r}{line} ({getattr(err, 'msg', err)})"
        ) from None


def _top_level(tree: ast.Module) -> dict[str, ast.AST]:
    """A file's top-level names: defs, assignments and imports (`from mylib import score`)."""
    out: dict[str, ast.AST] = {}
    for n in tree.body:
        if isinstance(n, ast.Assign):
            out.update({t.id: n for t in n.targets if isinstance(t, ast.Name)})
        elif isinstance(n, ast.Import | ast.ImportFrom):
            out.update({(a.asname or a.name).split(".")[0]: n for a in n.names})
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out[n.name] = n
    return out


def _check_file(
    path: str, name: str, key: str, kwargs: Mapping[str, Any] | None, keywords: tuple[str, ...]
) -> None:
    """The file defines `name`; a `def` of it takes the call (or, a factory, its kwargs)."""
    defined = _top_level(_file_tree(path, key))
    node = defined.get(name)
    if node is None:
        shown = ", ".join(sorted(defined)) or "none"
        raise StageError(
            f"config: {key}: {path} defines no function {name!r} (its top-level names: {shown})"
        )
    if isinstance(node, ast.ClassDef):
        raise StageError(f"config: {key}: {path}:{name} is a class, expected a function")
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        if kwargs is None:
            _refuse(key, f"{path}:{name}", ast_params(node), keywords)
        else:
            _factory(key, f"{path}:{name}", ast_params(node), kwargs)
    elif isinstance(node, ast.Import):
        raise StageError(
            f"config: {key}: {path}:{name} is a module the file imports, expected a function"
        )
    elif isinstance(node, ast.ImportFrom) and _environment_module(node):
        original = next(a.name for a in node.names if (a.asname or a.name) == name)
        _check_installed(f"{node.module}", original, key, kwargs, keywords)
    # an assigned name, or one imported from a module of the user's, is only known by running
    # the file: checked in the stage


def _environment_module(node: ast.ImportFrom) -> bool:
    """Whether `from module import ...` names a module of the environment (the standard library
    or an installed distribution), which DAG time may import as it imports `module:name`
    rewards; a module of the user's is their code, run only by the stage."""
    if node.level or not node.module:
        return False
    top = node.module.split(".")[0]
    return top in sys.stdlib_module_names or top in importlib.metadata.packages_distributions()


def _check_installed(module: str, name: str, key: str, kwargs: Mapping[str, Any] | None,
                     keywords: tuple[str, ...]) -> None:  # fmt: skip
    """An installed module's `name` is a function that takes the call (a factory's product too)."""
    found = import_object(module, name, f"config: {key}")
    what = f"{module}:{name}"
    if kwargs is not None:
        _factory(key, what, signature_params(found), kwargs)
        found = made(found, kwargs, f"config: {key}: {what}")
    _refuse(key, what, signature_params(found), keywords)


def import_object(module: str, name: str, key: str) -> Any:
    """`module.name` of an installed module, every failure one line naming `key`."""
    try:
        imported = importlib.import_module(module)
    except Exception as err:
        raise StageError(f"{key}: cannot import module {module!r} ({one_line(err)})") from None
    if not hasattr(imported, name):
        raise StageError(f"{key}: module {module!r} has no attribute {name!r}")
    found = getattr(imported, name)
    if not (inspect.isfunction(found) or inspect.isbuiltin(found)):
        raise StageError(f"{key}: {module}:{name} is a {type(found).__name__}, expected a function")
    return found


def made(
    function: Callable[..., Any], kwargs: Mapping[str, Any] | None, label: str
) -> Callable[..., Any]:
    """The reward itself: `function`, or what the factory `function(**kwargs)` returns."""
    if kwargs is None:
        return function
    try:
        reward = function(**kwargs)
    except Exception as err:
        raise StageError(f"{label}: the factory raised {one_line(err)}") from None
    if not callable(reward):
        raise StageError(
            f"{label}: the factory returned {type(reward).__name__}, expected a function"
        )
    return reward


def check_function(spec: str, key: str, kwargs: Mapping[str, Any] | None = None,
                   keywords: tuple[str, ...] = KEYWORDS) -> str | None:  # fmt: skip
    """At DAG time: the reward of `spec` exists and can take TRL's call. A file is read with
    `ast` only, and its path returned (a declared input of GRPO); a module is imported, and
    its object's signature (a factory's: called with `kwargs`, its result's) read: None."""
    source, name = parse_function(spec, key)
    if is_file(source):
        _check_file(source, name, key, kwargs, keywords)
        return source
    _check_installed(source, name, key, kwargs, keywords)
    return None


@cache
def _module(path: str) -> Any:
    """The reward file imported once per process, under a name of its own."""
    resolved = Path(path).resolve()
    name = "stagetrain_reward_" + hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise StageError(f"{path}: cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except FileNotFoundError:
        raise StageError(f"{path}: no such reward file") from None
    except Exception as err:
        del sys.modules[name]
        raise StageError(f"{path}: importing the reward file failed ({one_line(err)})") from None
    return module


def load_function(
    spec: str, key: str, kwargs: Mapping[str, Any] | None = None
) -> Callable[..., Any]:
    """The user's reward of `spec`, imported (and made by its factory where `kwargs` is given)."""
    source, name = parse_function(spec, key)
    if is_file(source):
        function = getattr(_module(source), name, None)
        if not callable(function):
            raise StageError(f"{key}: {source} has no function {name!r}")
    else:
        function = import_object(source, name, key)
    return made(function, kwargs, f"{key}: {spec}")


def one_line(err: BaseException) -> str:
    """An exception as 'Type: first line of its message'."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
