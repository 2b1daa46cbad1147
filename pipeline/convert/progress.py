"""Progress of long conversions: a bar on a terminal, a line per ~10% in logs and pipes.

A bar redraws with carriage returns, which fill a log file with junk; when stderr is not
a terminal, one plain line per tenth of the work says how far it got instead.
"""

from __future__ import annotations

import sys

import tqdm

_STEPS = 10


class Progress:
  """Counts work done out of `total`; shows it on stderr unless `enabled` is False."""

  def __init__(self, total: int, desc: str, unit: str, enabled: bool = True):
    self.total, self.desc, self.unit, self.done = total, desc, unit, 0
    on_tty = enabled and sys.stderr.isatty()
    self._bar = tqdm.tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, disable=not on_tty)
    self._lines = enabled and not on_tty and total > 0
    self._step = 0

  def update(self, n: int) -> None:
    self.done += n
    self._bar.update(n)
    step = self.done * _STEPS // self.total if self.total else _STEPS
    if self._lines and step > self._step:
      self._step = step
      print(
        f"{self.desc}: {100 * self.done // self.total}% ({self.done}/{self.total} {self.unit}s)",
        file=sys.stderr,
        flush=True,
      )

  def close(self) -> None:
    self._bar.close()

  def __enter__(self) -> Progress:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
