"""One-line errors for the config files named on Snakemake's command line.

Snakemake reads every `--configfile` while it parses its command line, before
the Snakefile runs, and reports a bad one without naming it: "Config file is not
valid JSON or YAML" for a syntax error, "must be given ... with keys at top
level" for an empty file or a list, a traceback for a missing file or a folder.
The workflow profile is the one file of the workflow that Snakemake reads before
them, so each profile under profiles/ calls `check_command_line` (through yte's
`__definitions__`, which Snakemake evaluates in profiles); the Snakefile calls
`check` on every config file it uses, for runs without a profile.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from stagetrain.config import validation as stconfig
from stagetrain.errors import StageError

CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def check(paths: Iterable[str | Path], option: str = "") -> None:
    """Parse each file strictly; on the first bad one, exit with one line naming it.

    `option` prefixes the line (e.g. "--configfile ") to say where the name came from.
    """
    for path in paths:
        try:
            stconfig.read_file(path)
        except StageError as err:
            hint = ""
            if not Path(path).exists() and Path(path).suffix not in CONFIG_SUFFIXES:
                hint = (
                    " (a target written after --configfile is read as one more config file: "
                    "put targets before --configfile, or write -- before them)"
                )
            sys.exit(f"error: {option}{err}{hint}")


def _check_config_entry(entry: str) -> None:
    """`--config KEY=VALUE` sets a top-level key; a dotted key (`pretrain.steps=5`) ends in
    Snakemake's traceback ("Config entry must start with a valid identifier"). Say what works."""
    key, _, value = entry.partition("=")
    if "." in key:
        section, _, rest = key.partition(".")
        sys.exit(
            f"error: --config {entry}: --config takes top-level keys only (KEY=VALUE, no dots); put the key "
            f"in a file instead, `{section}: {{{rest}: {value}}}`, and pass --configfile config/config.yaml that-file.yaml"
        )


def check_command_line(argv: Sequence[str] | None = None) -> None:
    """Check the --config entries and --configfile files of this Snakemake process's command
    line, as Snakemake's own parser reads them (the profile hook). Building that parser takes
    ~0.2 s, so it is built only for a command line that has either, and once."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(arg.startswith(("--config", "-C")) for arg in argv):
        return
    from snakemake.cli import get_argument_parser  # the profile hook runs inside Snakemake

    args, _ = get_argument_parser().parse_known_args(argv)
    for entry in args.config or []:
        _check_config_entry(str(entry))
    check([str(path) for path in args.configfile or []], "--configfile ")
