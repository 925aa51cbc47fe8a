"""docs/deploy.md names only files that exist and images the recipes build."""

from __future__ import annotations

import re
import tomllib

from tests.deploy.manifests import ROOT

DOC = (ROOT / "docs" / "deploy.md").read_text()


def test_every_deploy_path_in_the_guide_exists():
    paths = set(re.findall(r"(?<![\w/.])(deploy/[\w./-]+[\w/])", DOC))
    assert len(paths) >= 15
    missing = sorted(p for p in paths if not (ROOT / p.rstrip("/")).exists())
    assert missing == []


def test_the_guides_image_tags_are_the_ones_the_recipes_build():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    # kserve-trio:8002 is the docker container's admin address, not an image.
    tags = {t for t in re.findall(r"kserve-trio:([\w.-]+)", DOC) if not t.isdigit()}
    assert tags == {f"{version}-cpu", f"{version}-cuda"}
