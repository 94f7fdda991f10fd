"""The documentation cannot drift: docs/config.md is generated from the config's fields, the
README stays a front door, and every relative link in README.md and docs/ leads somewhere."""

import re
from pathlib import Path

from spmd3d import config

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REGENERATE = (""".venv/bin/python -c "from spmd3d.config import reference_markdown as r; """
              """open('docs/config.md', 'w').write(r())\"""")


def test_config_reference_is_generated_from_the_fields():
    page = ROOT / "docs" / "config.md"
    assert page.is_file() and page.read_text() == config.reference_markdown(), (
        f"docs/config.md is not config.reference_markdown(); regenerate it from the repository "
        f"root with: {REGENERATE}")


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: the long form goes to docs/"


def test_readme_tour_links_every_module():
    """A newcomer's map has no blank: each module of the package (a package's `__init__` and
    command entry points aside) is linked from the README."""
    readme = (ROOT / "README.md").read_text()
    modules = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "spmd3d").rglob("*.py"))
               if p.name not in ("__init__.py", "__main__.py")]
    missing = [m for m in modules if f"]({m})" not in readme]
    assert not missing, f"README.md's tour does not link {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#+ +(.+?) *$", text, flags=re.M)}


def _links(page: Path) -> list[str]:
    """Link targets of a Markdown page outside code blocks and code spans."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_every_relative_link_points_to_a_file():
    broken = []
    for page in PAGES:
        for target in _links(page):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
