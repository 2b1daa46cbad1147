"""`python -m bench all DATA_DIR`: every benchmark, then a report (REPORT.md).

    make bench                  # the built-in photos, full size: everything in runs/bench
    make bench-report           # the same, rewriting the committed report (--refresh)
    python -m bench all data/photos --quick --only ceiling,doctor

Each benchmark runs in its own fresh process (its start-up, memory and cores are its own,
and one that fails leaves the others' figures), writes OUT/NAME.json and OUT/NAME.log, and
gets a section of REPORT.md: its tables and pictures, the machine and the exact command.
REPORT.md and the pictures go to OUT too, unless --refresh asks for the committed copies:
bench/REPORT.md and its pictures in docs/bench/. Figures measured by hand go to docs/HISTORY.md,
finished studies to docs/study/: neither is rewritten here.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata

import tqdm
from matplotlib import figure

from bench import ceiling, measure, scaling
from pipeline.catalog import manifest as manifest_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Outputs:
  """Where a run writes: the benchmarks' JSON and logs, the report, its pictures."""

  work: pathlib.Path
  report: pathlib.Path
  pictures: pathlib.Path

  @classmethod
  def at(cls, out: pathlib.Path, refresh: bool) -> Outputs:
    """Everything in `out`; with `refresh`, the report and pictures in the repository's
    committed places (named relative to the working directory, as commands show them)."""
    if not refresh:
      return cls(out, out / "REPORT.md", out)
    here = lambda *parts: pathlib.Path(os.path.relpath(ROOT.joinpath(*parts)))
    return cls(out, here("bench", "REPORT.md"), here("docs", "bench"))

  def link(self, path: pathlib.Path) -> str:
    """`path` as a link from the report."""
    return pathlib.Path(os.path.relpath(path, self.report.parent)).as_posix()


@dataclasses.dataclass
class Step:
  """One benchmark: its CLI arguments (full and --quick) and how its section is written."""

  name: str
  title: str
  argv: Callable[[argparse.Namespace, Outputs], list[str]]
  section: Callable[[Outputs, dict, str], str]
  module: str = ""  # default: python -m bench NAME

  def command(self, args, out: Outputs) -> list[str]:
    """The user-facing command (python -m bench NAME ...)."""
    base = ["-m", self.module] if self.module else ["-m", "bench", self.name]
    return ["python", *base, *self.argv(args, out)]


def _flags(args, **values) -> list[str]:
  """`--name value` options; a (full, quick) pair gives the value by --quick."""
  return measure.flags(
    **{k: v[args.quick] if isinstance(v, tuple) else v for k, v in values.items()}
  )


# ---------------------------------------------------------------- sections


def _figure_line(info: dict, command: str) -> str:
  took = f" ({info['bench_seconds']:.0f} s)" if "bench_seconds" in info else ""
  machine = info.get("machine", measure.machine())
  return f"*Machine: {machine}; {datetime.date.today()}. Command: `{command}`{took}*"


def _ceiling(out: Outputs, info, command) -> str:
  return f"{ceiling.table(info)}\n\n{_figure_line(info, command)}"


def _throughput(out: Outputs, info, command) -> str:
  lines = [
    "| images/s | first batch (s) | peak RSS (MB) | images timed |",
    "|---:|---:|---:|---:|",
    (
      f"| {info['images_per_sec']:.0f} | {info['first_batch_s']:.2f} | "
      f"{info['peak_rss_mb']:.0f} | {info['images']} |"
    ),
  ]
  ceil = _load(out.work / "ceiling.json")
  if ceil:
    full = ceil["ceiling_images_per_sec"]["1/1"]
    lines.append(
      f"\nThat is **{info['images_per_sec'] / full:.0%}** of the cores' raw full-"
      f"decode rate ({full:.0f} img/s, `ceiling` below), while also parsing, "
      "cropping, resizing, flipping and batching."
    )
  stages = info.get("stages_ms_per_image")
  if stages:
    lines += [
      "\nPer image, each stage alone on one thread (ms):\n",
      "| " + " | ".join(stages) + " |",
      "|" + "---:|" * len(stages),
      "| " + " | ".join(f"{v:.3f}" for v in stages.values()) + " |",
    ]
  return "\n".join(lines) + f"\n\n{_figure_line(info, command)}"


