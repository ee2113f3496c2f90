"""The documentation: the mkdocs site builds with --strict (so a broken link or anchor fails it,
which a planted broken link and a planted broken anchor show), README.md stays a five-minute
read (at most 150 lines) whose docs/ links all resolve, and every page in docs/ is in the nav."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[1]
README_MAX_LINES = 150


def build_site(project: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner, not a finding
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    return subprocess.run(command, cwd=project, capture_output=True, text=True, timeout=180, env=env)


def nav_pages(node) -> set[str]:
    """Every page path named in mkdocs.yml's nav (nested sections included)."""
    if isinstance(node, str):
        return {node}
    if isinstance(node, dict):
        return set().union(*(nav_pages(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(nav_pages(v) for v in node))
    return set()


def test_site_builds_strict(tmp_path):
    result = build_site(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").exists()


@pytest.mark.parametrize(
    "link, named",
    [("[gone](no-such-page.md)", "no-such-page.md"), ("[gone](running.md#no-such-anchor)", "no-such-anchor")],
    ids=["missing-page", "missing-anchor"],
)
def test_strict_build_fails_on_a_broken_link(tmp_path, link, named):
    project = tmp_path / "project"
    shutil.copytree(ROOT / "docs", project / "docs")
    shutil.copy(ROOT / "mkdocs.yml", project / "mkdocs.yml")
    with open(project / "docs" / "index.md", "a") as page:
        page.write(f"\nA planted broken link: {link}.\n")
    result = build_site(project, tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert named in output, output


def test_readme_is_short_and_its_docs_links_exist():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES, "README.md grew: move the detail to a page in docs/"
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text)]
    docs_links = [t for t in targets if t.startswith("docs/") and t.endswith(".md")]
    assert docs_links, "README.md links no docs page"
    missing = [t for t in docs_links if not (ROOT / t).is_file()]
    assert not missing, f"README.md links missing pages: {missing}"


def test_every_docs_page_is_in_the_nav():
    nav = nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages - nav == set(), f"pages missing from mkdocs.yml's nav: {sorted(pages - nav)}"
    assert nav - pages == set(), f"nav entries without a page: {sorted(nav - pages)}"
