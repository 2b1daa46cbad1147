"""`python -m bench.device_check`: what one accelerator host feeds, in one JSON (device_check.sh).

On full-size photos (the built-in generator's, ~470x390, ImageNet-sized JPEGs), for `--seconds`
each: the CPU path alone at the planned workers x threads beside the model's projection
for this host's cores (`pipeline.host.parallelism`), with each thread's CPU read from /proc (where
the cores go); GPU decode alone (`decoding.on="device"`); MobileNet V1 224 px bf16 training
(`python -m train`, configs/imagenet_mobilenet_v1.py) with each for `--train-seconds`, its log's
img/s and input wait.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
LOG_LINE = re.compile(r"\bloss .*?(\d+) img/s\s+input wait\s+([\d.]+)%")  # a window's line


def make_data(out: pathlib.Path, images: int, workers: int) -> pathlib.Path:
  """`images` built-in photos at full size, converted (10% validation); kept across runs."""
  from pipeline.convert import builtin
  from pipeline.convert import images as convert

  data = out / f"photos{images}"
  if not (data / "manifest.json").exists():
    raw = out / f"raw{images}"
    builtin.make_photos(raw, num_images=images, seed=0, num_classes=10, workers=workers)
    convert.convert(raw, data, val_fraction=0.1, seed=0, workers=workers, progress=False)
  return data


def thread_cpu() -> dict[str, float]:
  """CPU seconds of every thread of this process (by its Python thread name, decode threads
  summed) and of its worker processes (each one's threads summed), from /proc."""
  import threading

  import psutil

  tick = os.sysconf("SC_CLK_TCK")
  names = {t.native_id: re.sub(r"_\d+$", "", t.name) for t in threading.enumerate()}
  out = collections.Counter()
  me = psutil.Process()
  for proc in [me, *me.children(recursive=True)]:
    for task in pathlib.Path(f"/proc/{proc.pid}/task").glob("*"):
      try:
        stat = (task / "stat").read_text()
      except OSError:
        continue
      fields = stat[stat.rindex(")") + 2 :].split()
      name = names.get(int(task.name), "other") if proc.pid == me.pid else f"worker {proc.pid}"
      out[name] += (int(fields[11]) + int(fields[12])) / tick
  return dict(out)


def loader_rate(data: pathlib.Path, seconds: float, batch: int, size: int, **keywords) -> dict:
  """Images/s of make_dataset's train stream over `seconds` after its first batch, with the
  threads' CPU over that time."""
  import pipeline
  from pipeline import dataset
  from pipeline.host import parallelism

  spec = pipeline.Spec.of(data, "train", batch_size=batch, image_size=size, **keywords)
  stages = dataset.build(spec)
  it = iter(dataset.chain(stages))
  next(it)
  before, start, n = thread_cpu(), time.perf_counter(), 0
  while time.perf_counter() - start < seconds:
    n += len(next(it)["label"])
  elapsed = time.perf_counter() - start
  after = thread_cpu()
  cpu = {k: round(after[k] - before.get(k, 0.0), 2) for k in after}
  it.close()
  cores = parallelism.available_cores()
  chosen = parallelism.Plan(stages.workers, stages.decode.num_threads)
  costs = parallelism.at_batch(parallelism.COSTS, batch)
  result = {
    "images_per_s": round(n / elapsed, 1),
    "plan": chosen.describe(),
    "cores": cores,
    "cpu_s_by_thread": dict(sorted(cpu.items(), key=lambda kv: -kv[1])),
    "cpu_cores_busy": round(sum(cpu.values()) / elapsed, 2),
    "seconds": round(elapsed, 1),
  }
  if spec.decoding.on == "host":  # the model's figure for this plan on this host's cores
    result["projection_images_per_s"] = round(parallelism.project(cores, costs, chosen, batch), 1)
    result["projection_bound"] = parallelism.bound(cores, costs, chosen, batch)
  return result


def train_rate(
  data: pathlib.Path, out: pathlib.Path, seconds: float, batch: int, on: str, compile_s: float = 150
) -> dict:
  """`python -m train` (MobileNet V1, 224 px, bf16) for `seconds` of logged windows after the
  first (stopped after `seconds + compile_s` in all): mean img/s and input wait of its log."""
  workdir = out / f"train_{on}"
  subprocess.run(["rm", "-rf", str(workdir)], check=False)
  command = [
    sys.executable,
    "-m",
    "train",
    "--config",
    str(REPO / "configs" / "imagenet_mobilenet_v1.py"),
    "--workdir",
    str(workdir),
    f"--config.input.data_dir={data}",
    f"--config.input.decoding.on={on}",
    f"--config.batch_size={batch}",
    "--config.num_steps=1000000",
    "--config.log_every=10",
    "--config.eval_every_epochs=1000000.0",
    "--config.checkpoint_every_epochs=1000000.0",
  ]
  lines = []
  with subprocess.Popen(
    command,
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    start_new_session=True,  # its worker processes are stopped with it
  ) as proc:
    stop = lambda: os.killpg(proc.pid, signal.SIGKILL)  # no checkpoint on the way out: scratch
    deadline = threading.Timer(seconds + compile_s, stop)  # a compile that never ends
    deadline.start()
    first = None
    for line in proc.stdout:
      lines.append(line.rstrip())
      if LOG_LINE.search(line) and first is None:
        first = time.perf_counter()
      if first is not None and time.perf_counter() - first > seconds:
        break
    deadline.cancel()
    with contextlib.suppress(ProcessLookupError):
      stop()
    proc.wait()
  windows = [tuple(map(float, m.groups())) for m in map(LOG_LINE.search, lines) if m][1:]
  result = {"decoding": on, "windows": len(windows), "log_tail": lines[-8:]}
  if windows:
    result["images_per_s"] = round(sum(w[0] for w in windows) / len(windows), 1)
    result["input_wait_percent"] = round(sum(w[1] for w in windows) / len(windows), 1)
  return result


def main(argv: list[str] | None = None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default="runs/device_check")
  p.add_argument("--images", type=int, default=4000, help="photos to make (full size)")
  p.add_argument("--seconds", type=float, default=30.0, help="per loader phase")
  p.add_argument("--train-seconds", type=float, default=60.0, help="per training phase")
  p.add_argument("--batch", type=int, default=256, help="per loader batch; training: x4")
  p.add_argument("--size", type=int, default=224)
  p.add_argument("--no-train", action="store_true", help="loaders only (no accelerator)")
  args = p.parse_args(argv)
  out = pathlib.Path(args.out).resolve()
  out.mkdir(parents=True, exist_ok=True)
  import jax

  from pipeline.host import parallelism
  from pipeline.image import nvdecode

  result = {
    "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    "jax": jax.__version__,
    "devices": [str(d) for d in jax.devices()],
  }
  t = time.perf_counter()
  data = make_data(out, args.images, parallelism.available_cores())
  result["data"] = {
    "dir": str(data),
    "images": args.images,
    "seconds": round(time.perf_counter() - t),
  }
  phases = {
    "cpu_alone": dict(performance={}),
    "gpu_decode_alone": dict(decoding=dict(on="device"), performance={}),
  }
  for name, keywords in phases.items():
    try:
      result[name] = loader_rate(data, args.seconds, args.batch, args.size, **keywords)
    except Exception as e:  # noqa: BLE001 - one phase failing still writes the others
      result[name] = {"error": f"{type(e).__name__}: {e}"}
    print(name, json.dumps(result[name]), flush=True)
  result["gpus"] = nvdecode.local_gpus() if nvdecode.available() else "nvImageCodec not installed"
  if not args.no_train:
    for on in ("host", "device"):
      result[f"train_{on}_decode"] = train_rate(data, out, args.train_seconds, 4 * args.batch, on)
      print(on, json.dumps(result[f"train_{on}_decode"]), flush=True)
  (out / "device_check.json").write_text(json.dumps(result, indent=1))
  print(f"wrote {out / 'device_check.json'}", flush=True)
  return result


if __name__ == "__main__":
  main()