def _peers(out: Outputs, info, command) -> str:
  rows = info["results"]
  base = next((r for r in rows if r["name"] == "tfdata"), None)
  lines = [
    "| loader | images/s | first batch (s) | peak RSS (MB) | throughput vs tf.data |",
    "|---|---:|---:|---:|---:|",
  ]
  for r in rows:
    ratio = f"x{r['images_per_sec'] / base['images_per_sec']:.2f}" if base else "—"
    lines.append(
      f"| {r['name']} | {r['images_per_sec']:.0f} | {r['first_batch_s']:.2f} | "
      f"{r['peak_rss_mb']:.0f} | {ratio} |"
    )
  bars = {r["name"]: r["images_per_sec"] for r in rows}
  ceil = _load(out.work / "ceiling.json")
  if ceil:
    bars.update({f"ceiling: decode {k} only": v for k, v in ceil["ceiling_images_per_sec"].items()})
  picture = out.pictures / "throughput.png"
  _bars(picture, "images/s, same photos and augmentation", bars)
  return (
    "\n".join(lines) + f"\n\n![throughput]({out.link(picture)})\n\n" + _figure_line(info, command)
  )


def _device(out: Outputs, info, command) -> str:
  names = [k for k in ("host", "host_prefetch", "device") if k in info]
  lines = ["| variant | images/s | first batch (s) |", "|---|---:|---:|"]
  lines += [
    f"| {n} | {info[n]['images_per_s']:.0f} | {info[n]['first_batch_s']:.2f} |" for n in names
  ]
  lines.append(
    f"\ndevice / host: {info['ratio']:.3f}; device / host_prefetch: "
    f"{info['transfer_ratio']:.3f}; backend {info['setup']['backend']}, "
    f"{info['setup']['devices']} device(s)."
  )
  return "\n".join(lines) + f"\n\n{_figure_line(info, command)}"


def _doctor(out: Outputs, info, command) -> str:
  recs = info["recommendations"]
  lines = [
    (
      f"Bottleneck: **{info['bottleneck']}** ({info['limit']}); measured "
      f"{info['run']['images_per_sec']:.0f} img/s, model {info['predicted']:.0f} img/s."
    )
  ]
  lines += [
    f"- {r['field']} {r['current']} -> {r['proposed']}: expected "
    f"{r['expected_images_per_sec']:.0f} img/s (x{r['gain']:.2f})"
    for r in recs
  ]
  log = (out.work / "doctor.log").read_text()
  return (
    "\n".join(lines) + f"\n\n```\n{log.strip()}\n```\n\n"
    f"![doctor timeline]({out.link(out.pictures / 'doctor_timeline.png')})\n\n"
    + _figure_line(info, command)
  )


def _log_section(out: Outputs, info, command, name) -> str:
  """For benchmarks whose printed output is the report (a Markdown table and lines)."""
  log = (out.work / f"{name}.log").read_text().strip()
  return f"{log}\n\n{_figure_line(info, command)}"


def _scaling(out: Outputs, info, command) -> str:
  return (
    f"{scaling.table(info)}\n\nMethod (bench/scaling.py):\n\n{scaling.method()}\n\n"
    f"{_figure_line(info, command)}"
  )


def _bars(path: pathlib.Path, title: str, values: dict[str, float]) -> None:
  fig = figure.Figure(figsize=(9, 0.6 + 0.32 * len(values)))
  ax = fig.subplots()
  names = list(values)[::-1]
  ax.barh(
    names,
    [values[n] for n in names],
    color=["#bbbbbb" if n.startswith("ceiling") else "#4c72b0" for n in names],
  )
  for y, n in enumerate(names):
    ax.text(values[n], y, f" {values[n]:.0f}", va="center", fontsize=8)
  ax.set_title(title)
  ax.set_xlim(0, max(values.values()) * 1.15)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def _load(path: pathlib.Path) -> dict | None:
  return json.loads(path.read_text()) if path.exists() else None


# ---------------------------------------------------------------- the steps


