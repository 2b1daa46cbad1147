"""Setups refused before anything is built, because they would fail later or go silently wrong.

`check_batch_fits`: a batch larger than this process's share of a split that drops partial
batches gives zero batches per epoch, and repeated records after that.
`check_main_guard`: processes started with `spawn` re-import the main script (Grain's
workers with `performance.worker_jax`; light ones do not, `pipeline.host.light`); a script
that builds the pipeline at module level, without `if __name__ == "__main__":`, would build
it again inside each such worker and die there with a long multiprocessing traceback.
`make_dataset` checks it whatever the worker count chosen here (a script that runs on 2
cores must not break on 32), unless num_workers is set to 0.
Both raise a one-line `ValueError` saying what to change.
`check_address_space`: array_record starts a pool of 64 threads on a process's first open;
under an address-space limit (RLIMIT_AS, `ulimit -v`) too small for it, that open hangs
forever inside array_record. Refused before, in one line (`AddressSpaceError`).
"""

from __future__ import annotations

import ast
import multiprocessing
import resource
import sys
import types

GUARD = 'if __name__ == "__main__":'
POOL_THREADS = 64  # array_record's global pool (C++ flag array_record_global_pool_size)
# Address space its start takes beyond the threads' stacks (malloc arenas of new threads):
# measured here, the open hung with up to 1,060 MiB of headroom (8 MiB stacks) and 500 MiB
# (2 MiB stacks), and worked from 1,100 and 600; this covers both with a margin.
POOL_EXTRA = 640 * 2**20
_pool_checked = False


class AddressSpaceError(OSError):
  """This process cannot have the memory to open a split (an address-space limit)."""


def _virtual_bytes() -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmSize:"):
        return int(line.split()[1]) * 1024
  return 0


def check_address_space(what: str) -> None:
  """Refuses to open `what` when RLIMIT_AS leaves too little address space for array_record
  to start its read threads (a hang inside array_record, never an error). Checked before
  the first open in a process only: later opens reuse the threads."""
  global _pool_checked
  limit = resource.getrlimit(resource.RLIMIT_AS)[0]
  if _pool_checked or limit == resource.RLIM_INFINITY:
    return
  stack = resource.getrlimit(resource.RLIMIT_STACK)[0]
  stack = 8 * 2**20 if stack == resource.RLIM_INFINITY else stack
  needed = POOL_THREADS * stack + POOL_EXTRA
  left = limit - _virtual_bytes()
  if left < needed:
    raise AddressSpaceError(
      f"out of memory to open {what}: array_record's {POOL_THREADS} read threads need "
      f"~{needed / 2**20:,.0f} MiB of address space, the limit (RLIMIT_AS, ulimit -v) of "
      f"{limit / 2**20:,.0f} MiB leaves {max(left, 0) / 2**20:,.0f} MiB: raise it, or lower "
      "the threads' stack size (ulimit -s)"
    )
  _pool_checked = True


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
  """Whether `line` of the script at `path` lies in a block that runs only when `__name__ ==
  "__main__"` (any `if`, `elif` or `else` whose test requires it), or the file cannot be read:
  then it is not ours to refuse."""
  try:
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(), path)
  except (OSError, SyntaxError, ValueError):
    return True
  for node in ast.walk(tree):
    if not isinstance(node, ast.If):
      continue
    guarded = [node.body] if _requires_main(node.test) else []
    if node.orelse and _excludes_main(node.test):
      guarded.append(node.orelse)
    for body in guarded:
      if body[0].lineno <= line <= (body[-1].end_lineno or line):
        return True
  return False


def _requires_main(test: ast.expr) -> bool:
  """Whether `test` can be true only when `__name__ == "__main__"`."""
  if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
    return any(_requires_main(value) for value in test.values)
  if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
    return _excludes_main(test.operand)
  return _compares_name(test, ast.Eq)


def _excludes_main(test: ast.expr) -> bool:
  """Whether `test` is true whenever `__name__ != "__main__"` (its `else` requires main)."""
  if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or):
    return any(_excludes_main(value) for value in test.values)
  if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
    return _requires_main(test.operand)
  return _compares_name(test, ast.NotEq)


def _compares_name(test: ast.expr, op: type) -> bool:
  if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], op)):
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
