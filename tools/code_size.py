"""The longest functions and classes of the package, in lines of code.

    python tools/code_size.py [--top N] [PATH]

A line of code is a non-blank line that is not a comment and not part of a docstring (the
docstrings hold the examples, which the guide of about 80 lines a function and 300 a class does
not count). Nested functions count in their enclosing function too.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path


def _docstring_lines(node: ast.AST) -> set[int]:
  lines: set[int] = set()
  for sub in ast.walk(node):
    body = getattr(sub, "body", None)
    if (isinstance(sub, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)):
      lines |= set(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
  return lines


def sizes(root: Path) -> list[tuple[int, str, str]]:
  """(lines of code, "function" or "class", "path:line name") of every definition under root."""
  rows = []
  for path in sorted(root.rglob("*.py")):
    source = path.read_text().splitlines()
    for node in ast.walk(ast.parse("\n".join(source))):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        span = set(range(node.lineno, (node.end_lineno or node.lineno) + 1))
        code = [i for i in span - _docstring_lines(node)
                if source[i - 1].strip() and not source[i - 1].strip().startswith("#")]
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        rows.append((len(code), kind, f"{path}:{node.lineno} {node.name}"))
  return sorted(rows, reverse=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("path", nargs="?", default="stablejax")
  parser.add_argument("--top", type=int, default=5)
  args = parser.parse_args()
  rows = sizes(Path(args.path))
  for kind in ("function", "class"):
    print(f"longest {'classes' if kind == 'class' else 'functions'} (lines of code):")
    for n, _, where in [r for r in rows if r[1] == kind][:args.top]:
      print(f"  {n:4d}  {where}")


if __name__ == "__main__":
  main()
