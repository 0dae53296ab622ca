"""The README and ``docs/``: every relative link and anchor resolves, and the configuration page lists every setting.

Fast and pure (no broker, no Spark): it reads Markdown files only. Anchors are GitHub's: a heading's text, lowercased,
without punctuation, spaces as hyphens, ``-1``, ``-2`` ... for repeats; an explicit ``<a id="...">`` counts too.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

import pytest

from rebound.settings import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
CONFIGURATION = ROOT / "docs" / "configuration.md"
OTHER_COMMANDS_HEADING = "Read by other commands"

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.IGNORECASE)
_MARKDOWN_LINK_TEXT = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_NOT_IN_SLUG = re.compile(r"[^\w\- ]", re.UNICODE)


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` outside fenced code blocks."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if match:
            marker = match.group(1)
            if fence is None:
                fence = marker[0] * len(marker)
            elif marker.startswith(fence):
                fence = None
            continue
        if fence is None:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: inline code and link syntax dropped, punctuation removed, spaces to hyphens."""
    text = _MARKDOWN_LINK_TEXT.sub(r"\1", heading)
    text = _INLINE_CODE.sub(r"\2", text)
    text = re.sub(r"[*_]{1,3}(\S(?:.*?\S)?)[*_]{1,3}", r"\1", text)  # emphasis
    return _NOT_IN_SLUG.sub("", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: Counter[str] = Counter()
    found: set[str] = set()
    for _, line in prose_lines(text):
        found.update(_HTML_ANCHOR.findall(line))
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            found.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
            seen[base] += 1
    return found


def links(text: str) -> list[tuple[int, str]]:
    """``(line number, target)`` of every Markdown link outside code."""
    found = []
    for number, line in prose_lines(text):
        for target in _LINK.findall(_INLINE_CODE.sub("", line)):
            found.append((number, target))
    return found


def broken_links(page: Path) -> list[str]:
    """What is wrong with ``page``'s relative links: a missing file, or an anchor no heading of the target makes."""
    problems = []
    for number, target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("//"):
            continue  # http:, https:, mailto: ...: not checked here (no network in tests)
        path_part, _, fragment = target.partition("#")
        resolved = (page.parent / unquote(path_part)).resolve() if path_part else page
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not resolved.exists():
            problems.append(
                f"{where}: no such file {resolved.relative_to(ROOT) if resolved.is_relative_to(ROOT) else resolved}"
            )
            continue
        if fragment:
            if resolved.suffix != ".md":
                problems.append(f"{where}: an anchor into a file that is not Markdown")
            elif unquote(fragment) not in anchors(resolved.read_text(encoding="utf-8")):
                problems.append(f"{where}: {resolved.name} has no heading with the anchor #{fragment}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_readme_stays_short() -> None:
    """Issue 24: a README of about 200 lines that starts with the user; everything else is in docs/."""
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 210


def test_configuration_lists_every_setting_once() -> None:
    """Each ``REBOUND_*`` setting of ``rebound/settings.py`` is one table row of docs/configuration.md; a row naming
    something that is not a setting is allowed only under "Read by other commands"."""
    expected = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}
    rows: Counter[str] = Counter()
    others: Counter[str] = Counter()
    section = ""
    for _, line in prose_lines(CONFIGURATION.read_text(encoding="utf-8")):
        heading = _HEADING.match(line)
        if heading:
            section = heading.group(2)
            continue
        row = re.match(r"^\|\s*`(REBOUND_[A-Z0-9_]+)`\s*\|", line)
        if row:
            (others if section == OTHER_COMMANDS_HEADING else rows)[row.group(1)] += 1
    assert {name for name in expected if rows[name] != 1} == set(), "settings not listed exactly once"
    assert set(rows) - expected == set(), "rows naming no setting (move them under 'Read by other commands')"
    assert set(others).isdisjoint(expected)
    assert [name for name, count in others.items() if count != 1] == []


# ------------------------------------------------------------------------------------------ the checker itself


def test_slugs_follow_github() -> None:
    assert slug("The handler timeout: `rebound.HandlerTimeout`") == "the-handler-timeout-reboundhandlertimeout"
    assert slug("Sleeping past `max.poll.interval.ms` (`long-delay`)") == "sleeping-past-maxpollintervalms-long-delay"
    assert slug("Release lateness with 100,000 parked") == "release-lateness-with-100000-parked"
    assert slug("Trying the newest releases: `make test-upgrade`") == "trying-the-newest-releases-make-test-upgrade"
    assert anchors('# A\n## B\n## B\n```\n## C\n```\n<a id="x"></a>\n') == {"a", "b", "b-1", "x"}


def test_a_broken_link_or_anchor_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Known part\n", encoding="utf-8")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md#known-part) [ok too](#top) [web](https://example.com/x.md#nothing)\n"
        "[gone](docs/missing.md) [no anchor](docs/a.md#unknown-part)\n"
        "`[in code](docs/missing.md)`\n```\n[in a block](docs/missing.md)\n```\n# Top\n",
        encoding="utf-8",
    )
    problems = broken_links(page)
    assert len(problems) == 2
    assert "README.md:2: docs/missing.md: no such file docs/missing.md" in problems[0]
    assert "a.md has no heading with the anchor #unknown-part" in problems[1]
