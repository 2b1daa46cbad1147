"""A contact sheet of what the pipeline feeds the model, to check an augmentation by eye.

  python -m pipeline.show DATA_DIR [--split S] [--pp PP] [--batch N] [--seed S] --out grid.png

One training batch from the real `make_dataset` (train=True, your pp string), each image
titled with its class name from the manifest (soft labels: each class with its weight).
In a notebook: `pipeline.show.grid(data_dir, pp=...)` returns the matplotlib Figure, and
`pipeline.show.examples(...)` the images and titles. matplotlib (the `bench` extra) is
imported only by `grid`, never by `import pipeline`.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import sys
import textwrap

import numpy as np

from pipeline.catalog import manifest as manifest_lib
from pipeline.dataset import make_dataset
from pipeline.host import extras

SOFT_LABEL_MIN = 0.05  # soft-label weights below this are left out of a title
MAX_IMAGES = 256  # a sheet of more takes minutes to lay out, its images too small to see
MAX_PIXEL_BYTES = 1 << 30  # the batch's uint8 pixels; each image is drawn 200 px wide


def examples(
  data_dir,
  *,
  split: str = "train",
  pp: str | None = None,
  batch_size: int = 16,
  seed: int = 0,
  image_size: int | None = None,
) -> tuple[np.ndarray, list[str]]:
  """One augmented training batch as displayable uint8 images [N, H, W, 3] and a title per
  image (its class name, or "name 0.70 + name 0.30" for mixed labels). Float images (a pp
  string's value_range) are scaled by the batch's min and max."""
  meta = manifest_lib.load(data_dir)
  if split not in meta.splits:
    raise ValueError(f"{data_dir} has no split {split!r}; it has {', '.join(sorted(meta.splits))}")
  ds = make_dataset(
    data_dir,
    split,
    batch_size=batch_size,
    train=True,
    seed=seed,
    image_size=image_size,
    pp=pp,
    shard_index=0,  # the batch one process would read (and no JAX to import)
    shard_count=1,
    performance={"num_workers": 0},  # one batch: threads start at once; same pixels
  )
  it = iter(ds)
  try:
    batch = next(it)
  finally:
    it.close()
  labels = batch.get("label", batch.get("labels"))
  titles = [_title(row, meta.classes) for row in labels] if labels is not None else []
  return _displayable(np.asarray(batch["image"])), titles or [""] * len(batch["image"])


def grid(data_dir, *, columns: int | None = None, **kwargs):
  """The contact sheet of `examples(data_dir, **kwargs)` as a matplotlib Figure (each axis
  titled with the image's class; no pyplot state, so it also renders in a notebook)."""
  from matplotlib.figure import Figure

  _check_size(kwargs.get("batch_size", 16), kwargs.get("image_size"))
  images, titles = examples(data_dir, **kwargs)
  columns = columns or math.ceil(math.sqrt(len(images)))
  rows = math.ceil(len(images) / columns)
  fig = Figure(figsize=(2 * columns, 2.2 * rows + 0.4), layout="constrained")
  axes = fig.subplots(rows, columns, squeeze=False).ravel()
  for ax in axes:
    ax.set_axis_off()
  for ax, image, title in zip(axes, images, titles, strict=False):
    ax.imshow(image)
    ax.set_title(title, fontsize=8)
  split, pp = kwargs.get("split", "train"), kwargs.get("pp")
  heading = f"{os.fspath(data_dir)} [{split}], {pp or 'default augmentation'}"
  fig.suptitle(textwrap.fill(heading, width=18 * columns), fontsize=9)
  return fig


def _check_size(batch_size: int, image_size: int | None) -> None:
  """Refuses, before any image is read, a sheet too large to draw or to hold in memory."""
  if batch_size > MAX_IMAGES:
    raise ValueError(f"a sheet shows at most {MAX_IMAGES} images, not {batch_size}")
  need = batch_size * (image_size or 0) ** 2 * 3
  if need > MAX_PIXEL_BYTES:
    raise ValueError(
      f"{batch_size} images of {image_size} px take {need / 2**30:.1f} GiB; a sheet draws "
      f"each at 200 px and holds at most {MAX_PIXEL_BYTES >> 30} GiB: use a smaller image size"
    )


def _title(label: np.ndarray, classes: list[str]) -> str:
  label = np.asarray(label)
  if label.ndim == 0:
    return classes[int(label)]
  order = [int(i) for i in np.argsort(-label) if label[i] >= SOFT_LABEL_MIN]
  if len(order) == 1 and label[order[0]] > 1 - SOFT_LABEL_MIN:
    return classes[order[0]]
  return " + ".join(f"{classes[i]} {label[i]:.2f}" for i in order)


def _displayable(images: np.ndarray) -> np.ndarray:
  if images.dtype == np.uint8:
    return images
  low, high = float(images.min()), float(images.max())
  scaled = (images.astype(np.float32) - low) / max(high - low, 1e-6)
  return (scaled * 255).round().astype(np.uint8)


class _Parser(argparse.ArgumentParser):
  def error(self, message: str):  # one line, not the whole usage first
    self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _parser() -> argparse.ArgumentParser:
  p = _Parser(
    prog="python -m pipeline.show",
    description="Write a contact sheet of one augmented training batch, each image titled "
    "with its class name, to check what the pipeline feeds the model.",
  )
  p.add_argument("data_dir", metavar="DATA_DIR", help="a converted dataset (holds manifest.json)")
  p.add_argument("--split", default="train", help="the manifest split to read (default: train)")
  p.add_argument("--pp", help="a big_vision pp string, as make_dataset(pp=...) takes it")
  p.add_argument(
    "--batch", type=int, default=16, help=f"images on the sheet (default: 16, at most {MAX_IMAGES})"
  )
  p.add_argument("--seed", type=int, default=0, help="shuffle and augmentation seed")
  p.add_argument("--image-size", type=int, help="output side in pixels (default: 224 or pp's)")
  p.add_argument(
    "--out",
    required=True,
    help="the image file to write; its extension names the type (grid.png, grid.pdf)",
  )
  p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
  p.add_argument("--verbose", action="store_true", help="tracebacks instead of one-line errors")
  return p


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  try:
    from matplotlib.figure import Figure  # said here, before any image is decoded
  except ModuleNotFoundError as e:
    print(f"error: {extras.hint(e.name, 'python -m pipeline.show')}", file=sys.stderr)
    return 1
  try:
    image_type = _image_type(args.out, args.overwrite, Figure().canvas.get_supported_filetypes())
    fig = grid(
      args.data_dir,
      split=args.split,
      pp=args.pp,
      batch_size=args.batch,
      seed=args.seed,
      image_size=args.image_size,
    )
    sheet = io.BytesIO()
    fig.savefig(sheet, format=image_type, dpi=100)
    _write(args.out, sheet.getvalue(), args.overwrite)
  except MemoryError as e:
    if args.verbose:
      raise
    print(
      f"error: out of memory for the sheet ({e}): lower --batch or the image size", file=sys.stderr
    )
    return 2
  except (ValueError, OSError, KeyError) as e:
    if args.verbose:
      raise
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  print(f"wrote {args.out}: {args.batch} images of {args.data_dir} [{args.split}]")
  return 0


def _image_type(out: str, overwrite: bool, types: dict[str, str]) -> str:
  """The image type `out` names by its extension; a folder, a name without a type matplotlib
  writes, or a file that exists (without `overwrite`) is refused."""
  if os.path.isdir(out):
    raise ValueError(
      f"--out {out} is a folder: name the image file, e.g. {os.path.join(out, 'grid.png')}"
    )
  image_type = os.path.splitext(out)[1][1:].lower()
  if image_type not in types:
    raise ValueError(
      f"--out {out} does not end in an image type ({', '.join(sorted(types))}): "
      f"name it, e.g. {out}.png"
    )
  if os.path.exists(out) and not overwrite:
    raise FileExistsError(f"{out} exists: pass --overwrite to replace it")
  return image_type


def _write(out: str, data: bytes, overwrite: bool) -> None:
  """`data` to exactly `out`: a new file, or with `overwrite` one renamed over the old."""
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  if not overwrite:
    try:
      with open(out, "xb") as f:  # a file made meanwhile is not replaced either
        f.write(data)
    except FileExistsError:
      raise FileExistsError(f"{out} exists: pass --overwrite to replace it") from None
    return
  tmp = f"{out}.tmp-{os.getpid()}"
  try:
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


if __name__ == "__main__":
  sys.exit(main())
