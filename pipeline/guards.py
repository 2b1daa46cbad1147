"""Setups refused before anything is built, because they would fail later or go silently wrong.

`check_batch_fits`: a batch larger than this process's share of a split that drops partial
batches gives zero batches per epoch, and repeated records after that.
`check_main_guard`: Grain starts worker processes with `spawn`, and every worker re-imports
the main script; a script that builds the pipeline at module level, without
`if __name__ == "__main__":`, would build it again inside each worker and die there with a
long multiprocessing traceback. Both raise a one-line `ValueError` saying what to change.
"""

from __future__ import annotations

import ast
import multiprocessing
import sys
import types

GUARD = 'if __name__ == "__main__":'


def check_batch_fits(
  batch_size: int, records: int, *, drop_remainder: bool, split: str = "the split"
) -> None:
  """Refuses a batch of `batch_size` over `records` (this process's share of `split`) when
  partial batches are dropped and not one full batch fits."""
  if drop_remainder and batch_size > records:
    raise ValueError(
      f"batch_size={batch_size} is larger than the {records} records of {split} this process "
      "reads, so an epoch would hold no batch (partial batches are dropped): use a batch of at "
      f"most {records}, or drop_remainder=False"
    )


def check_main_guard(what: str = "worker processes") -> None:
  """Raises when the pipeline is being built where a spawned worker would build it again.

  In the main process: when the call comes from the module-level code of a script (or
  `python -m` module) outside its `if __name__ == "__main__":` block. In a spawned child
  still importing that script: always (it would start workers of its own). Notebooks,
  `python -c` and calls from functions or from the guarded block pass.
  """
  if getattr(multiprocessing.current_process(), "_inheriting", False):
    raise ValueError(_message(what, _main_file(sys.modules.get("__mp_main__")), None))
  main = sys.modules.get("__main__")
  path = _main_file(main)
  if path is None:
    return
  frame = sys._getframe(1)
  while frame is not None:
    if frame.f_globals is vars(main) and frame.f_code.co_name == "<module>":
      if not _inside_guard(path, frame.f_lineno):
        raise ValueError(_message(what, path, frame.f_lineno))
      return
    frame = frame.f_back


def _main_file(module: types.ModuleType | None) -> str | None:
  path = getattr(module, "__file__", None)
  return path if isinstance(path, str) and path.endswith(".py") else None


def _inside_guard(path: str, line: int) -> bool:
  """Whether `line` of the script at `path` lies in a module-level `if __name__ ==
  "__main__":` block (or the file cannot be read: then it is not ours to refuse)."""
  try:
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
  except (OSError, SyntaxError, ValueError):
    return True
  for node in tree.body:
    if isinstance(node, ast.If) and _is_main_test(node.test):
      if node.body[0].lineno <= line <= (node.body[-1].end_lineno or line):
        return True
  return False


def _is_main_test(test: ast.expr) -> bool:
  if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
    return False
  if not isinstance(test.ops[0], ast.Eq):
    return False
  sides = [test.left, test.comparators[0]]
  names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
  consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
  return bool(names and consts)


def _message(what: str, path: str | None, line: int | None) -> str:
  where = f"{path}:{line}" if path and line else (path or "the main script")
  return (
    f"{what} re-import the main script, and {where} builds the pipeline at module level: "
    f'put that code under `{GUARD}` (or pass performance={{"num_workers": 0}})'
  )
