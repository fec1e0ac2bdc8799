"""Sphinx configuration of the stablejax documentation.

Build: ``sphinx-build -W -b html docs docs/_build/html`` (``pip install -e ".[docs]"`` first).
"""

import importlib.util
import os
import sys
from pathlib import Path

from sphinx.util import logging

sys.path.insert(0, os.path.abspath(".."))

import stablejax  # noqa: E402

logger = logging.getLogger(__name__)

project = "stablejax"
author = "the stablejax authors"
copyright = "the stablejax authors"
release = stablejax.__version__
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path = ["_templates"]

# -- API reference ---------------------------------------------------------------------------
autosummary_generate = True
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = False  # State fields are all jax.Array; the signature says so


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
  # A State NamedTuple's fields are described in its docstring's Attributes section; autodoc
  # would add each once more as "Alias for field number N".
  if type(obj).__name__ == "_tuplegetter":
    return True
  return None


def _check_every_public_name_has_a_page(app, env, docnames):
  # Every name in stablejax.__all__ must be listed by an autosummary in docs/api/ (which gives
  # it a page); a missing one is a warning, so an error under -W.
  listed = set()
  for path in sorted(Path(app.srcdir, "api").glob("*.rst")):
    for line in path.read_text().splitlines():
      name = line.strip()
      if line.startswith("   ") and name.isidentifier():
        listed.add(name)
  for name in stablejax.__all__:
    if name != "__version__" and name not in listed:
      logger.warning("stablejax.%s has no API page: add it to an autosummary list in docs/api/",
                     name)


def setup(app):
  app.connect("autodoc-skip-member", _skip_namedtuple_fields)
  app.connect("env-before-read-docs", _check_every_public_name_has_a_page)

# The trainer and data reference (api/trainer.rst) documents modules of the package layout with
# stablejax/data/ (stablejax.data.pipeline, stablejax.training.trained.run, ...). On a tree without
# that package the page is left out of the build, and its toctree entry with it.
if importlib.util.find_spec("stablejax.data") is None:
  exclude_patterns.append("api/trainer.rst")
  suppress_warnings = ["toc.excluded"]

# Cross-references into the JAX, optax, Flax and Python docs need their objects.inv from the
# internet: off by default so the build works offline; STABLEJAX_DOCS_INTERSPHINX=1 turns it on.
if os.environ.get("STABLEJAX_DOCS_INTERSPHINX") == "1":
  extensions.append("sphinx.ext.intersphinx")
  intersphinx_mapping = {
      "python": ("https://docs.python.org/3", None),
      "jax": ("https://docs.jax.dev/en/latest", None),
      "optax": ("https://optax.readthedocs.io/en/latest", None),
      "flax": ("https://flax.readthedocs.io/en/latest", None),
  }

# -- Markdown pages --------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3

# -- HTML ------------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = f"stablejax {release}"
html_theme_options = {
    "show_toc_level": 2,
    "home_page_in_toc": True,
}
