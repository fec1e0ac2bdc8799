"""The longest modules, functions and classes of the package.

    python tools/code_size.py [--top N] [--check] [PATH]

Modules are measured in lines, functions and classes in lines of code: a line of code is a
non-blank line that is not a comment and not part of a docstring (the docstrings hold the
examples, which the limits do not count). Nested functions count in their enclosing function too.
The limits: a module of at most 600 lines, a function of at most 100 lines of code, a class of at
most 300 (``--check`` prints what is over them and exits 1; tests/test_layout.py runs it).
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


LIMITS = {"module": 600, "function": 100, "class": 300}


def module_sizes(root: Path) -> list[tuple[int, str, str]]:
  """(lines, "module", path) of every module under root."""
  return sorted(((len(path.read_text().splitlines()), "module", str(path))
                 for path in root.rglob("*.py")), reverse=True)


def over_limits(root: Path) -> list[str]:
  """"KIND PATH: N lines (limit L)" for every module, function and class over its limit."""
  return [f"{kind} {where}: {n} lines (limit {LIMITS[kind]})"
          for n, kind, where in module_sizes(root) + sizes(root) if n > LIMITS[kind]]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("path", nargs="?", default="stablejax")
  parser.add_argument("--top", type=int, default=5)
  parser.add_argument("--check", action="store_true", help="exit 1 when anything is over a limit")
  args = parser.parse_args()
  root = Path(args.path)
  rows = module_sizes(root) + sizes(root)
  for kind, title in (("module", "modules (lines)"), ("function", "functions (lines of code)"),
                      ("class", "classes (lines of code)")):
    print(f"longest {title}, limit {LIMITS[kind]}:")
    for n, _, where in [r for r in rows if r[1] == kind][:args.top]:
      print(f"  {n:4d}  {where}")
  if args.check:
    over = over_limits(root)
    for line in over:
      print(f"over the limit: {line}")
    raise SystemExit(1 if over else 0)


if __name__ == "__main__":
  main()
