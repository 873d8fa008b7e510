"""The docs site's generated parts: the configuration reference from the config dataclasses, the
command reference from the ``shardtrain`` argument parser. Nothing here is written by hand, so a
key or a command added in code appears in the site, and one removed disappears.

    ```{config-reference} pipelines.shard_config:ShardConfig
    ```
    ```{config-reference} shardtrain.run:RunConfig
    :embedded: pipelines.shard_config:ShardConfig=config-shard training.config:TrainConfig=config-train
    ```
    ```{command-reference}
    ```

``:embedded:`` names the job configs another holds whole (``run``'s ``shard`` and ``train``): one
line linking to their own page instead of their keys again.
"""

from __future__ import annotations

import argparse
import importlib
import re

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx import addnodes
from sphinx.util.docutils import SphinxDirective

from common.config_keys import NAME, config_keys

CODE = re.compile(r"`([^`]+)`")


def _load(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _inline(text: str) -> list[nodes.Node]:
    """Plain text with `code` spans (how help texts are written) as docutils nodes."""
    parts = CODE.split(text)
    return [nodes.literal(text=part) if i % 2 else nodes.Text(part) for i, part in enumerate(parts) if part]


def _paragraph(text: str, **attributes) -> nodes.paragraph:
    return nodes.paragraph("", "", *_inline(text), **attributes)


def _table(header: list[str], rows: list[list[list[nodes.Node]]], widths: list[int]) -> nodes.table:
    group = nodes.tgroup(cols=len(header))
    group += [nodes.colspec(colwidth=w) for w in widths]
    head = nodes.thead()
    head += nodes.row("", *[nodes.entry("", nodes.paragraph(text=h)) for h in header])
    body = nodes.tbody()
    for cells in rows:
        body += nodes.row("", *[nodes.entry("", nodes.paragraph("", "", *cell)) for cell in cells])
    group += [head, body]
    return nodes.table("", group, classes=["config-keys"])


def _anchor(key: str) -> str:
    return "key-" + nodes.make_id(key.replace(NAME, "name"))


class ConfigReference(SphinxDirective):
    """Every key of a job's config tree, one table per section, from the dataclasses' metadata."""

    required_arguments = 1
    option_spec = {"embedded": directives.unchanged}

    def run(self) -> list[nodes.Node]:
        embedded = dict(pair.split("=", 1) for pair in self.options.get("embedded", "").split())
        pages = {_load(spec): page for spec, page in embedded.items()}
        keys = config_keys(_load(self.arguments[0]), tuple(pages))
        out: list[nodes.Node] = []
        top = [k for k in keys if not k.parent and not k.section]
        if top:
            out += [nodes.rubric(text="Top-level keys"), self._keys_table(top)]
        for section in (k for k in keys if k.section):
            title = nodes.rubric("", "", nodes.literal(text=section.key), ids=[_anchor(section.key)])
            out += [title, _paragraph(section.help)]
            if section.embedded is not None:
                out.append(self._see_page(section.key, pages[section.embedded]))
                continue
            inside = [k for k in keys if k.parent in (section.key, f"{section.key}.{NAME}") and not k.section]
            if inside:
                out.append(self._keys_table(inside))
        return out

    def _keys_table(self, keys) -> nodes.table:
        rows = [[[nodes.literal(text=k.key, ids=[_anchor(k.key)])], _inline(k.type), [nodes.literal(text=k.default)],
                 _inline(k.help)] for k in keys]
        return _table(["key", "type", "default", "meaning"], rows, [22, 14, 12, 52])

    def _see_page(self, key: str, page: str) -> nodes.paragraph:
        ref = addnodes.pending_xref("", refdomain="std", reftype="doc", reftarget=page, refexplicit=False,
                                    refdoc=self.env.docname)
        ref += nodes.inline(text=page)
        return nodes.paragraph("", "", nodes.Text("Every key of that job, under "), nodes.literal(text=f"{key}."),
                               nodes.Text(": see "), ref, nodes.Text("."))


class CommandReference(SphinxDirective):
    """Every ``shardtrain`` command with its usage and arguments, from the CLI's own parser."""

    def run(self) -> list[nodes.Node]:
        from shardtrain.cli import build_parser

        parser = build_parser()
        out: list[nodes.Node] = [self._arguments(parser)]
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        helps = {a.dest: a.help for a in commands._choices_actions}
        for name, sub in commands.choices.items():
            out += [nodes.rubric("", "", nodes.literal(text=f"shardtrain {name}"), ids=[f"command-{name}"]),
                    _paragraph(helps.get(name) or ""),
                    nodes.literal_block(text=sub.format_usage().replace("usage: ", "").strip()),
                    self._arguments(sub)]
        return out

    def _arguments(self, parser: argparse.ArgumentParser) -> nodes.table:
        rows = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
                continue
            names = ", ".join(action.option_strings) or action.metavar or action.dest
            rows.append([[nodes.literal(text=names)], _inline(action.help or "")])
        return _table(["argument", "what it does"], rows, [30, 70])


def setup(app):
    app.add_directive("config-reference", ConfigReference)
    app.add_directive("command-reference", CommandReference)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
