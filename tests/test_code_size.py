"""tools/code_size.py's limits hold for the package: no module over 600 lines, no function over
100 lines of code, no class over 300; and the tool counts what it says it counts."""

import textwrap
from pathlib import Path

from helpers import load_tool

ROOT = Path(__file__).resolve().parent.parent


def _tool():
  return load_tool("code_size")


def test_nothing_in_the_package_is_over_its_limit():
  assert _tool().over_limits(ROOT / "stablejax") == []


def test_lines_of_code_leave_out_docstrings_comments_and_blank_lines(tmp_path):
  (tmp_path / "m.py").write_text(textwrap.dedent('''\
      """Module docstring."""


      def f(x):
        """A docstring
        of two lines."""
        # a comment
        y = x + 1

        def g():
          return y
        return g


      class C:
        """Doc."""
        a = 1
      '''))
  code_size = _tool()
  rows = {where.split()[-1]: n for n, _, where in code_size.sizes(tmp_path)}
  assert rows == {"f": 5, "g": 2, "C": 2}   # f: def, y =, def g, return y, return g
  assert code_size.module_sizes(tmp_path) == [(17, "module", str(tmp_path / "m.py"))]
  code_size.LIMITS["function"] = 4
  assert code_size.over_limits(tmp_path) == [
      f"function {tmp_path / 'm.py'}:4 f: 5 lines (limit 4)"]
