"""The `dynemb` command, on top of every part: `ps` (parameter server), `train`, `checkpoint`,
`table` (portable table folders), `tf` (TensorFlow migration), `demo`.
"""

from __future__ import annotations

import argparse
import os
import sys

from dynemb.common.cli_args import Parser
from dynemb.common.version import __version__


def build_parser() -> argparse.ArgumentParser:
    """The parser of the `dynemb` command with every subcommand."""
    parser = Parser(
        prog="dynemb",
        description="dynemb: dynamic-embedding training. Bounded device tables behind an ID "
        "transformer, with every row kept in a parameter server (PS).",
        epilog="Run `dynemb COMMAND --help` for each command's flags.",
    )
    parser.add_argument("--version", action="version", version=f"dynemb {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from dynemb import demo
    from dynemb.checkpoint import cli as checkpoint_cli
    from dynemb.checkpoint import table_cli
    from dynemb.ps_server import cli as ps_cli
    from dynemb.publish import cli as publish_cli
    from dynemb.tf import cli as tf_cli
    from dynemb.trainer import cli as train_cli

    ps_cli.add_parser(sub)
    train_cli.add_parser(sub)
    checkpoint_cli.add_parser(sub)
    publish_cli.add_parser(table_cli.add_parser(sub))
    tf_cli.add_parser(sub)
    demo.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the `dynemb` command.

    Args:
        argv: its arguments [default: sys.argv[1:]].

    Returns:
        The exit status: the subcommand's, 1 for a PSError or UserError (printed as one line),
        130 on Ctrl-C, 141 when stdout's reader went away.
    """
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`dynemb ... | head`): not an error of ours; stop quietly, and keep
        # Python from complaining again when it flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # what a shell reports for a process ended by SIGPIPE
    except Exception as exc:
        from dynemb.common.errors import UserError
        from dynemb.ps_server.errors import PSError

        if isinstance(exc, (PSError, UserError)):  # a clear message is enough; no traceback
            print(f"dynemb: error: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
