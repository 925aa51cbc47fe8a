"""The page a user moving over from the Julia server reads first exists and is reachable."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_differences_page_is_linked_from_the_readme_and_starts_with_its_heading():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\[[^\]]+\]\((docs/[^)#]+\.md)\)", readme)
    pages = [link for link in links if "differences" in link]
    assert pages, "README.md links no docs/ page about the differences"
    page = ROOT / pages[0]
    first_heading = next(line for line in page.read_text().splitlines() if line.startswith("#"))
    assert first_heading.startswith("# ") and "Differences" in first_heading


def test_the_page_names_every_upstream_variable_that_is_aliased_or_has_no_counterpart():
    from kserve_trio.core.process.upstream_env import ALIASED, GATEWAY_PREFIX, UNSUPPORTED

    text = (ROOT / "docs" / "differences.md").read_text()
    assert f"{GATEWAY_PREFIX}*" in text
    for var in sorted(ALIASED - {"REACTANT_META_CONCURRENCY"}):
        assert f"`{var}`" in text, var
    for prefix in {var.rsplit("_", 2)[0] for var in UNSUPPORTED}:
        assert prefix in text, prefix
