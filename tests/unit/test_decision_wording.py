"""One statement says which plan fields answer which of the four decisions.

It lives in [Note: workspace lifetime] (``workspace_manager/_policy.py``);
``_plan.py`` links it. These tests fail when a plan field or a policy method
is added, removed or renamed without the statement following, and when
another text states a count of decisions that is no longer true.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import workspace_manager._plan as plan_module
import workspace_manager._policy as policy_module
from workspace_manager import WorkspacePlan, WorkspacePolicy

ROOT = Path(__file__).resolve().parents[2]
DECISIONS = ("cache", "forward usage", "backward", "release")
NUMBERS = {4: "four", 6: "six", 7: "seven", 8: "eight"}


def _note_mapping() -> dict[str, set[str]]:
    """Decision -> plan fields, read from the numbered list in the note."""
    doc = policy_module.__doc__
    block = doc[doc.index("[Note: workspace lifetime]"): doc.index("The life per policy")]
    mapping: dict[str, set[str]] = {}
    for match in re.finditer(r"^\s+\d\. ([a-z ]+):(.*?)(?=^\s+\d\. |\n\n|\Z)", block, re.M | re.S):
        mapping[match.group(1).strip()] = set(re.findall(r"``(\w+)``", match.group(2)))
    return mapping


def _plan_fields() -> set[str]:
    return {f.name for f in fields(WorkspacePlan)} - {"notes"}


def test_the_note_maps_every_plan_field_to_one_of_the_four_decisions():
    mapping = _note_mapping()
    assert tuple(mapping) == DECISIONS
    listed = [name for names in mapping.values() for name in names]
    assert sorted(listed) == sorted(_plan_fields()), "each plan field under exactly one decision"


def test_the_counts_in_the_wording_are_the_real_counts():
    sentence = f"answers the four decisions in {NUMBERS[len(_plan_fields())]} fields"
    assert sentence in " ".join(policy_module.__doc__.split())
    # the plan module links the note instead of saying it again
    assert "[Note: workspace lifetime]" in plan_module.__doc__ and sentence not in " ".join(plan_module.__doc__.split())
    methods = re.search(r"through\s+(\w+) methods", policy_module.__doc__).group(1)
    named = re.search(r"one per chosen field: (.*?)\.\n", policy_module.__doc__, re.S).group(1)
    names = re.findall(r"``(\w+)``", named)
    assert methods == NUMBERS[len(names)]
    assert all(callable(getattr(WorkspacePolicy, name)) for name in names)
    # Every chosen field has its method; backward_usage follows from the source.
    assert set(names) == _plan_fields() - {"backward_usage", "cache"} | {"cache_action"}


def test_no_other_count_of_decisions_or_questions_remains():
    texts = {
        "README.md": (ROOT / "README.md").read_text(),
        "_plan.py": Path(plan_module.__file__).read_text(),
        "_policy.py": Path(policy_module.__file__).read_text(),
    }
    stale = re.compile(r"\b(three|five|six|seven|eight) (decisions|questions)\b|\bfour questions\b", re.I)
    for name, text in texts.items():
        assert not stale.findall(text), (name, stale.findall(text))
