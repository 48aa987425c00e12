"""The docs hold together: README.md and docs/*.md link only to files and #anchors that exist,
docs/configuration.md is what the flags' help generates, and code blocks fenced as runnable run."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOPICS = ("getting-started", "models", "server-and-api", "configuration", "prefix-caching", "kv-quantization", "kv-eviction",
          "kv-groups", "planner", "metrics-and-monitoring", "hardening-and-security", "kernels", "benchmarks", "architecture",
          "contributing", "kv-tiers", "kv-sharing", "scale-out", "evaluation", "structured-outputs")  # fmt: skip
FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text()):
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_slugs_are_githubs():
    assert github_slug("Prefix caching (`bench/prefix.py`), Gemma 3 270M") == "prefix-caching-benchprefixpy-gemma-3-270m"
    assert github_slug("Invariance and the one-path kernels (2026-12-02)") == "invariance-and-the-one-path-kernels-2026-12-02"
    assert github_slug("Capacity planner: `kvserve plan`") == "capacity-planner-kvserve-plan"


def test_there_is_a_page_per_topic():
    for topic in TOPICS:
        assert (ROOT / "docs" / f"{topic}.md").is_file(), topic
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    bad = []
    for line in _prose(page.read_text()):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{target}: no file {dest}")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not bad, "\n".join(bad)


def test_configuration_page_is_generated_from_the_flags():
    from kvserve.config_docs import PAGE, render

    assert PAGE.read_text() == render(), "docs/configuration.md is stale: run `python -m kvserve.config_docs`"


def _runnable_blocks():
    for page in sorted((ROOT / "docs").glob("*.md")):
        lang, block = None, []
        for line in page.read_text().splitlines():
            m = re.match(r"^```(\w+) runnable\s*$", line)
            if lang is None and m:
                lang, block = m.group(1), []
            elif lang is not None and line.startswith("```"):
                yield pytest.param(lang, "\n".join(block), id=f"{page.name}:{lang}:{len(block)}")
                lang = None
            elif lang is not None:
                block.append(line)


@pytest.mark.parametrize(("lang", "code"), list(_runnable_blocks()))
def test_runnable_blocks_run(lang, code):
    if lang == "python":
        cmd = [sys.executable, "-c", code]
    else:  # bash: `kvserve` is this checkout's CLI
        cmd = ["bash", "-euc", code.replace("kvserve ", f"{sys.executable} -m kvserve.cli ")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_readmes_examples_are_the_ones_test_readme_examples_checks():
    readme = (ROOT / "README.md").read_text()
    # tests/test_readme_examples.py sends these bodies to a `make serve` server; every curl sets max_tokens
    assert '{"messages": [{"role": "user", "content": "Name three planets."}], "stream": true, "max_tokens": 32}' in readme
    assert '"prompt": "The KV cache of a transformer", "max_tokens": 32, "temperature": 0}' in readme
    for line in readme.splitlines():
        if line.strip().startswith("-d '{"):
            assert "max_tokens" in line, line
