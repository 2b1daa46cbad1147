"""What a run tells its user: a progress line with an ETA, TensorBoard scalars, and at the
end WORKDIR/metrics.jsonl and WORKDIR/curves.png (loss, accuracy, eval top-1, input wait)."""

from __future__ import annotations

import io
import itertools
import json
import os
import sys
import time

from etils import epath

from train.checkpoints import one_line

PROGRESS_EVERY_S = 10.0  # between log lines, a progress line at most this often
FIRST_PROGRESS_S = 3.0  # the first one this soon after compilation


def duration(seconds: float) -> str:
  seconds = int(max(0.0, seconds))
  return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
  """Steps per second over this run's steps so far (compilation excluded) and the ETA."""

  def __init__(self, first_step: int, total: int):
    self.first, self.total = first_step, total
    self.start = time.perf_counter()
    self.shown = self.start - PROGRESS_EVERY_S + FIRST_PROGRESS_S

  def per_step(self, step: int) -> float:
    return (time.perf_counter() - self.start) / max(1, step - self.first)

  def eta(self, step: int) -> str:
    self.shown = time.perf_counter()
    return duration(self.per_step(step) * (self.total - step))

  def line(self, step: int, batch_size: int, wait: float) -> str:
    return (
      f"step {step}/{self.total} ({100 * step // self.total}%)  "
      f"{batch_size / self.per_step(step):.0f} img/s  input wait {100 * wait:.1f}%  "
      f"ETA {self.eta(step)}"
    )

  def due(self) -> bool:
    return time.perf_counter() - self.shown >= PROGRESS_EVERY_S


class Log:
  """Scalars to TensorBoard (WORKDIR/tensorboard) and, at `close`, to metrics.jsonl (earlier
  runs' rows kept, a step logged again replaced) and curves.png. Process 0 only."""

  def __init__(self, workdir: epath.Path):
    from tensorboardX import SummaryWriter

    self.workdir = workdir
    self.writer = SummaryWriter(os.fspath(workdir / "tensorboard"))
    self.rows: dict[int, dict] = {}

  def scalars(self, step: int, group: str, values: dict) -> None:
    row = self.rows.setdefault(step, {"step": step})
    for k, v in values.items():
      self.writer.add_scalar(f"{group}/{k}", float(v), step)
      row[f"{group}/{k}"] = float(v)

  def close(self) -> None:
    """Writes the TensorBoard events, metrics.jsonl and curves.png; one that cannot be written
    is a warning line, never the end of the run."""
    try:
      self.writer.close()
    except OSError as e:
      warn(f"cannot write {self.workdir / 'tensorboard'} ({one_line(e)})")
    path = self.workdir / "metrics.jsonl"
    rows = self.rows
    try:
      rows = merged(earlier_rows(path), self.rows)
      write_atomically(path, "".join(json.dumps(rows[s]) + "\n" for s in sorted(rows)).encode())
    except OSError as e:
      warn(f"cannot write {path} ({one_line(e)})")
    try:
      draw([rows[s] for s in sorted(rows)], self.workdir / "curves.png")
    except OSError as e:
      warn(f"cannot write {self.workdir / 'curves.png'} ({one_line(e)})")


def merged(earlier: dict[int, dict], new: dict[int, dict]) -> dict[int, dict]:
  """Earlier rows with this run's added; a step logged again takes this run's values."""
  rows = dict(earlier)
  for step, row in new.items():
    rows[step] = {**rows.get(step, {}), **row}
  return rows


def earlier_rows(path: epath.Path) -> dict[int, dict]:
  """An earlier run's metrics.jsonl rows by step. A file this trainer did not write whole (a
  cut line, a row without a step, not JSON) is renamed aside with a warning, never lost."""
  if not path.exists():
    return {}
  rows = {}
  for number, line in enumerate(path.read_bytes().decode(errors="replace").splitlines(), 1):
    row = parse_row(line)
    if row is None:
      aside = free_name(path, "damaged")
      path.rename(aside)
      warn(f"{path} line {number} is not a metrics row: moved it to {aside} and began anew")
      return {}
    rows[row["step"]] = row
  return rows


def parse_row(line: str) -> dict | None:
  try:
    row = json.loads(line)
  except ValueError:
    return None
  ok = isinstance(row, dict) and isinstance(row.get("step"), int)
  return row if ok else None


def free_name(path: epath.Path, tag: str) -> epath.Path:
  """PATH.TAG, or PATH.TAG-2, -3...: the first name not taken."""
  candidates = (
    path.with_name(f"{path.name}.{tag}" + (f"-{n}" if n > 1 else "")) for n in itertools.count(1)
  )
  return next(p for p in candidates if not p.exists())


def write_atomically(path: epath.Path, data: bytes) -> None:
  """`data` to a temporary file beside `path`, then renamed over it: a kill or a full disk
  leaves the old file or the new one, never a part."""
  tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
  try:
    tmp.write_bytes(data)
    tmp.replace(path)
  finally:
    if tmp.exists():
      tmp.unlink()


def warn(message: str) -> None:
  print(f"warning: {message}", file=sys.stderr, flush=True)


def draw(rows: list[dict], path: epath.Path) -> None:
  """Loss, accuracy with eval top-1, and input wait against the step, as one PNG."""
  from matplotlib import figure

  fig = figure.Figure(figsize=(12, 3.5), layout="constrained")
  panels = [
    ("loss", [("train/loss", "train loss")], None),
    ("accuracy", [("train/accuracy", "train (batch)"), ("eval/top1", "eval top-1")], 1.0),
    ("input wait (share of step time)", [("train/input_wait_share", "input wait")], 0.25),
  ]
  for ax, (title, series, top) in zip(fig.subplots(1, 3), panels):
    for key, label in series:
      points = [(r["step"], r[key]) for r in rows if key in r]
      if points:
        ax.plot(*zip(*points), marker="o" if len(points) < 20 else None, label=label)
    ax.set(title=title, xlabel="step")
    if top is not None:
      ax.set_ylim(0, max([top] + [r[k] for r in rows for k, _ in series if k in r]))
    ax.grid(alpha=0.3)
    if len(series) > 1 and ax.get_legend_handles_labels()[0]:  # no legend before the first row
      ax.legend()
  png = io.BytesIO()
  fig.savefig(png, format="png", dpi=80)
  write_atomically(path, png.getvalue())


def stage_scalars(stats) -> dict[str, float]:
  """A host's pipeline stages (`pipeline.stats_of`) as TensorBoard scalars: per stage its
  threads kept busy (all processes together), the largest share of time its consumer waited
  for it and the largest p99 of its tasks (ms)."""
  out: dict[str, float] = {}
  for row in stats.rows:
    busy, wait, p99 = (f"{row.stage}_{k}" for k in ("busy", "wait_share", "p99_ms"))
    out[busy] = out.get(busy, 0.0) + row.busy
    out[wait] = max(out.get(wait, 0.0), row.wait_share)
    out[p99] = max(out.get(p99, 0.0), row.p99_ms)
  return out
