"""Sphinx configuration of the whitenlayers documentation site.

Build (from the repository root): ``pip install -e ".[docs]" && sphinx-build -W --keep-going -b html docs docs/_build/html``
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

import whitenlayers  # noqa: E402

project = "whitenlayers"
author = "the whitenlayers developers"
copyright = "2026, the whitenlayers developers"
release = version = whitenlayers.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx.ext.mathjax",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
# convergence/*.md and coverage_notes.md are fragments the study scripts paste into CONVERGENCE.md / COVERAGE.md
exclude_patterns = ["_build", "convergence/*.md", "coverage_notes.md"]

myst_enable_extensions = ["dollarmath", "colon_fence"]
myst_heading_anchors = 4

autodoc_member_order = "bysource"
# nn.Module's generic texts (forward, extra_repr) would repeat on every layer; our overrides carry their own
autodoc_inherit_docstrings = False
autodoc_typehints = "description"
autodoc_default_options = {"show-inheritance": True}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# A broken cross-reference inside the package fails the build; references to other libraries (no network for
# their inventories here) stay plain text.
nitpicky = True
nitpick_ignore_regex = [
    # private helpers are deliberately not documented (type hints such as ``-> _LoadResult`` still name them)
    (r"py:.*", r"(.*\.)?_[A-Za-z]\w*"),
    # forward references written as strings in annotations (``"WhiteningLayer"``), documented under their names
    (r"py:class", r"'\w+'"),
    (r"py:.*", r"(torch|numpy|np|nn|typing|collections|dataclasses|enum|os|pathlib|contextlib)(\..*)?"),
    (r"py:.*", r"(Tensor|Module|Optional|Union|Any|Callable|Sequence|Iterable|Iterator|Mapping|Dict|List|Tuple|Type|"
               r"Hashable|NamedTuple|bool|int|float|str|None|object|dict|list|tuple|type|callable)"),
]

html_theme = "furo"
html_title = f"whitenlayers {release}"
html_static_path = ["_static"]


def _site_links(app, docname, source):
    """Links written for reading the Markdown in the repository, pointed at the site's pages instead: the
    benchmark results file is the page ``results``."""
    source[0] = source[0].replace("](../benchmarks/RESULTS.md", "](results.md")


def _public_bases(app, name, obj, options, bases):
    """Private helper classes (``_GradWhitenMixin``, ...) are not documented: leave them out of "Bases"."""
    bases[:] = [b for b in bases if not getattr(b, "__name__", "").startswith("_")]


def setup(app):
    app.connect("source-read", _site_links)
    app.connect("autodoc-process-bases", _public_bases)
