"""What a run tells its user: a progress line with an ETA, TensorBoard scalars, and at the
end WORKDIR/metrics.jsonl and WORKDIR/curves.png (loss, accuracy, eval top-1, input wait)."""

from __future__ import annotations

import json
import os
import time

from etils import epath

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
    self.writer.close()
    path = self.workdir / "metrics.jsonl"
    rows = {}
    if path.exists():
      for line in path.read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = row
    for step, row in self.rows.items():
      rows[step] = {**rows.get(step, {}), **row}
    ordered = [rows[s] for s in sorted(rows)]
    path.write_text("".join(json.dumps(r) + "\n" for r in ordered))
    draw(ordered, self.workdir / "curves.png")


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
    if len(series) > 1:
      ax.legend()
  with path.open("wb") as f:
    fig.savefig(f, format="png", dpi=80)
