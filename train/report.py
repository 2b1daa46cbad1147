"""What a run tells its user: a log line per window (loss, speed, input wait and its verdict),
a progress line with an ETA, TensorBoard scalars, and at the end WORKDIR/metrics.jsonl,
WORKDIR/curves.png (loss, accuracy, eval top-1, input wait) and WORKDIR/summary.json.

Input-bound verdict, as XProf defines it: the share of step time the devices sit idle
waiting for the next batch. Before each `next()` the loop waits for the previous step to
finish, so the time then blocked in `next()` is time the devices had nothing to do (without
that wait, `next()` would also count time the devices were still busy). Compilation, the
first log window, and the step right after each eval or checkpoint save are left out; the
steps' own time (`synthetic_steps` on a batch already on the devices) is reported beside it.
With several processes each log line gathers every host's numbers (`train.podview`) and the
verdict is the worst host's, named; so is a host that did not run for seconds (`train.stalls`),
which the others spent waiting for it in a collective, not for input. Each process whose input
was input-bound over the run says, at its end, what bounds it and which settings would raise it
(`advise`: `pipeline.explain` on its last window's stage figures, its host's cores and the step
on device data).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import os
import sys
import time

import jax
import numpy as np
from etils import epath

from pipeline import explain
from pipeline.host import parallelism
from pipeline.host.memory import Split, mb
from pipeline.spec import Spec
from pipeline.stages.stats import Stats
from train import podview, stalls
from train.checkpoints import one_line
from train.config import Plan

MODERATE, HIGH = 0.05, 0.20  # TensorBoard profiler's input-bound thresholds
EXPLAIN_WAIT = (
  "input wait: share of step time the devices sat idle for the next batch (time blocked in "
  "next() after the previous step finished; compilation, the first window and the step after "
  "each eval or save left out); >= 5% is moderately, >= 20% highly input-bound (XProf)"
)

PROGRESS_EVERY_S = 10.0  # between log lines, a progress line at most this often
FIRST_PROGRESS_S = 3.0  # the first one this soon after compilation


def advise(spec: Spec, stages: Stats, step_s: float, cores: int) -> list[str]:
  """What bounds this host's input and what to change, as config.input settings:
  `pipeline.explain` on a window's stage figures (`stages`) with a step of `step_s`."""
  measured = explain.from_stats(spec, stages, cores)
  return explain.brief(
    explain.explain(spec, measured, step_ms=step_s * 1e3), prefix="config.input."
  )


def verdict(wait_share: float) -> str:
  if wait_share >= HIGH:
    return "input-bound"
  if wait_share >= MODERATE:
    return "moderately input-bound"
  return "not input-bound"


@dataclasses.dataclass
class Window:
  """The steps since the last log line, timed without checkpoint saves, evals and logging."""

  start: float = dataclasses.field(default_factory=time.perf_counter)
  cpu_start: float = dataclasses.field(default_factory=time.thread_time)  # the loop's thread
  steps: int = 0
  blocked: float = 0.0  # in next(train) with the devices idle (previous step finished)
  receiving_cpu: float = 0.0  # the loop thread's CPU in next(train): the loader's, not the step's
  paused: float = 0.0  # saving, evaluating: not step time
  paused_cpu: float = 0.0
  settling: int = 0  # steps still to leave out of `blocked` after a pause

  def elapsed(self) -> float:
    return time.perf_counter() - self.start - self.paused

  def host_us_per_step(self) -> float:
    """The training step's host work: the loop thread's CPU per step outside next(train)
    (dispatching the step, its bookkeeping), as `python -m bench scaling --step-us` takes it."""
    cpu = time.thread_time() - self.cpu_start - self.receiving_cpu - self.paused_cpu
    return 1e6 * cpu / max(self.steps, 1)

  def wait(self) -> float:
    return min(1.0, self.blocked / max(self.elapsed(), 1e-9))

  @contextlib.contextmanager
  def pause(self):
    t, c = time.perf_counter(), time.thread_time()
    try:
      yield
    finally:
      self.paused += time.perf_counter() - t
      self.paused_cpu += time.thread_time() - c
      self.settling = 1


def begin(plan: Plan, notes: str) -> None:
  """The plan and the pipeline's `notes` for this host; process 0 says how to read the input
  wait, the others where to look."""
  if jax.process_index() == 0:
    print(f"plan: {plan.describe()}\n{notes}{EXPLAIN_WAIT}", flush=True)
  else:
    print(
      f"process {jax.process_index()}: follow process 0's log (every host's img/s and input "
      f"wait are in it); plan: {plan.describe()}\n{notes}",
      end="",
      flush=True,
    )


