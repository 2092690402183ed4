"""The README and docs/ pages: every relative link leads to a file (and heading) that exists, the
site builds with ``mkdocs build --strict``, and the README's starting scenario is the example file."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def slug(heading: str) -> str:
    """A heading's anchor as mkdocs (and GitHub, for these headings) writes it."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[-\s]+", "-", text).strip("-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def broken_links(page: Path) -> list[str]:
    """``page``'s relative links whose file or heading does not exist."""
    bad = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.name}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{page.name}: {target} (no such heading)")
    return bad


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_resolves() -> None:
    found = [p.name for p in pages()]
    assert "README.md" in found and len(found) > 5, found
    assert [b for p in pages() for b in broken_links(p)] == []


def test_a_broken_link_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Top\n\n## Its part\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#its-part) [gone](missing.md) [no heading](a.md#nowhere) [self](#top-b)\n# Top b\n"
                    "```\n[in a fence](ignored.md)\n```\n")
    assert broken_links(page) == ["b.md: missing.md (no such file)", "b.md: a.md#nowhere (no such heading)"]


def test_every_docs_page_is_in_the_site_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    assert sorted(p.name for p in (ROOT / "docs").glob("*.md")) == sorted(re.findall(r": (\S+\.md)$", nav, re.M))


@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                    reason="mkdocs is not installed (pip install -e '.[test]')")
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "site" / "gpu" / "index.html").exists()


def test_the_readme_scenario_is_the_example_and_loads() -> None:
    from harness.scenario import load_scenario

    example = ROOT / "examples" / "minimal_parity.toml"
    block = re.search(r"```toml\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block is not None
    body = "".join(line for line in example.read_text().splitlines(keepends=True) if not line.startswith("#"))
    assert block.group(1) == body
    s = load_scenario(example)
    assert [r.world_size for r in s.runs] == [1, 2] and s.checks.reference == "single"


def test_the_scripts_page_shows_the_minimal_script_as_it_is() -> None:
    """docs/scripts.md's complete minimal script is examples/minimal_script.py, word for word."""
    block = re.search(r"## A complete minimal script.*?```python\n(.*?)```", (ROOT / "docs" / "scripts.md").read_text(),
                      re.S)
    assert block is not None
    assert block.group(1) == (ROOT / "examples" / "minimal_script.py").read_text()


HARNESS_PATH = re.compile(r"\bharness/[\w/.]*\w")
HARNESS_MODULE = re.compile(r"\bharness(?:\.\w+)+")


def stale_names(page: Path) -> list[str]:
    """The ``harness/...`` paths and ``harness.x.y`` names ``page`` gives that the tree lacks (a
    dotted name may end in one attribute its module defines); a path inside a longer path (an
    install's ``.venv``) is another tree's."""
    def module(parts: list[str]) -> Path | None:
        base = ROOT / Path(*parts)
        return next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)

    text, bad = page.read_text(), []
    for m in HARNESS_PATH.finditer(text):
        if text[m.start() - 1:m.start()] not in ("/", "-") and not (ROOT / m.group(0)).exists():
            bad.append(m.group(0))
    for m in HARNESS_MODULE.finditer(text):
        parts = m.group(0).split(".")
        owner = module(parts[:-1])
        if module(parts) is None and (owner is None or not re.search(rf"\b{parts[-1]}\b", owner.read_text())):
            bad.append(m.group(0))
    return [f"{page.name}: {name}" for name in dict.fromkeys(bad)]


def test_every_harness_path_and_module_the_docs_name_exists() -> None:
    assert [b for p in pages() for b in stale_names(p)] == []


def test_a_stale_name_is_found(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("`harness/run/pipeline.py`, `harness/gone.py`, `harness.run.results.document`, "
                    "`harness.run.results.no_such_name`, `harness.nowhere`, `/home/me/harness/.venv/bin/python`\n")
    assert stale_names(page) == ["p.md: harness/gone.py", "p.md: harness.run.results.no_such_name",
                                 "p.md: harness.nowhere"]
