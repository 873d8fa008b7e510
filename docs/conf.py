"""Sphinx settings of the docs site (``make docs``; tests/test_docs.py builds it with warnings as
errors). Pages are Markdown (MyST); the configuration and command references are generated from the
code (_ext/shardtrain_docs.py), the Python API reference from docstrings (autodoc). The site opens
from file:// with nothing fetched from elsewhere: plain ``html`` pages with relative links, the furo
theme's own CSS and scripts, no web fonts, no math (MathJax would come from a CDN)."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "_ext"), os.path.dirname(HERE)]

from common import __version__  # noqa: E402  (after the path above)

project = "shardtrain"
release = version = __version__
copyright = "the shardtrain authors"

extensions = ["myst_parser", "sphinx.ext.autodoc", "shardtrain_docs"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
# Docstrings are written with `name` for code, as in Markdown.
default_role = "code"
# Headings get anchors a page can link to (page.md#heading-text).
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_class_signature = "separated"

html_theme = "furo"
html_title = f"shardtrain {release}"
html_copy_source = False
html_show_sourcelink = False
html_static_path: list[str] = []
html_theme_options = {"navigation_with_keys": True}
# Text as written: options keep their "--", quotes stay straight.
smartquotes = False
