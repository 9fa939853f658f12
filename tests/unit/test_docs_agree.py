"""What the README and docs/layout.md count and list is what the repository holds.

The number of deliberate differences is counted from the sections of
``docs/decisions.md`` (a new ``D<n>-...`` section changes the count the
README must state), and docs/layout.md must name every module of the
packages it describes (a new file must be named where its folder is).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
LAYOUT = (ROOT / "docs" / "layout.md").read_text()
DECISIONS = (ROOT / "docs" / "decisions.md").read_text()
#: The folders whose every module the Layout section names.
LAID_OUT = ("workspace_manager", "te_integration", "testbed")
NUMBERS = {word: n for n, word in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}


def _number(word: str) -> int:
    assert word.lower() in NUMBERS, f"{word!r} is no number word up to twenty"
    return NUMBERS[word.lower()]


def decision_sections(text: str) -> tuple[list[str], list[str]]:
    """(defaults, options): the numbered sections (``## D<n>-name``); an
    option's name says ``option``."""
    names = re.findall(r"^## (D\d+-[\w-]+)\s*$", text, re.M)
    options = [name for name in names if re.match(r"D\d+-option-", name)]
    return [name for name in names if name not in options], options


def test_the_section_count_reads_defaults_and_options_apart():
    text = "# T\n## D1-a\n## D2-option-b\n## D2-c\ntext\n## Not numbered\n## D10-d \n"
    assert decision_sections(text) == (["D1-a", "D2-c", "D10-d"], ["D2-option-b"])


def test_the_readme_counts_the_differences_decisions_md_has():
    defaults, options = decision_sections(DECISIONS)
    assert defaults and options, "no numbered section found in docs/decisions.md"
    found = re.search(r"decisions except for (\w+) deliberate differences, and (\w+) more that the options "
                      r"switch on", " ".join(README.split()))
    assert found, "the README no longer states the count"
    assert (_number(found.group(1)), _number(found.group(2))) == (len(defaults), len(options)), (defaults, options)


def test_decisions_md_counts_its_own_options():
    _, options = decision_sections(DECISIONS)
    found = re.search(r"(\w+) of them are options of the shipped policies", " ".join(DECISIONS.split()))
    assert found and _number(found.group(1)) == len(options), options


def layout_bullets(layout: str) -> dict[str, str]:
    """Folder (``workspace_manager/testing/``) -> its bullet in docs/layout.md
    (a bullet runs to the next one, or to a blank line)."""
    bullets = {}
    for block in layout.split("\n\n"):
        for bullet in re.split(r"\n(?=- )", block.strip()):
            folder = re.match(r"- `([\w./]+/)`", bullet)
            if folder:
                bullets[folder.group(1)] = bullet
    return bullets


#: Folders whose files register themselves (a module kind is one file there, and adding one
#: touches nothing else): their bullet states the folder's rule instead of naming every file.
SELF_LISTING = {"te_integration/kinds/": "one file per module kind"}


def unnamed_modules(root: Path, readme: str, packages: tuple[str, ...],
                    self_listing: dict[str, str] | None = None) -> list[str]:
    """The ``.py`` files under ``packages`` that the bullet of their folder
    does not name (in backticks); for a folder of ``self_listing``, a bullet
    without its rule names the folder itself as missing."""
    bullets = layout_bullets(readme)
    self_listing = SELF_LISTING if self_listing is None else self_listing
    missing = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            folder = path.parent.relative_to(root).as_posix() + "/"
            bullet = bullets.get(folder, "")
            if folder in self_listing:
                if self_listing[folder] not in " ".join(bullet.split()) and folder not in missing:
                    missing.append(folder)
            elif f"`{path.name}`" not in bullet:
                missing.append(path.relative_to(root).as_posix())
    return missing


def test_the_layout_names_every_module():
    assert all((ROOT / package).is_dir() for package in LAID_OUT)
    assert unnamed_modules(ROOT, LAYOUT, LAID_OUT) == []


def test_a_module_the_layout_does_not_name_is_found(tmp_path):
    for rel in ("pkg/__init__.py", "pkg/named.py", "pkg/sub/other.py", "pkg/forgotten.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    readme = ("# x\n\n- `pkg/`: the package (`__init__.py`), with `named.py` and\n  `other.py`.\n"
              "- `pkg/sub/`: nothing named here.\n\nAfter the list: `forgotten.py`\n")
    assert unnamed_modules(tmp_path, readme, ("pkg",), {}) == ["pkg/forgotten.py", "pkg/sub/other.py"]
    # A self-listing folder needs its rule in its bullet, not its files' names.
    assert unnamed_modules(tmp_path, readme, ("pkg",), {"pkg/sub/": "one file per kind"}) == [
        "pkg/forgotten.py", "pkg/sub/"]
    ruled = readme.replace("nothing named here", "one file per\n  kind, each registering itself")
    assert unnamed_modules(tmp_path, ruled, ("pkg",), {"pkg/sub/": "one file per kind"}) == ["pkg/forgotten.py"]
