"""The doctests' temporary folders: the package's docstring examples make their folders with
``tempfile.mkdtemp()``, as a user would; run as doctests, each example's folders go into one
folder of its own, removed after the example, so the suite leaves nothing behind in the system's
temporary folder. (A short path in the system's temporary folder, not ``tmp_path``: examples print
paths, shortened past 40 characters. The tests' own fixtures are in ``tests/conftest.py``.)"""

import shutil
import tempfile

import pytest
from _pytest.doctest import DoctestItem


@pytest.fixture(autouse=True)
def _doctest_temporary_folders_removed(request, monkeypatch):
  if not isinstance(request.node, DoctestItem):
    yield
    return
  folder = tempfile.mkdtemp(prefix="sjdoc")
  monkeypatch.setattr(tempfile, "tempdir", folder)
  try:
    yield
  finally:
    shutil.rmtree(folder, ignore_errors=True)
