"""``python -m workspace_manager explain``: print the decision table."""

from __future__ import annotations

import argparse
import sys

from ._explain import POLICY_CHOICES, decision_table, render_json, render_text
from ._profiles import PROFILES, RECIPE_PROFILES


def _profile_choices() -> dict[str, object]:
    choices = dict(PROFILES)
    choices.update(RECIPE_PROFILES)  # recipe names are accepted as aliases
    return choices


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m workspace_manager")
    sub = parser.add_subparsers(dest="command", required=True)
    explain = sub.add_parser("explain", help="print the decision table (policy x setting x quantizer -> plan)")
    explain.add_argument("--json", action="store_true", help="print JSON instead of a text table")
    explain.add_argument(
        "--policy", action="append", choices=POLICY_CHOICES, help="only this policy (repeatable)"
    )
    explain.add_argument(
        "--quantizer",
        action="append",
        choices=sorted(_profile_choices()),
        metavar="PROFILE",
        help="only this quantizer profile or recipe name (repeatable); default: the five TE recipes. "
        f"Choices: {', '.join(sorted(_profile_choices()))}",
    )
    explain.add_argument(
        "--full", action="store_true", help="also vary dgrad and backward_override (a longer table)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    choices = _profile_choices()
    profiles = [choices[q] for q in args.quantizer] if args.quantizer else list(RECIPE_PROFILES.values())
    rows = decision_table(profiles, args.policy, full=args.full)
    sys.stdout.write(render_json(rows) + "\n" if args.json else render_text(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
