"""Train and evaluate a MobileNet on the pipeline: one loop a newcomer can read in a sitting.

Data: `pipeline.make_dataset` -> `pipeline.device_prefetch` (uint8 batches sharded on the
mesh's data axis, normalized on device). State: model + optimizer, replicated; BatchNorm
statistics are over the global batch because the step is one jitted program on the mesh.
Checkpoints (Orbax) hold the state *and* each process's data-iterator state, so a resumed
run sees exactly the batches an uninterrupted one would.

Input-bound verdict: `synthetic_steps` steps are timed on one batch already on the devices
(no input at all); the real step time over a log window is compared with it, and the
difference is the share of time spent waiting for input.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

import pipeline
from train import models

MODERATE, HIGH = 0.05, 0.20  # TensorBoard profiler's input-bound thresholds


def verdict(wait_share: float) -> str:
  if wait_share >= HIGH:
    return "input-bound"
  if wait_share >= MODERATE:
    return "moderately input-bound"
  return "not input-bound"


def make_mesh(config) -> jax.sharding.Mesh:
  n = jax.device_count()
  if n % config.model_parallel:
    raise ValueError(f"{n} devices do not split into model_parallel={config.model_parallel}")
  return jax.make_mesh((n // config.model_parallel, config.model_parallel), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def schedule(config) -> optax.Schedule:
  """Linear warmup, then cosine decay to zero at num_steps."""
  return optax.warmup_cosine_decay_schedule(
      0.0, config.learning_rate, config.warmup_steps,
      max(config.num_steps, config.warmup_steps + 1))


def make_optimizer(config) -> optax.GradientTransformation:
  lr = schedule(config)
  if config.optimizer == "sgd":
    return optax.chain(optax.add_decayed_weights(config.weight_decay),
                       optax.sgd(lr, momentum=0.9, nesterov=True))
  if config.optimizer == "adamw":
    return optax.adamw(lr, weight_decay=config.weight_decay)
  raise ValueError(f"unknown optimizer {config.optimizer!r}: use 'sgd' or 'adamw'")


def loss_fn(model, batch, num_classes, label_smoothing, dtype):
  images = pipeline.normalize_images(batch["image"], dtype)
  logits = model(images)
  labels = optax.smooth_labels(jax.nn.one_hot(batch["label"], num_classes), label_smoothing)
  loss = optax.softmax_cross_entropy(logits, labels).mean()
  return loss, logits


def make_steps(graphdef, num_classes, config):
  """The jitted, pure train and eval steps over the (model, optimizer) state."""
  dtype = jnp.dtype(config.compute_dtype)

  @jax.jit
  def train_step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    model.train()
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch, num_classes, config.label_smoothing, dtype)
    optimizer.update(model, grads)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
    return nnx.state((model, optimizer)), {"loss": loss, "accuracy": accuracy}

  @jax.jit
  def eval_step(state, batch):
    model, _ = nnx.merge(graphdef, state)
    model.eval()
    logits = model(pipeline.normalize_images(batch["image"], dtype))
    top5 = jax.lax.top_k(logits, min(5, num_classes))[1]
    mask = batch["mask"].astype(jnp.float32)
    return {
        "top1": jnp.sum((top5[:, 0] == batch["label"]) * mask),
        "top5": jnp.sum(jnp.any(top5 == batch["label"][:, None], -1) * mask),
        "count": jnp.sum(mask),
    }

  return train_step, eval_step


def params_checksum(state) -> str:
  """sha256 of every parameter's bytes, in a fixed order: equal runs give equal sums."""
  h = hashlib.sha256()
  leaves = jax.tree_util.tree_leaves_with_path(nnx.state(state))
  for path, leaf in sorted(leaves, key=lambda kv: jax.tree_util.keystr(kv[0])):
    h.update(jax.tree_util.keystr(path).encode())
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    h.update(np.asarray(jax.device_get(leaf)).tobytes())
  return h.hexdigest()


def datasets(config, mesh):
  """The train iterator, and a function giving a fresh pass over the eval split (the eval
  dataset is made once, so its RAM cache, if any, serves every pass)."""
  local_batch, rest = divmod(config.batch_size, jax.process_count())
  if rest:
    raise ValueError(f"batch_size {config.batch_size} must divide by the "
                     f"{jax.process_count()} processes")
  common = dict(batch_size=local_batch, image_size=config.image_size, seed=config.seed)
  performance = dict(num_threads=config.num_threads or None, prefetch=config.prefetch,
                     cache_mb=config.cache_mb)
  train_ds = pipeline.make_dataset(
      config.data_dir, config.train_split, train=True, performance=performance,
      augment=dict(area_range=tuple(config.area_range), flip=config.flip), **common)
  eval_ds = pipeline.device_prefetch(
      pipeline.make_dataset(config.data_dir, config.eval_split, train=False,
                            performance=performance, **common),
      mesh, depth=config.device_depth, batch_size=local_batch)
  train_it = iter(pipeline.device_prefetch(train_ds, mesh, depth=config.device_depth))
  return train_it, lambda: iter(eval_ds)


def evaluate(eval_step, state, eval_iter) -> dict[str, float]:
  sums = {"top1": 0.0, "top5": 0.0, "count": 0.0}
  for batch in eval_iter():
    for k, v in eval_step(state, batch).items():
      sums[k] += float(v)
  n = max(sums["count"], 1.0)
  return {"eval_top1": sums["top1"] / n, "eval_top5": sums["top5"] / n,
          "eval_examples": int(sums["count"])}


class Preemption:
  """Turns SIGTERM (TPU VM preemption) into a flag the loop checks after each step."""

  def __init__(self):
    self.requested = False
    signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, signum, frame):
    del signum, frame
    self.requested = True


