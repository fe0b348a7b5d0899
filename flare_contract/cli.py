"""The command-line convention both tools keep: bad input is one ``error:`` line on stderr and exit 2.

Typer (through click) reports a usage error, such as an unknown option, a
missing argument or a value of the wrong type, in a framed panel of several
lines. ``run_app`` runs a Typer app so that those become one line naming the
problem and the command's ``--help``, like every other bad input of ``flare``
and ``ignition``.
"""

from __future__ import annotations

import sys
from typing import Any

from typer import Abort

try:  # typer from 0.2x carries its own copy of click
    from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError
except ImportError:  # older typer runs on click itself
    from click.exceptions import ClickException, NoArgsIsHelpError, UsageError

EXIT_BAD_INPUT = 2


class BadInput(Exception):
    """Bad input found outside the argument parser (an environment variable, say): ``run_app`` prints its
    message as one line and exits 2, as for a usage error."""


def run_app(app: Any, prog_name: str, args: list[str] | None = None) -> None:
    """Run ``app`` (a ``typer.Typer``) as ``prog_name`` on ``args`` (default: the command line); exit with its code."""
    try:
        code = app(args=args, prog_name=prog_name, standalone_mode=False)
    except NoArgsIsHelpError as exc:  # a bare group or command: its help, as click shows it
        exc.show()
        sys.exit(exc.exit_code)
    except UsageError as exc:
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        print(f"error: {' '.join(exc.format_message().split())}{hint}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except BadInput as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    except ClickException as exc:  # a file option that cannot be opened, and the like
        print(f"error: {' '.join(exc.format_message().split())}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except Abort:
        print("aborted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
