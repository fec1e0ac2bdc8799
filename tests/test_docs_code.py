"""The code in README.md and the guides under docs/ runs.

Every fenced ``python`` block of a page is one of two kinds:

* **run**: the page's blocks are executed in order, in one namespace per page. The namespace
  starts with what a reader has at hand when a page says "your params" (:data:`CONTEXT`):
  ``params`` of a small transformer-shaped tree, its ``grads`` and ``loss``, ``prev_params``, a
  ``step`` and a train ``record``. A block may use those names, nothing else it did not define.
  A page whose code registers a declaration (a model family, a defence, a defence's metrics)
  runs in a fresh process, since the registries belong to the process and the programs built
  before would no longer match them; any other page runs in this process, in a fresh namespace,
  where the library's operations it calls (the README's chain, on three pages) are compiled
  once, not once per page.
* **excerpt**: a block right after a ``<!-- excerpt: examples/NAME.py -->`` line shows lines of
  a complete script that ``tests/test_examples.py`` runs; every code line of the block must be a
  line of that script (compared without indentation and trailing comments), so the excerpt cannot
  drift from the code that runs.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXCERPT = re.compile(r"<!--\s*excerpt:\s*(\S+)\s*-->")

# What a page's code may take as given: the reader's params, gradients and loss, and one train
# record of the kind metrics.jsonl holds.
CONTEXT = textwrap.dedent("""
    import jax, jax.numpy as jnp
    _keys = iter(jax.random.split(jax.random.key(0), 8))
    params = {
        "embed": {"embedding": 0.02 * jax.random.normal(next(_keys), (64, 16))},
        "block": {"norm": {"scale": jnp.ones(16)},
                  "mlp": {"kernel": 0.1 * jax.random.normal(next(_keys), (16, 32))},
                  "proj": {"kernel": 0.1 * jax.random.normal(next(_keys), (32, 16))}},
        "lm_head": {"kernel": 0.02 * jax.random.normal(next(_keys), (16, 64))},
    }
    _tokens = jax.random.randint(next(_keys), (4, 8), 0, 64)

    def _loss_fn(p):
      x = p["embed"]["embedding"][_tokens] * p["block"]["norm"]["scale"]
      x = x + jax.nn.gelu(x @ p["block"]["mlp"]["kernel"]) @ p["block"]["proj"]["kernel"]
      logits = x @ p["lm_head"]["kernel"]
      return -jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    loss, grads = jax.value_and_grad(_loss_fn)(params)
    prev_params = jax.tree.map(lambda p: p - 1e-3, params)
    step = 100
    record = {"step": step, "loss": float(loss), "lr": 1e-3, "grad_norm": 0.8,
              "zclip/grad_norm": 0.8, "zclip/is_spike": False, "skip_nonfinite/skipped": False}
""")


def _blocks(page: Path) -> list[tuple[int, str, str | None]]:
  """``(line, code, excerpt source or None)`` for each fenced python block of ``page``."""
  lines = page.read_text().splitlines()
  out, i = [], 0
  while i < len(lines):
    if lines[i].strip() == "```python":
      start = i
      j = i + 1
      while lines[j].strip() != "```":
        j += 1
      previous = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
      match = EXCERPT.fullmatch(previous.strip())
      out.append((start + 1, "\n".join(lines[start + 1:j]), match.group(1) if match else None))
      i = j
    i += 1
  return out


def _code_lines(code: str) -> list[str]:
  """Code lines without indentation, trailing comments and blank or comment-only lines."""
  kept = []
  for line in code.splitlines():
    line = re.sub(r"\s+#.*$", "", line).strip()
    if line and not line.startswith("#"):
      kept.append(line)
  return kept


RUN_PAGES = [p for p in PAGES if any(src is None for _, _, src in _blocks(p))]
EXCERPTS = [(p, line, code, src) for p in PAGES for line, code, src in _blocks(p) if src]


def test_the_pages_have_code_to_check():
  # The parser finds the README's chain and at least one excerpt, so the tests below check
  # something.
  assert ROOT / "README.md" in RUN_PAGES
  assert EXCERPTS


def _registers(code: str) -> bool:
  """Whether a page's code registers a declaration (``family.register``, ``defence.register``,
  ``metrics.register_state_metrics``, ...)."""
  return re.search(r"\bregister\w*\(", code) is not None


@pytest.mark.parametrize("page", RUN_PAGES, ids=[p.name for p in RUN_PAGES])
def test_page_code_runs(page, monkeypatch, capsys):
  parts = [CONTEXT]
  for line, code, src in _blocks(page):
    if src is None:
      parts.append(f"# --- {page.name}:{line}\n{code}")
  script = "\n".join(parts)
  if _registers(script):
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, check=False)
    assert result.returncode == 0, (f"the python blocks of {page.name} fail when run in order:\n"
                                    f"{result.stderr[-3000:]}")
    return
  monkeypatch.chdir(ROOT)
  exec(compile(script, f"<the python blocks of {page.name}>", "exec"), {"__name__": "__main__"})
  capsys.readouterr()  # what the page prints


def test_a_page_that_registers_runs_in_its_own_process():
  assert _registers("family.register(TINY_LM)") and _registers("metrics.register_state_metrics(")
  assert not _registers("print(stablejax.describe_routing(params, tx))")
  assert not _registers("registry = {}")


@pytest.mark.parametrize("page,line,code,src", EXCERPTS,
                         ids=[f"{p.name}:{line}" for p, line, _, _ in EXCERPTS])
def test_excerpt_matches_its_script(page, line, code, src):
  script = ROOT / src
  assert script.is_file(), f"{page.name}:{line} is an excerpt of {src}, which does not exist"
  assert script.parent.name == "examples", f"{src}: excerpts must come from a script in examples/"
  script_lines = set(_code_lines(script.read_text()))
  missing = [c for c in _code_lines(code) if c not in script_lines]
  assert not missing, f"{page.name}:{line}: lines not in {src}: {missing}"


def test_excerpt_check_fails_on_drift():
  # The comparison sees a line that differs from the script in one character.
  script_lines = set(_code_lines("x = f(a, b)  # why\n  y = g(x)\n"))
  assert all(c in script_lines for c in _code_lines("x = f(a, b)\ny = g(x)  # other"))
  assert not all(c in script_lines for c in _code_lines("x = f(a, c)"))
