"""Issue 39: every speed, memory or GPU figure the README or a guide in docs/ gives points at the
docs/benchmarks.md table that holds it, and every such link lands on a heading that exists.
Issue 62: every relative link of the README and the guides reaches a file, and a heading where it
names one. Issue 59 item 3: where the docs copy a list or a figure the program or the tables make
(the remat policies `plan --search` tries, `model.remat=auto`'s order, the suite's last time), the
copy is compared with its source.

A mechanical check, not a review of the prose. The README is cut into blocks as Markdown renders
them: a paragraph, a list item (with its continuation lines), a table row, a heading; fenced code
(commands, the file tree, --help) is left out. A block that holds a figure (a number with
tokens/s, ms, seconds with a decimal point or minutes, a byte unit (MB, GB, GiB, ...), % MFU,
% faster/slower, an Nx ratio, or the words "measured on/at"; a whole number of seconds is a
setting, such as a timeout) must also hold a link `docs/benchmarks.md#ANCHOR`, and ANCHOR must be the GitHub
slug of one of benchmarks.md's headings (lower case, punctuation but `-` and `_` dropped, spaces
to `-`, a repeated heading's slug suffixed -1, -2, ...).
"""

from __future__ import annotations

import re
from collections import Counter

import pytest
from helpers import REPO

from jaxgpt.config import all_keys
from jaxgpt.gpu import search
from jaxgpt.model import remat

# The guides: every docs/*.md but the tables themselves, design.md and the generated reference
GUIDES = sorted(p.name for p in (REPO / "docs").glob("*.md") if p.name not in ("benchmarks.md", "config.md", "design.md"))

FIGURE = re.compile("|".join([
    r"\d[\d,.]*\+?(?:\s*\([^)]*\))?\s*(?:k|M)?\s*tokens/s",     # 3,100 tokens/s, 3,900 (Intel Xeon) tokens/s
    r"\d[\d,.]*\s*ms\b",                                         # 1,024.4 ms
    r"\d[\d,.]*\s*(?:[KMGT]i?B)\b",                              # 42.7 GB, 41.70 GiB, 480 MB, 25 GB/s
    r"\d[\d.]*%\s*(?:\([^)]*\)\s*)?(?:MFU|faster|slower)",       # 45.2% MFU, 10.9% faster
    r"MFU\s*(?:of\s*)?\d[\d.]*%",                                # MFU 25.5%
    r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x\b",                    # 1.46x, 1.1-1.5x
    r"\d+\.\d+(?:-\d+\.\d+)?\s*s\b|\d+\s+minutes\b",            # 8.5 s, 0.6-1.1 s, 10 minutes (not "60 s")
    r"\bmeasured (?:on|at)\b",
]), re.IGNORECASE)
LINK = re.compile(r"(?<![\w/.])(?:docs/)?benchmarks\.md#([^)\s\"'>]*)")  # from README.md or from docs/


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (github-slugger's rule, on the rendered text)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen: Counter[str] = Counter()
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", _without_code(markdown), re.MULTILINE):
        base = slug(heading)
        out.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return out


def _without_code(markdown: str) -> str:
    """Fenced code blocks blanked out (their lines kept, so line numbers stay right)."""
    lines, fenced = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return "\n".join(lines)


def blocks(markdown: str) -> list[tuple[int, str]]:
    """(first line number, text) of each paragraph, list item, table row and heading outside code."""
    out: list[tuple[int, list[str]]] = []
    open_block = False
    for number, line in enumerate(_without_code(markdown).splitlines(), 1):
        stripped = line.strip()
        starts = stripped.startswith(("|", "#")) or re.match(r"([-*+]|\d+\.)\s", stripped)
        if not stripped:
            open_block = False
        elif starts or not open_block:
            out.append((number, [stripped]))
            open_block = not stripped.startswith(("|", "#"))  # a row or heading is one line
        else:
            out[-1][1].append(stripped)
    return [(number, " ".join(lines)) for number, lines in out]


def unlinked_figures(readme: str, known: set[str], name: str = "README.md") -> list[str]:
    problems = []
    for number, text in blocks(readme):
        targets = LINK.findall(text)
        problems += [f"{name}:{number}: docs/benchmarks.md#{a} names no heading there" for a in targets
                     if a not in known]
        figure = FIGURE.search(text)
        if figure and not targets:
            problems.append(f"{name}:{number}: {figure.group(0)!r} without a docs/benchmarks.md#section link: "
                            f"{text[:100]}...")
    return problems


@pytest.mark.parametrize("name", ["README.md", *GUIDES])
def test_figures_link_the_benchmarks_tables(name):
    path = REPO / name if name == "README.md" else REPO / "docs" / name
    known = anchors((REPO / "docs" / "benchmarks.md").read_text())
    assert len(known) > 10
    problems = unlinked_figures(path.read_text(), known, name)
    assert not problems, "\n".join(problems)


MD_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("name", ["README.md", *GUIDES, "benchmarks.md"])
def test_relative_links_reach_a_file_and_a_heading(name):
    """Every [text](path) and [text](path#anchor) that is not a web address resolves from the file's
    directory, and the anchor is one of the target's headings (the guides link each other by section)."""
    path = REPO / name if name == "README.md" else REPO / "docs" / name
    problems = []
    for number, line in enumerate(_without_code(path.read_text()).splitlines(), 1):
        for target in MD_LINK.findall(line):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.exists():
                problems.append(f"{name}:{number}: {target}: no such file")
            elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved.read_text())):
                problems.append(f"{name}:{number}: {target}: no such heading")
    assert not problems, "\n".join(problems)


