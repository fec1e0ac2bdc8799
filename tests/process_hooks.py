"""Exact moments inside a program the tests start: a ``sitecustomize`` that Python imports at
start-up (from PYTHONPATH) and that, as environment variables ask,

* sends a signal to its own process when a module is imported (``HOOK_SIGNAL_AT_IMPORT``), or
  ``HOOK_DELAY`` seconds after a module has been imported (``HOOK_SIGNAL_AFTER_MODULE``);
* pauses the program the first time it opens a file whose path contains ``HOOK_PAUSE_AT_OPEN``
  for writing: it creates ``HOOK_PAUSED_FLAG`` and waits until ``HOOK_RESUME_FILE`` exists.

Nothing else of the program changes (an audit hook and, for the delayed signal, a watcher thread).
"""

from __future__ import annotations

import os
from pathlib import Path

SITECUSTOMIZE = r'''
import os, signal, sys, threading, time

_env = os.environ
_sig = getattr(signal, _env.get("HOOK_SIGNAL", "SIGINT"))
_at_import = _env.get("HOOK_SIGNAL_AT_IMPORT")
_after_module = _env.get("HOOK_SIGNAL_AFTER_MODULE")
_pause_at = _env.get("HOOK_PAUSE_AT_OPEN")
_done = set()


def _hook(event, args):
  if event == "import" and _at_import and args[0] == _at_import and "import" not in _done:
    _done.add("import")
    os.kill(os.getpid(), _sig)
  elif (event == "open" and _pause_at and "pause" not in _done and isinstance(args[0], str)
        and _pause_at in args[0] and any(m in str(args[1] or "") for m in "wax")):
    _done.add("pause")
    open(_env["HOOK_PAUSED_FLAG"], "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(_env["HOOK_RESUME_FILE"]) and time.monotonic() < deadline:
      time.sleep(0.01)


def _watch():
  while _after_module not in sys.modules:
    time.sleep(0.002)
  time.sleep(float(_env.get("HOOK_DELAY", "0")))
  os.kill(os.getpid(), _sig)


if _at_import or _pause_at:
  sys.addaudithook(_hook)
if _after_module:
  threading.Thread(target=_watch, daemon=True).start()
'''


def hooked_env(folder: Path, **settings: str) -> dict[str, str]:
  """The environment of a program run with the hooks of ``settings`` (HOOK_... = value); the
  ``sitecustomize.py`` goes into ``folder/hooks``."""
  hooks = Path(folder) / "hooks"
  hooks.mkdir(parents=True, exist_ok=True)
  (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
  path = os.pathsep.join(p for p in (str(hooks), os.environ.get("PYTHONPATH", "")) if p)
  return {**os.environ, "PYTHONPATH": path, **settings}
