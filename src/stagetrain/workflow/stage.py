"""The edge every stage script shares: inputs, config sections, outputs, logging, errors.

A stage script runs in two ways, with the same checks:
- under Snakemake (`script:` directive), reading `snakemake.input`, `.params`
  (the config sections the rule passes) and `.output`, and logging to `log[0]`;
- on its own, `python scripts/<stage>.py --config FILE --<input> PATH --<output> PATH`,
  validating the whole config file first.
Either way, a `StageError` becomes one line on stderr and in the log, and exit 1.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagetrain.config import validation as cfg
from stagetrain.config.settings import Settings
from stagetrain.errors import StageError
from stagetrain.io import atomic_write_json, read_json
from stagetrain.workflow import checks

log = logging.getLogger("stagetrain")


@dataclass(frozen=True, slots=True)
class StageIO:
    """Paths and validated config sections of one stage run."""

    inputs: dict[str, str]
    outputs: dict[str, str]
    sections: dict[str, dict[str, Any]]

    def read_input(self, name: str) -> Any:
        """A JSON input artifact."""
        return read_json(self.inputs[name])

    def write_output(self, name: str, obj: Any) -> None:
        """Write a JSON output artifact atomically."""
        atomic_write_json(self.outputs[name], obj)


def _setup_logging(log_file: str | None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_file:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_file, mode="w", encoding="utf-8"))
    logging.basicConfig(level=logging.INFO, format="%(message)s", handlers=handlers, force=True)


def _from_snakemake(smk: Any, sections: Mapping[str, str]) -> StageIO:
    _setup_logging(str(smk.log[0]) if smk.log else None)
    return StageIO(
        inputs={k: str(v) for k, v in smk.input.items()},
        outputs={k: str(v) for k, v in smk.output.items()},
        sections={p: cfg.validate_section(s, smk.params[p]) for p, s in sections.items()},
    )


def _from_cli(
    doc: str, inputs: Sequence[str], outputs: Sequence[str], sections: Mapping[str, str]
) -> StageIO:
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="the run's YAML config")
    for name in (*inputs, *outputs):
        parser.add_argument(f"--{name.replace('_', '-')}", required=True, dest=name)
    parser.add_argument("--log", default=None, help="also write the log here")
    args = parser.parse_args()
    _setup_logging(args.log)
    full = cfg.load(args.config)
    checks.check(Settings.from_config(full), source=args.config)
    return StageIO(
        inputs={k: getattr(args, k) for k in inputs},
        outputs={k: getattr(args, k) for k in outputs},
        sections={p: full[s] for p, s in sections.items()},
    )


def run_stage(
    main: Callable[[StageIO], None],
    *,
    snakemake: Any,
    doc: str,
    inputs: Sequence[str] = (),
    outputs: Sequence[str] = (),
    sections: Sequence[str] | Mapping[str, str] = (),
) -> None:
    """Run `main` with the stage's IO, turning bad input into one line and exit status 1.

    `sections` names the config sections the stage reads; a mapping renames a
    rule param to the section it holds (e.g. {"training": "grpo"}).
    """
    if not isinstance(sections, Mapping):
        sections = {name: name for name in sections}
    try:
        if snakemake is not None:
            io = _from_snakemake(snakemake, sections)
        else:
            io = _from_cli(doc, inputs, outputs, sections)
        main(io)
    except StageError as err:
        if not logging.getLogger().handlers:
            _setup_logging(None)
        log.error("error: %s", err)
        sys.exit(1)


def training_stage(snakemake: Any) -> str:
    """The `stage` wildcard under Snakemake, or `--stage` on the command line (taken off argv)."""
    if snakemake is not None:
        return snakemake.wildcards.stage
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--stage", choices=["pretrain", "grpo"], required=True)
    args, rest = parser.parse_known_args()
    sys.argv[1:] = rest
    return args.stage
