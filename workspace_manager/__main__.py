"""``python -m workspace_manager explain`` (or ``workspace-manager explain``): print the decision table.

The legend's last line names the module kinds the plans apply to, as bindings
register them in the process (``register_module_kind``; ``te_integration``
does when imported). Run on its own the command imports no binding, so that
line says the plans hold for every module call alike and that no binding
registered its kinds; the table is the same either way.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable

from ._explain import POLICY_CHOICES
from ._explain_layout import MIN_WIDTH, explain, profile_choices
from ._profiles import PROFILES, RECIPE_PROFILES

#: The default --width: a terminal's. The plan columns fit; the quantizers
#: that share a plan go on a line above it where they do not fit beside it.
DEFAULT_WIDTH = 80
#: The status of a command that SIGPIPE stopped (128 + 13), which shells and
#: ``set -o pipefail`` scripts expect from ``explain | head``.
BROKEN_PIPE_STATUS = 141


def _case_insensitive(what: str, names: Iterable[str]) -> Callable[[str], str]:
    """An argparse ``type`` that maps any spelling of a name to its canonical one."""
    canonical = {n.lower(): n for n in names}

    def parse(value: str) -> str:
        try:
            return canonical[value.lower()]
        except KeyError:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {value!r} is no {what} (choose from {', '.join(canonical.values())}; "
                "any case)"
            ) from None

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def _width(value: str) -> int:
    try:
        width = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of columns, received {value!r}") from None
    if width < MIN_WIDTH:
        raise argparse.ArgumentTypeError(f"expected at least {MIN_WIDTH} columns, received {width}")
    return width


#: The subcommands, in the order ``--help`` lists them.
COMMANDS = ("explain",)
#: The program's name when it runs as ``python -m workspace_manager`` (or from Python, ``main([...])``).
MODULE_PROG = "python -m workspace_manager"


def program_name(argv0: str | None = None) -> str:
    """The name the program was started by, for its usage and errors: the
    console script's (``workspace-manager``), else ``python -m workspace_manager``."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    name = os.path.basename(argv0 or "")
    return MODULE_PROG if name in ("", "__main__.py", "-c") or name.endswith(".py") else name


def build_parser(prog: str = MODULE_PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Explicit lifetimes for TransformerEngine's quantized weight workspaces.",
        epilog=f"Start with: {prog} explain --policy fsdp2",
    )
    sub = parser.add_subparsers(dest="command", title="subcommands", metavar="COMMAND")
    explain = sub.add_parser("explain", help="print the decision table (policy x setting x quantizer -> plan)")
    explain.add_argument("--json", action="store_true", help="print JSON instead of a text table")
    explain.add_argument(
        "--policy", action="append", type=_case_insensitive("policy", POLICY_CHOICES), metavar="POLICY",
        help=f"only this policy (repeatable, any case): {', '.join(POLICY_CHOICES)}",
    )
    explain.add_argument(
        "--recipe", action="append", type=_case_insensitive("recipe", RECIPE_PROFILES), metavar="RECIPE",
        help=f"only this TE recipe's weight quantizer (repeatable, any case): {', '.join(RECIPE_PROFILES)}",
    )
    explain.add_argument(
        "--quantizer", action="append", type=_case_insensitive("quantizer", profile_choices()), metavar="PROFILE",
        help="only this capability profile or recipe (repeatable, any case); default: the five TE recipes. "
        f"Profiles: {', '.join(PROFILES)}",
    )
    explain.add_argument(
        "--full", action="store_true",
        help="also vary dgrad and backward_override, and merge no rows (a much longer table)"
    )
    explain.add_argument(
        "--gather", action="store_true",
        help="also the FSDP2 settings with a quantized all-gather set up (gather:...), where the plan says whether "
        "the workspace is made from the shard before the all-gather (cache cell 'shard'); --full includes them",
    )
    explain.add_argument("--why", action="store_true", help="print each plan's reasons under it")
    explain.add_argument(
        "--width", type=_width, default=DEFAULT_WIDTH,
        help=f"wrap the text to this many columns (default {DEFAULT_WIDTH}, at least {MIN_WIDTH})",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (default: the process's arguments, the
    program named as it was started; given ``argv``, as ``python -m
    workspace_manager``). Returns the exit status."""
    parser = build_parser(program_name() if argv is None else MODULE_PROG)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.error(f"choose a subcommand: {', '.join(COMMANDS)} (e.g. '{parser.prog} explain')")
    return emit(explain(args.policy, args.recipe, args.quantizer, full=args.full, why=args.why, width=args.width,
                        as_json=args.json, gather=args.gather), parser.prog)


def emit(text: str, prog: str = MODULE_PROG) -> int:
    """Write ``text`` to stdout; the exit status. A reader that went away
    (``explain | head``) or a full disk ends the command with a shell's
    status and no traceback: 141 as if SIGPIPE stopped it, or 1 with one
    line on stderr."""
    if sys.stdout is None:  # started with stdout closed (``>&-``)
        sys.stderr.write(f"{prog}: stdout is closed; nothing was written\n")
        return 1
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        _discard_stdout()
        return BROKEN_PIPE_STATUS
    except OSError as err:
        _discard_stdout()
        sys.stderr.write(f"{prog}: could not write the output: {err.strerror or err}\n")
        return 1
    return 0


def _discard_stdout() -> None:
    """Point stdout at /dev/null: Python flushes it once more at exit, and
    what its buffer still holds would fail there, after ``main`` returned."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