def loaders(train: Split, evaluation: Split) -> str:
  """What the train and eval loaders plan to hold, in one phrase (their splits: summary.json)."""
  return (
    f"train {mb(train.total)} of {mb(train.budget)} MB, eval {mb(evaluation.total)} of "
    f"{mb(evaluation.budget)} MB"
  )


class Reporter:
  """A run's speed record and what it says: every process measures its windows and gathers
  every host's (`train.podview`); process 0 (`chief`) prints them and writes the `Log` (made
  with the Reporter: after a refused restore, nothing is written)."""

  def __init__(
    self,
    workdir: epath.Path,
    plan: Plan,
    chief: bool,
    memory: Split,
    eval_memory: Split,
    spec: Spec | None = None,
  ):
    self.workdir, self.plan, self.chief = workdir, plan, chief
    self.memory, self.eval_memory = memory, eval_memory
    self.spec = spec  # the train stream's (None: a mixture's), for `advise`
    self.stages: Stats | None = None  # the last window's stage figures
    self.log = Log(workdir) if chief else None
    self.images_per_sec: list[float] = []  # per window, all processes together
    self.hosts: list[list[podview.Host]] = []  # per window, each process's
    self.synthetic: float | None = None  # seconds per step on a batch already on the devices
    self.host_us: list[float] = []  # per window, this process's host work per step
    self.watchdog = stalls.Watchdog()  # run by the loop; each window takes its longest stall

  def say(self, line: str) -> None:
    if self.chief:
      print(line, flush=True)

  def progress(self, progress: Progress, step: int, window: Window) -> None:
    if self.chief and progress.due():
      print(progress.line(step, self.plan.batch_size, window.wait()), flush=True)

  def window(
    self,
    step: int,
    window: Window,
    metrics: dict,
    lr: float,
    stages: Stats,
    progress: Progress,
  ) -> None:
    """The window's loss, speed and input wait: into the history, and printed and logged by
    process 0, with any host's stall (seconds it did not run, at step: `train.stalls`)."""
    elapsed, host_us = window.elapsed(), window.host_us_per_step()
    wait = min(1.0, window.blocked / elapsed)
    self.host_us.append(host_us)
    ips = window.steps * self.plan.batch_size / elapsed
    requests = stages.storage.requests  # the window's: `stats()` counts since its last call
    self.stages = stages
    # The gather comes last: the next window starts on every host together.
    mine = window.steps * self.plan.local_batch_size / elapsed
    hosts = podview.gather(mine, wait, requests / elapsed, podview.rss_mb(), self.watchdog.take())
    self.images_per_sec.append(ips)
    self.hosts.append(hosts)
    if not self.chief:
      return
    worst = podview.worst(hosts).input_wait_share
    print(
      f"step {step:6d}  loss {metrics['loss']:.4f}  acc {metrics['accuracy']:.3f}  "
      f"lr {lr:.2e}  {ips:7.0f} img/s  input wait {100 * worst:4.1f}% ({verdict(worst)}"
      f"{podview.which(hosts)}; step {1000 * elapsed / window.steps:.0f} ms, "
      f"{1000 * self.synthetic:.0f} ms on device data)  ETA {progress.eta(step)}",
      flush=True,
    )
    if podview.differ(hosts):
      print(podview.rows(hosts, verdict), flush=True)
    for line in podview.stalled(hosts):
      print(line, flush=True)
    sources = getattr(stages, "sources", ())  # a mixture's (`pipeline.mixture`)
    if sources:
      total = max(1, sum(images for _, images, _, _ in sources))
      shares = {name: images / total for name, images, _, _ in sources}
      said = (
        f"{n} {shares[n]:.1%} (weight {w:.1%}, {shares[n] * ips:.0f} img/s)" for n, *_, w in sources
      )
      print(f"sources: {', '.join(said)}", flush=True)
      self.log.scalars(step, "sources", {f"{n}_share": s for n, s in shares.items()})
    scalars = {"loss": metrics["loss"], "accuracy": metrics["accuracy"], "lr": lr}
    scalars.update(images_per_sec=ips, input_wait_share=worst, host_us_per_step=host_us)
    self.log.scalars(step, "train", scalars)
    self.log.scalars(step, "pipeline", stage_scalars(stages))
    self.log.scalars(step, "memory", {"peak_rss_mb": max(h.peak_rss_mb for h in hosts)})
    if len(hosts) > 1:
      for h in hosts:
        self.log.scalars(
          step,
          f"process{h.process}",
          {
            "images_per_sec": h.images_per_sec,
            "input_wait_share": h.input_wait_share,
            "requests_per_sec": h.requests_per_sec,
            "peak_rss_mb": h.peak_rss_mb,
          },
        )

  def eval(self, step: int, ev: dict) -> None:
    if self.chief:
      print(
        f"eval at step {step}: top-1 {ev['eval_top1']:.4f}  top-5 {ev['eval_top5']:.4f}  "
        f"loss {ev['eval_loss']:.4f}{per_source(ev)}",
        flush=True,
      )
      self.log.scalars(step, "eval", eval_scalars(ev))

  def close(self) -> None:
    if self.chief:
      self.log.close()

  def summary(self, ev: dict[str, float], step: int, params_sha256: str) -> dict:
    """The run's summary after the final eval `ev`; process 0 prints its line and writes it
    (WORKDIR/summary.json) with the log."""
    hosts = podview.mean(self.hosts)
    wait = podview.worst(hosts).input_wait_share if hosts else None
    summary = {
      **ev,
      "steps": step,
      "images_per_sec": float(np.mean(self.images_per_sec)) if self.images_per_sec else None,
      "synthetic_step_s": self.synthetic,
      # process 0's, the median over the windows after the first (`Window.host_us_per_step`)
      "host_us_per_step": float(np.median(self.host_us[1:] or self.host_us))
      if self.host_us
      else None,
      "input_wait_share": wait,  # the worst host's
      "verdict": verdict(wait) if hosts else None,
      "verdict_process": podview.worst(hosts).process if hosts else None,
      "peak_rss_mb": max(h.peak_rss_mb for h in hosts) if hosts else None,  # the largest host's
      "loader_memory": self.memory.describe(),  # the train stream's plan, on each host
      "eval_loader_memory": self.eval_memory.describe(),
      "hosts": [{**dataclasses.asdict(h), "verdict": verdict(h.input_wait_share)} for h in hosts],
      "params_sha256": params_sha256,
      "devices": jax.device_count(),
      "processes": jax.process_count(),
      "plan": dataclasses.asdict(self.plan),
    }
    if self.chief:
      print(
        f"eval: top-1 {ev['eval_top1']:.4f}  top-5 {ev['eval_top5']:.4f} over "
        f"{ev['eval_examples']} examples; "
        f"{summary['verdict'] + podview.which(hosts) if hosts else 'no steps timed'}",
        flush=True,
      )
      for name, e in ev.get("eval_sources", {}).items():
        print(
          f"eval {name}: top-1 {e['top1']:.4f}  top-5 {e['top5']:.4f}  loss {e['loss']:.4f} "
          f"over {e['examples']} examples",
          flush=True,
        )
      if hosts:
        print(
          f"peak RSS {summary['peak_rss_mb']:,.0f} MB on the largest host (its process tree: "
          f"the model, XLA and the loaders); the loaders plan "
          f"{loaders(self.memory, self.eval_memory)}; the step's host work "
          f"{summary['host_us_per_step']:,.0f} us per step (bench scaling --step-us)",
          flush=True,
        )
      self.log.scalars(step, "eval", eval_scalars(ev))
      self.log.close()
      text = json.dumps(summary, indent=2) + "\n"
      write_atomically(self.workdir / "summary.json", text.encode())
    self.advise([h for h in hosts if h.process == jax.process_index()])
    return summary

  def advise(self, mine: list[podview.Host]) -> None:
    """Where this process's input was at least moderately input-bound over the run (`mine`: its
    row, if timed), what bounds it and what to change, from its last window (`advise`)."""
    if not (mine and self.spec and self.stages and mine[0].input_wait_share >= MODERATE):
      return
    try:
      said = advise(self.spec, self.stages, self.synthetic, parallelism.available_cores())
    except ValueError:  # the last window's stats hold no batch finished within it
      return
    who = f"process {jax.process_index()}: " if jax.process_count() > 1 else ""
    print("\n".join(who + line for line in said), flush=True)


def per_source(ev: dict) -> str:
  """Each eval source's top-1 and loss (`train.inputs.evaluate`), as the eval line's tail."""
  said = [
    f"{n} top-1 {e['top1']:.4f} loss {e['loss']:.4f}" for n, e in ev.get("eval_sources", {}).items()
  ]
  return f"; {', '.join(said)}" if said else ""


def eval_scalars(ev: dict) -> dict[str, float]:
  """The eval's TensorBoard scalars: top-1, top-5 and loss, overall and per source."""
  out = {"top1": ev["eval_top1"], "top5": ev["eval_top5"], "loss": ev["eval_loss"]}
  for name, e in ev.get("eval_sources", {}).items():
    out.update({f"{name}_{k}": e[k] for k in ("top1", "top5", "loss")})
  return out


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


def stage_scalars(stats: Stats) -> dict[str, float]:
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