def synthetic_step_time(train_step, state, batch, steps: int) -> float:
  """Seconds per step with the batch already on the devices (the no-input baseline)."""
  out, _ = train_step(state, batch)  # compiled already; discard results
  jax.block_until_ready(out)
  start = time.perf_counter()
  for _ in range(steps):
    out, metrics = train_step(state, batch)
  jax.block_until_ready((out, metrics))
  return (time.perf_counter() - start) / steps


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  workdir = epath.Path(workdir).absolute()
  workdir.mkdir(parents=True, exist_ok=True)
  is_chief = jax.process_index() == 0
  mesh = make_mesh(config)
  meta = pipeline.load_manifest(config.data_dir)
  num_classes = meta.num_classes

  model = models.create_model(
      config.model, num_classes, alpha=config.alpha, depth_multiplier=config.depth_multiplier,
      dropout=config.dropout, bn_momentum=config.bn_momentum, dtype=config.compute_dtype,
      rngs=nnx.Rngs(jax.random.key(config.seed, impl="rbg")))  # rbg: 3x faster init on CPU
  optimizer = nnx.Optimizer(model, make_optimizer(config), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  state = jax.device_put(state, replicated)
  train_step, eval_step = make_steps(graphdef, num_classes, config)
  train_it, eval_iter = datasets(config, mesh)

  manager = ocp.CheckpointManager(
      workdir / "checkpoints",
      options=ocp.CheckpointManagerOptions(max_to_keep=config.keep_checkpoints, create=True))
  step = 0
  if manager.latest_step() is not None:
    step = manager.latest_step()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract),
        data=grain.checkpoint.CheckpointRestore(train_it)))
    state = restored.state
    if is_chief:
      print(f"resumed from step {step} ({workdir / 'checkpoints'})", flush=True)

  def save(at: int) -> None:
    manager.save(at, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(train_it)),
        force=True)
    manager.wait_until_finished()

  writer = None
  if is_chief:
    from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top

    writer = SummaryWriter(os.fspath(workdir / "tensorboard"))
  preemption = Preemption()
  history = {"input_wait": [], "images_per_sec": []}
  synthetic = None
  window_start, window_steps, window_blocked = time.perf_counter(), 0, 0.0
  metrics = {}
  profile = tuple(config.profile_steps)
  lr_at = schedule(config)

  while step < config.num_steps:
    if profile and step == profile[0] and is_chief:
      jax.profiler.start_trace(os.fspath(workdir / "profile"))
    with jax.profiler.StepTraceAnnotation("train", step_num=step):
      t0 = time.perf_counter()
      batch = next(train_it)
      window_blocked += time.perf_counter() - t0
      if synthetic is None:  # first step: compile, then the no-input baseline
        jax.block_until_ready(train_step(state, batch))
        synthetic = synthetic_step_time(train_step, state, batch, config.synthetic_steps)
        window_start, window_blocked = time.perf_counter(), 0.0
      state, metrics = train_step(state, batch)
    step += 1
    window_steps += 1
    if profile and step == profile[1] and is_chief:
      jax.profiler.stop_trace()

    if step % config.log_every == 0 or step == config.num_steps:
      metrics = jax.device_get(metrics)
      elapsed = time.perf_counter() - window_start
      step_time = elapsed / window_steps
      wait = max(0.0, step_time - synthetic) / step_time
      ips = window_steps * config.batch_size / elapsed
      history["input_wait"].append(wait)
      history["images_per_sec"].append(ips)
      lr = float(lr_at(step))
      line = (f"step {step:6d}  loss {metrics['loss']:.4f}  acc {metrics['accuracy']:.3f}  "
              f"lr {lr:.2e}  {ips:7.0f} img/s  input wait {100 * wait:4.1f}% "
              f"({verdict(wait)}; blocked in next() {100 * window_blocked / elapsed:.1f}%)")
      if is_chief:
        print(line, flush=True)
        for k, v in {"loss": metrics["loss"], "accuracy": metrics["accuracy"], "lr": lr,
                     "images_per_sec": ips, "input_wait_share": wait}.items():
          writer.add_scalar(f"train/{k}", float(v), step)
      window_start, window_steps, window_blocked = time.perf_counter(), 0, 0.0

    if step % config.checkpoint_every == 0 or preemption.requested:
      save(step)
    if preemption.requested:
      if is_chief:
        print(f"SIGTERM: saved checkpoint at step {step}; re-run the command to resume",
              flush=True)
      raise SystemExit(143)
    if step % config.eval_every == 0 and step < config.num_steps:
      ev = evaluate(eval_step, state, eval_iter)
      if is_chief:
        print(f"eval at step {step}: top-1 {ev['eval_top1']:.4f}  top-5 {ev['eval_top5']:.4f}",
              flush=True)
        writer.add_scalar("eval/top1", ev["eval_top1"], step)

  if manager.latest_step() != step:
    save(step)
  ev = evaluate(eval_step, state, eval_iter)
  wait = float(np.mean(history["input_wait"][1:] or history["input_wait"] or [0.0]))
  summary = {
      **ev,
      "steps": step,
      "images_per_sec": float(np.mean(history["images_per_sec"] or [0.0])),
      "synthetic_step_s": synthetic,
      "input_wait_share": wait,
      "verdict": verdict(wait),
      "params_sha256": params_checksum(state),
      "devices": jax.device_count(),
      "processes": jax.process_count(),
  }
  if is_chief:
    print(f"eval: top-1 {ev['eval_top1']:.4f}  top-5 {ev['eval_top5']:.4f} over "
          f"{ev['eval_examples']} examples; {summary['verdict']}", flush=True)
    writer.add_scalar("eval/top1", ev["eval_top1"], step)
    writer.close()
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  manager.close()
  if hasattr(train_it, "close"):
    train_it.close()
  return summary

