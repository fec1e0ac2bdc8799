"""CI (.ci/run) runs what README promises: its test command verbatim, then the docs build with
warnings as errors, the lint and the type check."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_test_command() -> str:
  readme = (ROOT / "README.md").read_text()
  match = re.search(r"^Run the tests:\s*\n+```bash\n(.+?)\n```", readme, flags=re.M | re.S)
  assert match, "README.md has no 'Run the tests:' command block"
  (command,) = match.group(1).strip().splitlines()
  return command


def _ci_commands() -> list[str]:
  lines = (ROOT / ".ci" / "run").read_text().splitlines()
  return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_the_readme_test_command_verbatim():
  assert _readme_test_command() in _ci_commands()


def test_ci_builds_the_docs_with_warnings_as_errors_after_the_tests():
  commands = _ci_commands()
  tests = commands.index(_readme_test_command())
  docs = [i for i, c in enumerate(commands) if re.search(r"\bsphinx-build\b.* -W .*\bdocs\b", c)]
  assert docs and docs[0] > tests, commands
  assert commands[0:2] == ["set -euo pipefail", 'cd "$(dirname "$0")/.."'], commands


def test_ci_lints_and_type_checks_after_the_tests():
  commands = _ci_commands()
  tests = commands.index(_readme_test_command())
  assert commands.index(".venv/bin/ruff check .") > tests, commands
  assert commands.index(".venv/bin/mypy") > tests, commands


def test_ci_installs_the_docs_and_lint_tools_after_the_tests_and_the_test_extra_does_not():
  # The README's test command installs only what the tests need; CI adds the tools it runs
  # after them, before the first of them.
  commands = _ci_commands()
  tests = commands.index(_readme_test_command())
  install = commands.index('.venv/bin/uv pip install -q -p .venv/bin/python -e ".[docs,lint]"')
  sphinx = next(i for i, c in enumerate(commands) if "sphinx-build" in c)
  assert tests < install < min(sphinx, commands.index(".venv/bin/ruff check ."),
                               commands.index(".venv/bin/mypy")), commands
  pyproject = (ROOT / "pyproject.toml").read_text()
  test_extra = re.search(r"^test = \[(.*?)\]$", pyproject, flags=re.M | re.S)
  assert test_extra, "pyproject.toml has no test extra"
  for tool in ("stablejax[lint]", "stablejax[docs]", "sphinx", "mypy", "ruff"):
    assert tool not in test_extra.group(1), tool
