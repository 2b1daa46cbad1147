"""`python -m pipeline.convert`: image folders, TFRecords and TFDS datasets to ArrayRecord.

  python -m pipeline.convert images SRC OUT [--val-fraction 0.1] [--workers 8]
  python -m pipeline.convert images train/ OUT && \\
      python -m pipeline.convert images val/ OUT --split validation    # ImageNet layout
      # (a flat val/: add --labels LOC_val_solution.csv)
  python -m pipeline.convert tfrecord 'train-*.tfrecord' OUT --num-classes 1000
  python -m pipeline.convert tfds imagenet2012 OUT --data-dir ~/tensorflow_datasets
  python -m pipeline.convert tfds imagenet2012 OUT --split train --split validation
  python -m pipeline.convert images gs://BUCKET/raw gs://BUCKET/ds   # also tfrecord, tfds, builtin
  python -m pipeline.convert verify OUT
  python -m pipeline.convert builtin data
  python -m pipeline.convert images SRC OUT --runner DirectRunner   # Apache Beam
  python -m pipeline.convert images gs://B/raw gs://B/ds --runner DataflowRunner ...  # docs/DATA.md

A conversion adds its splits to a dataset already in OUT (same classes) and refuses to
replace splits of another conversion unless --overwrite. Errors are one line (exit status 2
for usage errors); --verbose shows the traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
from collections.abc import Callable

from pipeline.catalog import manifest as manifest_lib
from pipeline.catalog import records
from pipeline.convert import checks, shards
from pipeline.host import extras
from pipeline.storage import stalled


class _Parser(argparse.ArgumentParser):
  """Usage errors in one line (argparse prints the whole usage first)."""

  def error(self, message: str):
    self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _number(kind: type, low: float, low_ok: bool, high: float = math.inf):
  """An argparse type: a `kind` number in (low, high) or [low, high)."""

  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
        f"{text!r} is not {'a number' if kind is float else 'an integer'}"
      ) from None
    if not (math.isfinite(value) and (value >= low if low_ok else value > low) and value < high):
      bounds = f"{'[' if low_ok else '('}{low:g}, {high:g})"
      raise argparse.ArgumentTypeError(f"{text} is outside {bounds}")
    return value

  parse.__name__ = kind.__name__
  return parse


_POSITIVE_INT = _number(int, 0, low_ok=False)


def _options(progress: bool = True) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(add_help=False)
  p.add_argument(
    "--workers", type=_POSITIVE_INT, default=None, help="worker processes (default: all cores)"
  )
  if progress:
    p.add_argument(
      "--no-progress",
      dest="progress",
      action="store_false",
      help="no progress (a bar on a terminal, else a line per 10%%)",
    )
  p.add_argument("--verbose", action="store_true", help="show tracebacks of errors")
  return p


def _common(p: argparse.ArgumentParser, split: bool = True) -> None:
  if split:
    p.add_argument("--split", default="train", help="split name (default: train)")
  p.add_argument(
    "--shard-size-mb",
    type=_number(float, 0, low_ok=False),
    default=shards.DEFAULT_SHARD_SIZE_MB,
    help="target shard size in MiB (default: %(default)s)",
  )
  p.add_argument(
    "--max-pixels",
    type=_POSITIVE_INT,
    default=checks.MAX_PIXELS,
    help="images with more pixels are skipped as decompression bombs",
  )
  p.add_argument(
    "--overwrite",
    action="store_true",
    help="replace splits of another conversion (or files) already in OUT",
  )


def _beam(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "--runner",
    default=None,
    help="run as an Apache Beam pipeline on this runner (DirectRunner, DaskRunner, "
    "DataflowRunner, FlinkRunner, SparkRunner); other unknown flags go "
    "to Beam's PipelineOptions",
  )


def _images_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("src", help="image folder laid out as SRC/CLASS/IMAGE")
  p.add_argument("out", help="output folder for shards and manifest.json")
  p.add_argument(
    "--val-fraction",
    type=_number(float, 0, low_ok=True, high=1),
    default=0.0,
    help="also write a 'validation' split with this fraction of each class",
  )
  p.add_argument("--seed", type=int, default=0, help="seed of the split and record order")
  p.add_argument(
    "--label-map",
    default=None,
    help="JSON {class: label} or one class name per line (line = label)",
  )
  p.add_argument(
    "--max-size",
    type=_POSITIVE_INT,
    default=None,
    help="re-encode images whose shorter side exceeds this many pixels",
  )
  p.add_argument(
    "--follow-symlinks", action="store_true", help="follow symlinks that point outside SRC"
  )
  p.add_argument(
    "--labels",
    default=None,
    help="SRC is a flat folder and this CSV names each file's class: FILE,CLASS "
    "rows (header, extension and extra words optional), e.g. ImageNet's "
    "LOC_val_solution.csv",
  )
  _common(p)
  _beam(p)


def _tfrecord_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("pattern", help="glob of TFRecord files (quote it)")
  p.add_argument("out", help="output folder")
  group = p.add_mutually_exclusive_group(required=True)
  group.add_argument("--num-classes", type=_POSITIVE_INT, help="labels must lie in [0, N)")
  group.add_argument("--classes", help="file with one class name per line (line = label)")
  p.add_argument(
    "--keys", default=None, help="IMAGE,LABEL[,FILENAME] feature keys (default: detected)"
  )
  _common(p)
  _beam(p)


def _tfds_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("name", help="dataset name, e.g. imagenet2012 or mnist:3.0.1")
  p.add_argument("out", help="output folder")
  p.add_argument(
    "--data-dir",
    default=None,
    help="TFDS data dir holding the prepared data, or its version folder (default: "
    "$TFDS_DATA_DIR, else ~/tensorflow_datasets)",
  )
  p.add_argument(
    "--split",
    action="append",
    default=None,
    help="a split to convert; repeat for several (default: every split; splits without "
    "labels, label -1, are skipped)",
  )
  _common(p, split=False)


def _verify_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("out", help="converted dataset folder (holding manifest.json)")
  p.add_argument(
    "--read-deadline-s",
    type=_number(float, 0, low_ok=False),
    default=None,
    help="on a mount, the longest wait for any read, the shards' in the worker processes too "
    "(default: 60 s)",
  )


def _builtin_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument(
    "data_dir", nargs="?", default="data", help="a folder or a gs:// URL (default: data)"
  )


def _keys(text: str | None) -> records.Keys | None:
  if text is None:
    return None
  parts = text.split(",")
  if len(parts) not in (2, 3) or not all(parts[:2]):
    raise ValueError(f"--keys wants IMAGE,LABEL[,FILENAME], got {text!r}")
  return records.Keys(*parts)


def _quiet_engine(runner: str) -> None:
  """A local Dask cluster logs every worker's start and stop: its warnings only. Checks
  first that the engine is installed."""
  from pipeline.convert import beam

  beam.require(runner)
  if runner.endswith("DaskRunner"):
    import distributed  # noqa: F401 - its import sets its loggers' levels: set them after

    logging.getLogger("distributed").setLevel(logging.WARNING)


def _done(out: str, m: manifest_lib.Manifest) -> int:
  print(f"{out}: {shards.summary(m)}")
  return 0


def _convert(args: argparse.Namespace, beam_args: list[str], request, here, on_beam) -> int:
  """`request` converted in this process's workers (`here`), or by Beam's --runner."""
  if not args.runner:
    return _done(args.out, here(request, args.workers, args.progress))
  _quiet_engine(args.runner)
  on = {"runner": args.runner, "pipeline_args": beam_args, "progress": args.progress}
  return _done(args.out, on_beam(request, **on))


def _images(args: argparse.Namespace, beam_args: list[str]) -> int:
  from pipeline.convert import beam, images  # here: a fast --help

  request = images.Request(
    args.src,
    args.out,
    split=args.split,
    val_fraction=args.val_fraction,
    seed=args.seed,
    label_map=args.label_map,
    shard_size_mb=args.shard_size_mb,
    max_size=args.max_size,
    max_pixels=args.max_pixels,
    follow_symlinks=args.follow_symlinks,
    labels=args.labels,
    overwrite=args.overwrite,
  )
  return _convert(args, beam_args, request, images.convert, beam.convert_images)


def _tfrecord(args: argparse.Namespace, beam_args: list[str]) -> int:
  from pipeline.convert import beam, tfrecord

  request = tfrecord.Request(
    args.pattern,
    args.out,
    split=args.split,
    keys=_keys(args.keys),
    num_classes=args.num_classes,
    classes=args.classes,
    shard_size_mb=args.shard_size_mb,
    max_pixels=args.max_pixels,
    overwrite=args.overwrite,
  )
  return _convert(args, beam_args, request, tfrecord.convert, beam.convert_tfrecord)


def _tfds(args: argparse.Namespace, beam_args: list[str]) -> int:
  from pipeline.convert import tfds

  request = tfds.Request(
    args.name,
    args.out,
    data_dir=args.data_dir,
    split=args.split,
    shard_size_mb=args.shard_size_mb,
    max_pixels=args.max_pixels,
    overwrite=args.overwrite,
  )
  return _done(args.out, tfds.convert(request, args.workers, args.progress))


def _verify(args: argparse.Namespace, beam_args: list[str]) -> int:
  from pipeline.convert import verify

  try:
    manifest_lib.load(args.out, args.read_deadline_s)  # a wrong folder: exit 2, raised here
  except manifest_lib.ManifestError as e:
    print(f"{args.out}: {e}")
    return 1
  report = verify.verify(
    args.out, workers=args.workers, progress=args.progress, deadline_s=args.read_deadline_s
  )
  print(report)
  return 0 if report.ok else 1


def _builtin(args: argparse.Namespace, beam_args: list[str]) -> int:
  from pipeline.convert import builtin

  built = builtin.build(args.data_dir, workers=args.workers, progress=args.progress)
  for name, m in built.items():
    print(f"{args.data_dir}/{name}: {shards.summary(m)}")
  return 0


@dataclasses.dataclass(frozen=True)
class Command:
  """A command: its line in --help, its arguments, and what it runs (with Beam's flags)."""

  help: str
  arguments: Callable[[argparse.ArgumentParser], None]
  run: Callable[[argparse.Namespace, list[str]], int]


COMMANDS = {
  "images": Command("an image folder SRC/CLASS/IMAGE", _images_arguments, _images),
  "tfrecord": Command(
    "TFRecord files of tf.train.Example, bytes copied", _tfrecord_arguments, _tfrecord
  ),
  "tfds": Command("a TFDS dataset prepared in a local data dir", _tfds_arguments, _tfds),
  "verify": Command("re-read and check a converted dataset", _verify_arguments, _verify),
  "builtin": Command("build the built-in digits and photos datasets", _builtin_arguments, _builtin),
}


def _parser() -> argparse.ArgumentParser:
  parser = _Parser(
    prog="python -m pipeline.convert",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  sub = parser.add_subparsers(dest="command", required=True)
  options = [_options()]
  for name, command in COMMANDS.items():
    command.arguments(sub.add_parser(name, help=command.help, parents=options))
  return parser


def _one_line(e: BaseException) -> str:
  text = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
  return " ".join(line.strip() for line in str(text).splitlines() if line.strip())


def main(argv: list[str] | None = None) -> int:
  parser = _parser()
  args, rest = parser.parse_known_args(argv)
  if rest and not getattr(args, "runner", None):
    parser.error(f"unrecognized arguments: {' '.join(rest)}")
  try:
    return COMMANDS[args.command].run(args, rest)
  except KeyboardInterrupt:
    if args.verbose:
      raise
    print(
      "interrupted: finished shards are kept; re-run the same command to resume", file=sys.stderr
    )
    return 130
  except Exception as e:  # every error is one line; --verbose shows the traceback
    if args.verbose:
      raise
    if isinstance(e, RuntimeError) and "write() failed" in str(e):
      # array_record reports ENOSPC/EFBIG as a RuntimeError: finished shards are kept.
      print(
        f"error: cannot write a shard ({_one_line(e)}); finished shards are kept: free "
        "some space and re-run the same command to resume",
        file=sys.stderr,
      )
      return 1
    runner = getattr(args, "runner", None)
    what = " ".join(["convert", args.command, *(["--runner", runner] if runner else [])])
    if isinstance(e, ModuleNotFoundError) and extras.hint(e.name, what):
      print(f"error: {extras.hint(e.name, what)}", file=sys.stderr)
      return 2
    if isinstance(e, (ValueError, KeyError, OSError)):  # bad input or arguments
      print(f"error: {_one_line(e)}", file=sys.stderr)
      return 2
    print(
      f"error: {type(e).__name__}: {_one_line(e)} (--verbose shows the traceback)", file=sys.stderr
    )
    return 1


if __name__ == "__main__":
  code = main()
  if stalled.happened():  # reads wait on in their threads: an orderly exit would wait for them
    stalled.leave(code)
  sys.exit(code)