STEPS = [
  Step(
    "ceiling",
    "Ceiling: the cores' raw JPEG decode rate",
    lambda a, o: [
      a.data_dir,
      *_flags(a, images=(400, 40), repeats=(2, 1), json=o.work / "ceiling.json"),
    ],
    _ceiling,
  ),
  Step(
    "throughput",
    "Throughput of the pipeline, with the per-stage breakdown",
    lambda a, o: [
      a.data_dir,
      *_flags(a, epochs=(3, 0.5), batch_size=(128, 16), json=o.work / "throughput.json"),
    ],
    _throughput,
  ),
  Step(
    "peers",
    "Peers: tf.data (tuned per its guide), Grain baseline, PyTorch",
    lambda a, o: [
      a.data_dir,
      *_flags(a, epochs=(3, 0.5), batch_size=(128, 16), json=o.work / "peers.json"),
    ],
    _peers,
  ),
  Step(
    "device",
    "Device feeding: host pipeline alone vs through device_prefetch",
    lambda a, o: _flags(a, batches=(20, 3), rounds=(3, 1), batch=(128, 16)),
    _device,
  ),
  Step(
    "convert",
    "Conversion: images/s and MB/s",
    lambda a, o: [a.data_dir, *_flags(a, repeats=(2, 1), json=o.work / "convert.json")],
    lambda o, i, c: _log_section(o, i, c, "convert"),
  ),
  Step(
    "scaling",
    "Scaling: one process's ceiling, worker processes, many-core hosts",
    lambda a, o: [
      a.data_dir,
      *_flags(
        a,
        seconds=(3, 0.2),
        threads=("1,2,4,8,16,32", "1,2"),
        batch_size=(128, 16),
        host_batch=("128,1024", "16"),
        json=o.work / "scaling.json",
      ),
    ],
    _scaling,
  ),
  Step(
    "doctor",
    "The doctor on the default settings",
    lambda a, o: [
      a.data_dir,
      *_flags(
        a,
        seconds=(5, 1),
        sample=(128, 16),
        batch_size=(128, 16),
        timeline=o.pictures / "doctor_timeline.png",
        json=o.work / "doctor.json",
      ),
    ],
    _doctor,
    module="bench.doctor",
  ),
]


def run_step(step: Step, args, out: Outputs) -> tuple[dict, str]:
  """Runs one benchmark; returns its JSON figures (or what it printed last, plus the
  seconds it took) and its command. Raises RuntimeError with its last line and the log's
  name when it fails."""
  command = step.command(args, out)
  log = out.work / f"{step.name}.log"
  start = time.perf_counter()
  env = {**os.environ, "TQDM_DISABLE": "1"}
  proc = subprocess.run(
    [sys.executable, *command[1:]],
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    check=False,
    env=env,
  )
  log.write_text(proc.stdout)
  if proc.returncode:
    last = proc.stdout.strip().splitlines()[-1:] or [""]
    raise RuntimeError(f"{step.name} failed (exit {proc.returncode}): {last[0]} (log: {log})")
  info = _load(out.work / f"{step.name}.json")
  if info is None:  # a benchmark that prints its figures as a last JSON line
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "{}"
    info = json.loads(last) if last.startswith("{") else {}
  info.setdefault("machine", measure.machine())
  info["bench_seconds"] = time.perf_counter() - start
  return info, " ".join(command)


def _header(args, argv, load: float) -> str:
  try:
    commit = (
      subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
      ).stdout.strip()
      or "unknown"
    )
  except OSError:
    commit = "unknown"
  return (
    f"# Benchmarks\n\nWritten by `python -m bench all {' '.join(argv)}` on "
    f"{datetime.datetime.now().isoformat(timespec='minutes')} (commit {commit}).\n\n"
    f"Machine: {measure.machine()}; Python {platform.python_version()}, grain "
    f"{metadata.version('grain')}; load average {load:.1f} at the start (figures from a "
    "shared machine are noisy: compare ratios within one run, not against other runs).\n"
    f"Data: `{args.data_dir}`; {_cached(args.data_dir)} of its shards' pages were in the "
    "page cache at the start (mincore).\n\n"
    "Figures measured by hand, round by round, each with its date and command: "
    "[docs/HISTORY.md](../docs/HISTORY.md); finished studies: "
    "[docs/study/](../docs/study/RESULTS.md).\n"
  )


def _cached(data_dir: str) -> str:
  try:
    meta = manifest_lib.load(data_dir)
    paths = [os.fspath(p) for split in meta.splits for p in meta.shard_paths(data_dir, split)]
    return f"{measure.cached_share(paths):.0%}"
  except (OSError, KeyError, ValueError):
    return "an unknown share"


