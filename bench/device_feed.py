"""Benchmark: what `device_prefetch` costs on top of a host pipeline, in images/s.

Runs the same host pipeline alone and through `device_prefetch`, alternating, and reports
steady-state images/s, first-batch seconds, the ratio, and peak RSS.
`python -m bench device --help`.
"""

import json
import resource
import statistics
import sys
import time

import grain
import jax
import numpy as np
import simplejpeg
import tqdm

from bench import measure
from pipeline.device import device_prefetch

SIZE = 224


def host_pipeline(source: str, batch: int, threads: int) -> grain.IterDataset:
  """uint8 [batch, 224, 224, 3] batches: one premade batch repeated, or JPEGs decoded."""
  if source == "premade":
    pixels = np.zeros((batch, SIZE, SIZE, 3), np.uint8)
    labels = np.zeros(batch, np.int32)
    premade = grain.MapDataset.source([{"image": pixels, "label": labels}])
    return premade.repeat().to_iter_dataset()
  rng = np.random.default_rng(0)
  smooth = np.linspace(0, 255, 256 * 256 * 3).reshape(256, 256, 3)
  pixels = np.clip(smooth + rng.normal(0, 20, smooth.shape), 0, 255).astype(np.uint8)
  jpeg = simplejpeg.encode_jpeg(pixels, quality=90)

  def decode(i: int) -> dict[str, np.ndarray]:
    return {
      "image": simplejpeg.decode_jpeg(jpeg)[16 : 16 + SIZE, 16 : 16 + SIZE],
      "label": np.int32(i),
    }

  ds = grain.MapDataset.range(10**9).map(decode)
  options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=2 * batch)
  return ds.to_iter_dataset(options).batch(batch)


def time_run(ds: grain.IterDataset, batches: int, block, bar: tqdm.tqdm) -> tuple[float, float]:
  """Returns (first-batch seconds, steady-state images/s after the first batch)."""
  start = time.perf_counter()
  it = iter(ds)
  block(next(it))
  first_s = time.perf_counter() - start
  images, start = 0, time.perf_counter()
  for _ in range(batches):
    batch = next(it)
    block(batch)
    images += batch["image"].shape[0]
    bar.update()
  rate = images / (time.perf_counter() - start)
  it.close()
  return first_s, rate


def main(argv: list[str]) -> None:
  """Parses `argv` (arguments after `device`), runs the comparison, prints the figures."""
  parser = measure.parser("device", __doc__, "batches", "rounds", data_dir=None)
  parser.add_argument(
    "--source",
    choices=("premade", "jpeg"),
    default="jpeg",
    help="premade: the host does nothing, so 'device' is the transfer "
    "ceiling; jpeg: a 256x256 JPEG decode + crop per image",
  )
  parser.add_argument("--batch", type=int, default=128, help="per-process batch size")
  parser.add_argument("--threads", type=int, default=2, help="host read threads")
  parser.add_argument("--devices", type=int, default=1, help="CPU devices in the mesh")
  parser.add_argument("--depth", type=int, default=2, help="device prefetch depth")
  parser.add_argument("--normalize", action="store_true", help="normalize on device too")
  args = parser.parse_args(argv)

  jax.config.update("jax_num_cpu_devices", args.devices)  # before JAX starts a backend
  mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  host = host_pipeline(args.source, args.batch, args.threads)
  variants = {  # host_prefetch separates the gain of one more thread from the transfer cost
    "host": (host, lambda b: None),
    "host_prefetch": (
      grain.experimental.ThreadPrefetchIterDataset(host, prefetch_buffer_size=args.depth),
      lambda b: None,
    ),
    "device": (
      device_prefetch(host, mesh, depth=args.depth, normalize=args.normalize),
      jax.block_until_ready,
    ),
  }
  runs = {name: [] for name in variants}
  with tqdm.tqdm(total=args.rounds * len(variants) * args.batches, unit="batch") as bar:
    for _ in range(args.rounds):
      for name, (ds, block) in variants.items():
        bar.set_description(name)
        runs[name].append(time_run(ds, args.batches, block, bar))
  result = {
    name: {
      "images_per_s": statistics.median(r for _, r in rs),
      "first_batch_s": statistics.median(f for f, _ in rs),
    }
    for name, rs in runs.items()
  }
  rate = {name: result[name]["images_per_s"] for name in variants}
  result["ratio"] = rate["device"] / rate["host"]
  result["transfer_ratio"] = rate["device"] / rate["host_prefetch"]
  result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  result["setup"] = {**vars(args), "backend": jax.default_backend(), "devices": jax.device_count()}
  for name in variants:
    print(
      f"{name:>13}: {rate[name]:8.1f} images/s, first batch {result[name]['first_batch_s']:.2f} s"
    )
  print(
    f"device/host {result['ratio']:.3f}, device/host_prefetch "
    f"{result['transfer_ratio']:.3f} (aim: >= 0.95); peak RSS "
    f"{result['peak_rss_mib']:.0f} MiB"
  )
  print(json.dumps(result))


if __name__ == "__main__":
  measure.run_cli(main, sys.argv[1:])
