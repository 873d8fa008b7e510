"""The pages a reader reads, in the order they read them, and their fenced blocks: README.md, then
the docs site's pages in its table of contents' order (docs/index.md and the ``{toctree}`` blocks,
depth first). tests/shardtrain/test_readme.py runs their command blocks; tests/test_docs.py checks
their config blocks and the keys they name, and builds the site.

A block's markers are HTML comments on the lines just above it (``<!-- readme-test: KIND: ARG -->``,
see tests/shardtrain/test_readme.py); a reader never sees them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
MARKER = re.compile(r"^<!--\s*readme-test:\s*(skip|instead|local|replace|config|file):\s*(.*?)\s*-->\s*$")
REPLACE = " ==> "
FENCE = re.compile(r"^```(\S*)(?:\s.*)?$")  # ```bash, ```{include} ../README.md
TOCTREE = re.compile(r"^```\{toctree\}\s*$")


@dataclass
class Block:
    page: str       # the page's path from the checkout's root: README.md, docs/guides/sweeps.md
    line: int       # 1-based line of the opening fence
    language: str
    text: str
    marker: tuple[str, str] | None  # (kind, argument) from the comments above, if any (not replace)
    replacements: tuple[tuple[str, str], ...] = ()  # (OLD, NEW) from replace comments above

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"

    def code(self) -> str:
        """The block's text as it is run: each replacement applied (OLD must be in the block)."""
        text = self.text
        for old, new in self.replacements:
            assert old in text, f"{self.where}: 'readme-test: replace:' text not in the block: {old!r}"
            text = text.replace(old, new)
        return text


def reading_order() -> list[str]:
    """Every page, README.md first, then the site's pages as its table of contents orders them."""
    pages, seen = [README], set()

    def visit(page: str) -> None:
        seen.add(page)
        pages.append(page)
        for child in toctree_entries(page):
            if child not in seen:
                visit(child)

    visit(os.path.join(DOCS, "index.md"))
    return pages


def toctree_entries(page: str) -> list[str]:
    """The pages a page's ``{toctree}`` blocks list, in order, as paths."""
    lines, entries, inside = open(page, encoding="utf-8").read().splitlines(), [], False
    for line in lines:
        if TOCTREE.match(line):
            inside = True
        elif inside and line.startswith("```"):
            inside = False
        elif inside and line.strip() and not line.startswith(":"):
            entries.append(os.path.normpath(os.path.join(os.path.dirname(page), line.strip() + ".md")))
    return entries


def page_blocks(path: str) -> list[Block]:
    """The fenced blocks of one page (``{directive}`` fences are not code), with their markers."""
    lines = open(path, encoding="utf-8").read().splitlines()
    page = os.path.relpath(path, ROOT) if os.path.isabs(path) and path.startswith(ROOT) else os.path.basename(path)
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        markers, above = [], start - 1
        while above >= 0 and MARKER.match(lines[above]):
            markers.append(MARKER.match(lines[above]).groups())
            above -= 1
        marker = next(((kind, arg) for kind, arg in markers if kind != "replace"), None)
        replacements = tuple(tuple(arg.split(REPLACE, 1)) if REPLACE in arg else (arg, "")
                             for kind, arg in reversed(markers) if kind == "replace")
        blocks.append(Block(page, start + 1, fence.group(1).lower(), "\n".join(body), marker, replacements))
    return blocks


def all_blocks() -> list[Block]:
    """Every page's blocks, in reading order."""
    return [block for page in reading_order() for block in page_blocks(page)]


def command_lines(text: str) -> list[str]:
    """A shell block's commands: continuation lines joined, blank and comment-only lines dropped."""
    commands, current = [], ""
    for raw in text.splitlines():
        current += raw.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip() and not current.strip().startswith("#"):
            commands.append(current.strip())
        current = ""
    return commands