def _summary(out: pathlib.Path) -> str:
  """The headline figures of this run, from the benchmarks' JSON and logs in `out`."""
  lines = []
  tp, ceil = _load(out / "throughput.json"), _load(out / "ceiling.json")
  if tp:
    share = (
      f", {tp['images_per_sec'] / ceil['ceiling_images_per_sec']['1/1']:.0%} of the "
      "cores' raw full-decode rate"
      if ceil
      else ""
    )
    lines.append(
      f"- Pipeline: {tp['images_per_sec']:.0f} img/s{share}; first batch "
      f"{tp['first_batch_s']:.2f} s; peak RSS {tp['peak_rss_mb']:.0f} MB."
    )
  peers = _load(out / "peers.json")
  by = {r["name"]: r for r in peers["results"]} if peers else {}
  if "pipeline" in by and "tfdata" in by:
    a, b = by["pipeline"], by["tfdata"]
    lines.append(
      f"- vs tf.data tuned per its guide: throughput x"
      f"{a['images_per_sec'] / b['images_per_sec']:.2f}, first batch x"
      f"{a['first_batch_s'] / b['first_batch_s']:.2f}, peak RSS x"
      f"{a['peak_rss_mb'] / b['peak_rss_mb']:.2f}."
    )
  doc = _load(out / "doctor.json")
  if doc:
    recs = (
      "; ".join(
        f"{r['field']} {r['current']} -> {r['proposed']} (x{r['gain']:.2f})"
        for r in doc["recommendations"]
      )
      or "no change"
    )
    lines.append(f"- Doctor: bottleneck {doc['bottleneck']}; recommends {recs}.")
  sc = _load(out / "scaling.json")
  if sc:
    host = max(sc["hosts"], key=lambda h: (h["cores"], -h["batch"]))
    lines.append(
      f"- Scaling: one process tops out at {sc['process_ceiling_img_s']:.0f} img/s here "
      f"(bound by {sc['ceiling_bound_by']}; {sc['gil_held_us_per_image']:.0f} us of GIL-held "
      f"work per image, measured); {host['cores']} "
      f"cores projected {host['projected_img_s']:,} img/s with {host['workers']} workers x "
      f"{host['threads']} threads (batch {host['batch']})."
    )
  return "## Summary\n\n" + "\n".join(lines) + "\n" if lines else ""


def main(argv: list[str]) -> pathlib.Path:
  p = measure.Parser(
    prog="python -m bench all",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("data_dir", help="a converted dataset, e.g. data/photos (make data)")
  p.add_argument(
    "--out",
    default="runs/bench",
    help="directory for the JSON figures and logs, and (without --refresh) "
    "REPORT.md and the pictures (default: runs/bench)",
  )
  p.add_argument(
    "--refresh",
    action="store_true",
    help="rewrite the committed report: bench/REPORT.md and docs/bench/*.png (every "
    "benchmark, full size)",
  )
  p.add_argument(
    "--only",
    default=",".join(s.name for s in STEPS),
    help="comma-separated subset of: " + ", ".join(s.name for s in STEPS),
  )
  p.add_argument("--quick", action="store_true", help="tiny sizes: checks the plumbing only")
  args = p.parse_args(argv)
  names = [n.strip() for n in args.only.split(",") if n.strip()]
  unknown = sorted(set(names) - {s.name for s in STEPS})
  if unknown:
    p.error(f"unknown benchmarks {unknown}")
  if args.refresh and (args.quick or len(names) < len(STEPS)):
    p.error(
      "--refresh rewrites the whole committed report: run every benchmark at full "
      "size (without --quick and --only)"
    )
  out = Outputs.at(pathlib.Path(args.out), args.refresh)
  for folder in (out.work, out.report.parent, out.pictures):
    folder.mkdir(parents=True, exist_ok=True)
  report = [_header(args, argv, os.getloadavg()[0])]
  steps = [s for s in STEPS if s.name in names]
  for step in (bar := tqdm.tqdm(steps, desc="bench", unit="benchmark")):
    bar.set_postfix_str(step.name)
    report.append(f"## {step.title}\n")
    try:
      info, command = run_step(step, args, out)
      report.append(step.section(out, info, command) + "\n")
    except (RuntimeError, KeyError, ValueError) as e:
      report.append(f"Not reported: {e}\n")
      print(f"{step.name}: {e}", file=sys.stderr)
  report.insert(1, _summary(out.work))
  out.report.write_text("\n".join(report))
  print(f"wrote {out.report}")
  return out.report


if __name__ == "__main__":
  measure.run_cli(main, sys.argv[1:])
