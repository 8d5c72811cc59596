"""argparse pieces the `dynemb` subcommands share: a subcommand declared in one call, and the
flags several commands take with the same meaning (--quiet, --table, --rows-per-shard).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from dynemb.common.names import name_arg


class Parser(argparse.ArgumentParser):
    """argparse's parser, taking no flag for an abbreviation of a longer one: `dynemb ps serve
    --port 8000` was read as `--port-file 8000` (a PS on its default port, writing its ports to
    a file named 8000). Its subcommands' parsers are of this class too (argparse makes them of
    their parent's)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{"allow_abbrev": False, **kwargs})


def add_command(
    sub: argparse._SubParsersAction, name: str, texts: Mapping[str, tuple[str, str]], epilog: str | None = None
) -> argparse.ArgumentParser:
    """Adds subcommand `name` to `sub`, its help text taken from a command's table of them.

    Args:
        sub: the subparsers of the command above.
        name: the subcommand's name.
        texts: subcommand name -> (its line in the command above's list, the description its
            own --help starts with).
        epilog: examples and details for the end of its --help, printed as written (the
            description is then not re-wrapped either); None: argparse's own layout.

    Returns:
        The subcommand's parser, to add its flags to.
    """
    help, description = texts[name]
    if epilog is None:
        return sub.add_parser(name, help=help, description=description)
    return sub.add_parser(
        name, help=help, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_command_group(
    sub: argparse._SubParsersAction, name: str, texts: Mapping[str, tuple[str, str]], epilog: str, dest: str
) -> argparse._SubParsersAction:
    """Adds command `name` (as add_command does) for subcommands, one of which must be given.

    Args:
        sub, name, texts, epilog: as for add_command.
        dest: the attribute of the parsed arguments that names the subcommand given.

    Returns:
        The subparsers to add the subcommands to.
    """
    return add_command(sub, name, texts, epilog).add_subparsers(dest=dest, metavar="COMMAND", required=True)


def quiet_flag(p: argparse.ArgumentParser) -> None:
    """Adds `--quiet`: no progress bars."""
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def table_flag(p: argparse.ArgumentParser, help: str) -> None:
    """Adds `--table NAME`, repeatable: the tables a command works on (`args.table`, a list),
    each a valid name (dynemb/common/names.py), or argparse's one error line."""
    p.add_argument("--table", action="append", default=[], metavar="NAME", type=name_arg(), help=help)


def rows_per_shard_flag(p: argparse.ArgumentParser, help: str) -> None:
    """Adds `--rows-per-shard N` (default 2**20), with `help` followed by the default."""
    p.add_argument("--rows-per-shard", type=int, default=1 << 20, help=help + " [default %(default)s]")