def _listed(text: str) -> list[str]:
    """'none, dots, attention or full' -> the names, in order (backticks and commas dropped)."""
    return [w for w in re.split(r",\s*|\s+or\s+|\s+and\s+|\|", text.replace("`", "").strip()) if w]


def test_the_remat_lists_in_the_docs_are_the_programs():
    """Issue 59 item 3: the README said `plan --search` tries none, dots and full when it also tries
    attention, and that auto tries none, dots, dots_no_batch and full: the copies are read here
    and compared with the tuples the code iterates."""
    gpus = (REPO / "docs" / "gpus.md").read_text().replace("\n", " ")
    tried = re.search(r"each with `model\.remat` (.+?) and every `train\.grad_accum`", gpus)
    assert tried, "gpus.md no longer says which remat policies plan --search tries"
    assert _listed(tried.group(1)) == list(search.REMATS)
    auto = re.search(r"`model\.remat=auto` \(also in training\) compiles the step with each remat\s+policy from "
                     r"least to most recompute \(([^)]*)\)", gpus)
    assert auto, "gpus.md no longer lists model.remat=auto's order"
    assert _listed(auto.group(1)) == list(remat.ORDER)
    choices = re.search(r"`model\.remat=([a-z_|]+)`", gpus)
    assert sorted(_listed(choices.group(1))) == sorted(all_keys()["model.remat"].metadata["choices"])


SUITE = re.compile(r"(\d[\d,]*) passed, (\d+) skipped in ([\d,.]+) s\b")


def test_the_readmes_suite_figure_is_the_latest_in_the_tables():
    """Issue 59 item 3: the README's test count and time (it said '535 tests took 16 to 28 minutes' for
    a suite of 575) is the newest row of benchmarks.md's suite table: same count, time, commit, date."""
    readme = (REPO / "README.md").read_text()
    quick = readme[readme.index("## Quick start"):readme.index("\n## ", readme.index("## Quick start") + 5)]
    quick = " ".join(quick.split())
    said = SUITE.findall(quick)
    assert len(said) == 1, f"the Quick start should give one suite figure: {said}"
    tables = (REPO / "docs" / "benchmarks.md").read_text()
    section = tables[tables.index("## The test suite"):]
    row = next(line for line in section.splitlines() if re.match(r"\| \d{4}-\d\d-\d\d \|", line))
    date, commit, result, tests = [c.strip() for c in row.strip("|").split("|")][:4]
    passed, skipped = re.fullmatch(r"([\d,]+) passed, (\d+) skipped", result).groups()
    assert said[0] == (passed, skipped, tests.removesuffix(" s")), (said, row)
    assert f"at {commit}" in quick and date in quick, (commit, date)


def test_the_link_check_catches_what_it_should():
    """The checker on hand-made text: each figure kind is caught, a link to a real heading clears it."""
    known = anchors("# Benchmarks\n## CPU vs a PyTorch reference (issue 23)\n### `scripts/eval_bench.py` on CPU\n"
                    "## Runs\n## Runs\n```\n## not a heading\n```\n")
    assert known == {"benchmarks", "cpu-vs-a-pytorch-reference-issue-23", "scriptseval_benchpy-on-cpu", "runs",
                     "runs-1"}
    for figure in ["3,100 tokens/s", "3,900 (Intel Xeon) tokens/s", "1,024.4 ms", "42.7 GB", "41.70 GiB", "25 GB/s",
                   "8.5 s", "0.6-1.1 s", "10 minutes", "45.2% MFU", "MFU 25.5%", "10.9% faster", "1.46x", "1.1-1.5x",
                   "measured on an H100"]:
        text = f"Some claim: {figure}, and more.\n"
        assert len(unlinked_figures(text, known)) == 1, figure
        linked = f"- A bullet\n  with {figure} ([here](docs/benchmarks.md#runs-1)).\n"
        assert unlinked_figures(linked, known) == [], figure
        bad = f"| row | {figure} | [there](docs/benchmarks.md#nowhere) |\n"
        assert unlinked_figures(bad, known) == ["README.md:1: docs/benchmarks.md#nowhere names no heading there"]
    quiet = ("The 8 x H100 mesh; dp=8; 300 steps; 7.2M parameters; version 0.12; a 60 s timeout.\n\n"
             "```\n1,024 ms in code\n```\n")
    assert unlinked_figures(quiet, known) == []
    apart = ("First paragraph, 5 ms\n([x](docs/benchmarks.md#runs)).\n\nSecond one, 6 ms.\n\n"
             "- an item, 7 ms\n  ([x](docs/benchmarks.md#runs))\n- the next item, 8 ms\n")
    assert [p.split(":")[1] for p in unlinked_figures(apart, known)] == ["4", "8"]
