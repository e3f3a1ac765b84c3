"""The `c2jax` command line.

Each subcommand is a module with `add_parser(subparsers)`, returning its argparse parser, and
`run(args)`, returning an exit status. Commands of this package are listed in COMMANDS; packages
above c2jax in the layering (rl, experiments) register theirs as entry points in the
`c2jax.commands` group of pyproject.toml, so that c2jax never imports upward. Keep heavy imports
(jax, models) inside `run`, so that `c2jax --help` and `c2jax config` stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import entry_points

from c2jax.config import ConfigError

COMMANDS = (
    "c2jax.config",  # c2jax config PRESET_OR_YAML [key=value ...]
    "c2jax.info",  # c2jax info PRESET_OR_YAML [key=value ...]
    "c2jax.plan",  # c2jax plan PRESET_OR_YAML --devices N --mesh fsdp=8,expert=8
    "c2jax.data.tokenizer_cli",  # c2jax tokenizer train --corpus DIR --vocab-size N --out DIR
    "c2jax.train.cli",  # c2jax pretrain --config YAML [key=value ...]
)


ENTRY_POINT_GROUP = "c2jax.commands"


def command_modules() -> list[str]:
    """This package's commands, then those other installed packages register as entry points."""
    registered = sorted(ep.value for ep in entry_points(group=ENTRY_POINT_GROUP))
    return list(COMMANDS) + [name for name in registered if name not in COMMANDS]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="c2jax", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    registered = {ep.value: ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    for name in command_modules():
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            if name in COMMANDS:
                raise
            # a broken plugin from an upper layer must not take `c2jax info` etc. down with it; its own
            # subcommand still fails, loudly, with the import error
            _unavailable(subparsers, registered.get(name, name.rsplit(".", 1)[-1]), name, e)
            continue
        module.add_parser(subparsers).set_defaults(run=module.run)
    return parser


def _unavailable(subparsers, command: str, module: str, error: ImportError) -> None:
    reason = f"{module} failed to import: {error}"
    sub = subparsers.add_parser(command, help=f"(unavailable: {reason})", add_help=False)

    def run(args) -> int:
        print(f"error: c2jax {command}: {reason}", file=sys.stderr)
        return 2

    sub.set_defaults(run=run, unavailable=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "unavailable", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.run(args) or 0
    except ConfigError as e:
        # a config mistake is the user's to fix: say what and where, without a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
