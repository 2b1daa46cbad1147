"""Train and evaluate a MobileNet on the pipeline: one loop a newcomer can read in a sitting.

`train_and_evaluate` is `set_up` (state, steps, data), `train_loop` and `finish` (the final
eval and summary). Data: `pipeline.make_dataset(**config.input)` -> `pipeline.device_prefetch`
(uint8 batches sharded on the mesh's data axis, normalized on device). State: model +
optimizer, replicated; BatchNorm statistics are over the global batch because the step is one
jitted program on the mesh. Checkpoints (`train.checkpoints`) hold the state *and* each
process's data-iterator state, so a resumed run sees exactly the batches an uninterrupted one
would.

Input-bound verdict, as XProf defines it: the share of step time the devices sit idle
waiting for the next batch. Before each `next()` the loop waits for the previous step to
finish, so the time then blocked in `next()` is time the devices had nothing to do (without
that wait, `next()` would also count time the devices were still busy). Compilation, the
first log window, and the step right after each eval or checkpoint save are left out; the
steps' own time (`synthetic_steps` on a batch already on the devices) is reported beside it.
With several processes each log line gathers every host's numbers (`train.podview`) and the
verdict is the worst host's, named.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import pathlib
import signal
import time
from typing import Any

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from etils import epath
from flax import nnx
from jax.experimental import multihost_utils

import pipeline
from pipeline import decode
from train import UsageError, checkpoints, fit, hosts, models, podview, report
from train import config as config_lib

MODERATE, HIGH = 0.05, 0.20  # TensorBoard profiler's input-bound thresholds
EXPLAIN_WAIT = (
  "input wait: share of step time the devices sat idle for the next batch (time blocked in "
  "next() after the previous step finished; compilation, the first window and the step after "
  "each eval or save left out); >= 5% is moderately, >= 20% highly input-bound (XProf)"
)


def verdict(wait_share: float) -> str:
  if wait_share >= HIGH:
    return "input-bound"
  if wait_share >= MODERATE:
    return "moderately input-bound"
  return "not input-bound"


def make_mesh(config) -> jax.sharding.Mesh:
  n = jax.device_count()
  if config.model_parallel < 1 or n % config.model_parallel:
    raise UsageError(f"{n} devices do not split into config.model_parallel={config.model_parallel}")
  mesh = jax.make_mesh(
    (n // config.model_parallel, config.model_parallel),
    ("data", "model"),
    axis_types=(jax.sharding.AxisType.Auto,) * 2,
  )
  if any(len({d.process_index for d in row}) > 1 for row in mesh.devices):
    raise UsageError(
      f"config.model_parallel={config.model_parallel} spans processes (each has "
      f"{jax.local_device_count()} devices): a model group must sit on one host; use at most "
      f"{jax.local_device_count()}"
    )
  return mesh


def schedule(plan: config_lib.Plan) -> optax.Schedule:
  """Linear warmup, then cosine decay to zero at num_steps."""
  return optax.warmup_cosine_decay_schedule(
    0.0, plan.learning_rate, plan.warmup_steps, max(plan.num_steps, plan.warmup_steps + 1)
  )


def make_optimizer(config, plan: config_lib.Plan) -> optax.GradientTransformation:
  lr = schedule(plan)
  if config.optimizer == "sgd":
    return optax.chain(
      optax.add_decayed_weights(config.weight_decay), optax.sgd(lr, momentum=0.9, nesterov=True)
    )
  if config.optimizer == "adamw":
    return optax.adamw(lr, weight_decay=config.weight_decay)
  raise UsageError(f"unknown config.optimizer {config.optimizer!r}: use 'sgd' or 'adamw'")


def create_model(config, num_classes: int) -> nnx.Module:
  return models.create_model(
    config.model,
    num_classes,
    alpha=config.alpha,
    depth_multiplier=config.depth_multiplier,
    dropout=config.dropout,
    bn_momentum=config.bn_momentum,
    dtype=config.compute_dtype,
    rngs=nnx.Rngs(jax.random.key(config.seed, impl="rbg")),  # rbg: 3x faster init on CPU
  )


def init_state(config, num_classes: int, plan: config_lib.Plan, mesh: jax.sharding.Mesh):
  """(graphdef, state): the model and optimizer, their state computed by one jitted program
  straight into its place on the mesh (replicated), on every process alike."""

  def make():
    model = create_model(config, num_classes)
    return model, nnx.Optimizer(model, make_optimizer(config, plan), wrt=nnx.Param)

  graphdef, _ = nnx.split(nnx.eval_shape(make))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return graphdef, jax.jit(lambda: nnx.state(make()), out_shardings=replicated)()


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


@dataclasses.dataclass
class Setup:
  """Everything decided before the model is built: checked config, data, plan."""

  mesh: jax.sharding.Mesh
  plan: config_lib.Plan
  num_classes: int
  train_ds: grain.IterDataset
  eval_ds: grain.IterDataset
  notes: str  # what the pipeline chose for this host


def prepare(config: ml_collections.ConfigDict) -> Setup:
  """Checks the config, opens the data and resolves the plan; refuses, with a UsageError
  naming the field, anything that would fail later (no model is built, nothing compiled)."""
  mesh = make_mesh(config)
  data_devices = mesh.shape["data"]
  local_batch = config_lib.local_batch_size(config, jax.process_count(), data_devices)
  inputs = config_lib.dataset_kwargs(config)
  try:
    meta = pipeline.load_manifest(inputs["data_dir"])
  except (ValueError, OSError) as e:
    raise UsageError(f"config.input: {e}") from e
  kwargs = {ev: batch_kwargs(config, ev, meta.num_classes) for ev in (False, True)}
  abstract = nnx.eval_shape(lambda: create_model(config, meta.num_classes))
  fit.check(  # before any data is opened: a batch that cannot fit is the first thing to say
    abstract, kwargs[False].get("image_size", 224), config.compute_dtype, local_batch, data_devices
  )
  datasets, notes = [], io.StringIO()
  for evaluation in (False, True):
    where = "config.eval_input" if evaluation else "config.input"
    try:
      with contextlib.redirect_stderr(notes):  # the pipeline's notes: shown with the plan
        datasets.append(
          pipeline.make_dataset(**kwargs[evaluation], batch_size=local_batch, train=not evaluation)
        )
    except (ValueError, TypeError, OSError) as e:
      raise UsageError(f"{where}: {e}") from e
    except KeyError as e:
      raise UsageError(f"{where}: {e.args[0]}") from e
  train_examples = meta.splits[inputs.get("split", "train")].num_records
  plan = config_lib.resolve(config, train_examples, jax.process_count(), data_devices)
  make_optimizer(config, plan)  # an unknown optimizer is refused here
  return Setup(mesh, plan, meta.num_classes, *datasets, notes.getvalue())


def batch_kwargs(config, evaluation: bool, num_classes: int) -> dict:
  """`make_dataset`'s keywords for the train or eval stream, their image_size the one the
  batches have: a pp string's head sets it (config's only fills `image_size` written in the
  string). Ops that make batches the steps cannot take are refused in one line naming them:
  images scaled to floats (the steps normalize uint8 pixels on the device), or no integer
  "label" (the loss and the eval need it)."""
  from pipeline import ops, pp

  kwargs = config_lib.dataset_kwargs(config, evaluation)
  where = "config.eval_input" if evaluation else "config.input"
  size = kwargs.get("image_size", 224)
  try:
    if "pp" in kwargs:
      compiled = pp.compile(kwargs["pp"], num_classes=num_classes, image_size=size)
      kwargs["image_size"], batch_ops, named = compiled.image_size, compiled.batch_ops, "pp"
    else:
      context = {"num_classes": num_classes, "image_size": size}
      batch_ops, named = pp.build(kwargs.get("batch_ops"), "batch", **context), "batch_ops"
    labels = np.arange(2, dtype=np.int32) % num_classes
    batch = {"image": np.zeros((2, 8, 8, 3), np.uint8), "label": labels}
    batch = ops.apply_batch(batch_ops, batch, ops.batch_rng(0, 0))
  except (ValueError, TypeError, KeyError) as e:
    raise UsageError(f"{where}: {e}") from e
  image, label = batch.get("image"), batch.get("label")
  if image is not None and image.dtype.kind not in "iu":
    raise UsageError(
      f"{where}.{named} makes {image.dtype} images; the train and eval steps take uint8 pixels "
      "and normalize them to [-1, 1] on the device: drop the op that scales them (value_range)"
    )
  if image is None or label is None or label.ndim != 1 or label.dtype.kind not in "iu":
    made = "no 'label'" if label is None else f"'label' of {label.dtype}{list(label.shape)}"
    made = "no 'image'" if image is None else made
    raise UsageError(
      f"{where}.{named} makes {made} (it keeps {sorted(batch)}); the steps take uint8 pixels "
      "in 'image' and the integer class in 'label': keep them (onehot(..., "
      "key_result='labels') adds its one-hot beside 'label')"
    )
  return kwargs


def evaluate(eval_step, state, eval_ds) -> dict[str, float]:
  sums = {"top1": 0.0, "top5": 0.0, "count": 0.0}
  for batch in iter(eval_ds):
    for k, v in eval_step(state, batch).items():
      sums[k] += float(v)
  n = max(sums["count"], 1.0)
  return {
    "eval_top1": sums["top1"] / n,
    "eval_top5": sums["top5"] / n,
    "eval_examples": int(sums["count"]),
  }


class Stop:
  """SIGTERM (TPU VM preemption) and SIGINT (Ctrl-C) stop the loop after a step: it saves a
  checkpoint and exits 128 + the signal (143, 130). With several processes, JAX's preemption
  service takes SIGTERM on any of them and picks the step they all save at (Ctrl-C becomes
  such a notice). A second Ctrl-C quits at once, without saving."""

  def __init__(self):
    self.signum = None
    self.multi = jax.process_count() > 1
    signals = (signal.SIGINT,) if self.multi else (signal.SIGTERM, signal.SIGINT)
    self._previous = {s: signal.signal(s, self._handle) for s in signals}

  def _handle(self, signum, frame):
    del frame
    if self.signum == signum == signal.SIGINT:
      raise KeyboardInterrupt
    self.signum = signum
    if self.multi:  # to JAX's preemption notifier, which tells the other processes
      os.kill(os.getpid(), signal.SIGTERM)

  def after(self, step: int) -> bool:
    """Whether to save and stop after `step`: the same step on every process."""
    if not self.multi:
      return self.signum is not None
    if not multihost_utils.reached_preemption_sync_point(step):
      return False
    self.signum = self.signum or signal.SIGTERM
    return True

  def say(self, step: int) -> str:
    if not self.multi:
      name = signal.Signals(self.signum).name
      return f"{name}: saved checkpoint at step {step}; re-run the command to resume"
    return (
      f"preemption notice (SIGTERM or Ctrl-C on a process): saved checkpoint at step {step} "
      f"on all {jax.process_count()} processes; re-run the same command on every host to resume"
    )

  def restore(self) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)


@dataclasses.dataclass
class Window:
  """The steps since the last log line, timed without checkpoint saves, evals and logging."""

  start: float = dataclasses.field(default_factory=time.perf_counter)
  steps: int = 0
  blocked: float = 0.0  # in next(train_it) with the devices idle (previous step finished)
  paused: float = 0.0  # saving, evaluating: not step time
  settling: int = 0  # steps still to leave out of `blocked` after a pause

  def elapsed(self) -> float:
    return time.perf_counter() - self.start - self.paused

  @contextlib.contextmanager
  def pause(self):
    t = time.perf_counter()
    try:
      yield
    finally:
      self.paused += time.perf_counter() - t
      self.settling = 1


def synthetic_step_time(train_step, state, batch, steps: int) -> float:
  """Seconds per step with the batch already on the devices (the no-input baseline)."""
  out, _ = train_step(state, batch)  # compiled already; discard results
  jax.block_until_ready(out)
  start = time.perf_counter()
  for _ in range(steps):
    out, metrics = train_step(state, batch)
  jax.block_until_ready((out, metrics))
  return (time.perf_counter() - start) / steps


def already_done(workdir: epath.Path, plan: config_lib.Plan) -> dict | None:
  """The summary of a run that finished at least `plan.num_steps` steps, if any."""
  path = workdir / "summary.json"
  if not path.exists():
    return None
  try:
    summary = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise UsageError(f"{path} is not a summary this trainer wrote ({e}): move it aside") from None
  if not isinstance(summary, dict) or not isinstance(summary.get("steps"), int):
    raise UsageError(f"{path} is not a summary this trainer wrote (no step count): move it aside")
  return summary if summary["steps"] >= plan.num_steps else None


# `pipeline.Performance`'s fields: none changes a batch, so each host may set its own.
PER_HOST = tuple(f.name for f in dataclasses.fields(pipeline.Performance))


def per_host(name: str) -> bool:
  """Whether config field `name` (`config.input.performance.num_threads`) is `PER_HOST`."""
  group, _, field = name.rpartition(".")
  return field in PER_HOST and group.endswith("input.performance")


def host_settings(config) -> dict[str, str]:
  """This host's settings that change no batch (`PER_HOST`): they may differ per process."""
  return {k: repr(v) for k, v in flatten(config.to_dict(), "config.") if per_host(k)}


def start_fields(config, setup: Setup, workdir: epath.Path, token: str) -> dict[str, str]:
  """What every process must agree on before the first step, in the order to check it."""
  fields = {"code": code_version()}
  for name, value in flatten(config.to_dict(), "config."):
    if not per_host(name):
      fields[name] = repr(value)
  for evaluation in (False, True):
    data_dir = config_lib.dataset_kwargs(config, evaluation)["data_dir"]
    meta = pipeline.load_manifest(data_dir).to_json()
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()
    fields["eval data" if evaluation else "data"] = f"{data_dir} (manifest {digest[:12]})"
  fields["plan"] = setup.plan.describe()
  fields["mesh"] = repr(dict(setup.mesh.shape))
  fields["workdir"] = token
  fields["resume from"] = str(checkpoints.saved_steps(workdir)[-1:] or "no checkpoint")
  fields["summary.json"] = str((workdir / "summary.json").exists())
  return fields


def flatten(d: dict, prefix: str = ""):
  for k, v in sorted(d.items()):
    if isinstance(v, dict):
      yield from flatten(v, f"{prefix}{k}.")
    else:
      yield f"{prefix}{k}", v


def sources_digest(*folders: pathlib.Path) -> str:
  """A digest of the Python and C sources under `folders`."""
  h = hashlib.sha256()
  for folder in folders:
    for path in sorted(p for p in folder.rglob("*") if p.suffix in (".py", ".c")):
      h.update(path.read_bytes())
  return h.hexdigest()[:12]


def code_version() -> str:
  """JAX's version, a digest of the trainer's and the pipeline's sources (the C decoder's
  included) and whether that decoder is built here (else simplejpeg decodes: other pixels)."""
  folders = [pathlib.Path(package.__file__).parent for package in (pipeline, models)]
  decoder = "C" if decode.native() is not None else "simplejpeg"
  return f"jax {jax.__version__}, sources {sources_digest(*folders)}, {decoder} JPEG decoder"


def start(config: ml_collections.ConfigDict, workdir: epath.Path):
  """(setup, lock): the config checked and the data opened on every process, and all of
  them agreeing on what they will train (`train.hosts`); a mistake anywhere is a
  `UsageError` on every process, before anything is written but the workdir itself."""
  setup, lock, token, error = None, None, "", None
  try:
    setup = prepare(config)
    workdir.mkdir(parents=True, exist_ok=True)
    lock = checkpoints.lock(workdir)
  except UsageError as e:
    if jax.process_count() == 1:
      raise
    error = str(e)
  except OSError as e:
    error = f"cannot create the workdir {workdir}: {checkpoints.one_line(e)}"
  if jax.process_count() == 1:
    if error is not None:
      raise UsageError(error)
    return setup, lock
  try:
    token = hosts.shared_workdir(workdir)
  except OSError as e:
    error = error or f"cannot write into the workdir {workdir}: {checkpoints.one_line(e)}"
  fields = {} if error else start_fields(config, setup, workdir, token)
  differ = hosts.agree(fields, error, host_settings(config))
  return dataclasses.replace(setup, notes=setup.notes + "".join(f"{d}\n" for d in differ)), lock


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains `config` in `workdir` (resuming from its last checkpoint) and evaluates; returns
  the run's summary (also WORKDIR/summary.json)."""
  workdir = epath.Path(workdir).absolute()
  setup, lock = start(config, workdir)
  done = already_done(workdir, setup.plan)
  if done is not None:
    if jax.process_index() == 0:
      print(
        f"already done: {done['steps']} steps, eval top-1 {done['eval_top1']:.4f} "
        f"({workdir / 'summary.json'}); raise config.num_epochs to train further",
        flush=True,
      )
    return done
  run = set_up(config, workdir, setup, lock)
  try:
    train_loop(run)
  finally:
    run.stop.restore()
  return finish(run)


@dataclasses.dataclass
class Run:
  """A run's live parts: made by `set_up`, advanced by `train_loop`, closed by `finish`."""

  config: ml_collections.ConfigDict
  workdir: epath.Path
  plan: config_lib.Plan
  is_chief: bool
  train_step: Any
  eval_step: Any
  state: Any
  step: int
  train_it: Any
  eval_ds: Any
  ckpt: checkpoints.Checkpoints
  log: report.Log | None
  lock: Any
  stop: Stop
  history: dict = dataclasses.field(default_factory=lambda: {"images_per_sec": [], "hosts": []})
  synthetic: float | None = None  # seconds per step on a batch already on the devices
  requests: int = 0  # storage requests of this host's pipeline at the last log line


def set_up(config, workdir: epath.Path, setup: Setup, lock) -> Run:
  """The state (restored from the last checkpoint, if any), the jitted steps and the data fed
  to the devices."""
  plan, mesh = setup.plan, setup.mesh
  is_chief = jax.process_index() == 0
  if is_chief:
    print(f"plan: {plan.describe()}\n{setup.notes}{EXPLAIN_WAIT}", flush=True)
  else:
    print(
      f"process {jax.process_index()}: follow process 0's log (every host's img/s and input "
      f"wait are in it); plan: {plan.describe()}\n{setup.notes}",
      end="",
      flush=True,
    )
  graphdef, state = init_state(config, setup.num_classes, plan, mesh)
  train_step, eval_step = make_steps(graphdef, setup.num_classes, config)
  train_it = iter(pipeline.device_prefetch(setup.train_ds, mesh, depth=config.device_depth))
  eval_ds = pipeline.device_prefetch(
    setup.eval_ds, mesh, depth=config.device_depth, batch_size=plan.local_batch_size
  )
  ckpt = checkpoints.Checkpoints(workdir, config.keep_checkpoints)
  step, state = ckpt.restore(state, train_it)
  if step and is_chief:
    print(ckpt.resumed(step), flush=True)
  log = report.Log(workdir) if is_chief else None
  return Run(
    config=config,
    workdir=workdir,
    plan=plan,
    is_chief=is_chief,
    train_step=train_step,
    eval_step=eval_step,
    state=state,
    step=step,
    train_it=train_it,
    eval_ds=eval_ds,
    ckpt=ckpt,
    log=log,
    lock=lock,
    stop=Stop(),
  )


def train_loop(run: Run) -> None:
  """Steps to `plan.num_steps`, logging, saving and evaluating on the plan's schedule; a stop
  signal saves and exits (`Stop`). The first step compiles and times the no-input baseline."""
  config, plan, is_chief = run.config, run.plan, run.is_chief
  profile = tuple(config.profile_steps)
  window, metrics, progress = Window(), {}, None
  while run.step < plan.num_steps:
    if profile and run.step == profile[0] and is_chief:
      jax.profiler.start_trace(os.fspath(run.workdir / "profile"))
    with jax.profiler.StepTraceAnnotation("train", step_num=run.step):
      if metrics:  # the devices wait for input only once the previous step is done
        jax.block_until_ready(metrics)
      t0 = time.perf_counter()
      batch = next(run.train_it)
      if window.settling:  # right after an eval or a save: not a steady-state wait
        window.settling -= 1
      else:
        window.blocked += time.perf_counter() - t0
      if run.synthetic is None:
        run.synthetic = compile_and_time(run, batch)
        window, progress = Window(), report.Progress(run.step, plan.num_steps)
      run.state, metrics = run.train_step(run.state, batch)
    run.step += 1
    window.steps += 1
    if profile and run.step == profile[1] and is_chief:
      jax.profiler.stop_trace()

    step = run.step
    stopping = run.stop.after(step)  # read once: a signal may land at any moment
    log_now = step % config.log_every == 0 or step == plan.num_steps
    save_now = step % plan.checkpoint_every == 0 or stopping
    eval_now = step % plan.eval_every == 0 and step < plan.num_steps
    if log_now or save_now or eval_now:
      jax.block_until_ready(run.state)  # the steps' compute belongs to the window
    if log_now:
      log_window(run, window, jax.device_get(metrics), progress)
      window = Window()
    elif is_chief and progress.due():
      wait = min(1.0, window.blocked / max(window.elapsed(), 1e-9))
      print(progress.line(step, plan.batch_size, wait), flush=True)
    if save_now:
      with window.pause():
        run.ckpt.save(step, run.state, run.train_it)
    if stopping:
      if is_chief:
        run.log.close()
        print(run.stop.say(step), flush=True)
      raise SystemExit(128 + run.stop.signum)
    if eval_now:
      with window.pause():
        ev = evaluate(run.eval_step, run.state, run.eval_ds)
      if is_chief:
        print(
          f"eval at step {step}: top-1 {ev['eval_top1']:.4f}  top-5 {ev['eval_top5']:.4f}",
          flush=True,
        )
        run.log.scalars(step, "eval", {"top1": ev["eval_top1"], "top5": ev["eval_top5"]})
  if run.ckpt.latest_step() != run.step:
    run.ckpt.save(run.step, run.state, run.train_it)


def compile_and_time(run: Run, batch) -> float:
  """Compiles the train step on the first batch; returns the seconds per step on it."""
  if run.is_chief:
    print("compiling the train step...", flush=True)
  compile_start = time.perf_counter()
  jax.block_until_ready(run.train_step(run.state, batch))
  compiled = time.perf_counter() - compile_start
  synthetic = synthetic_step_time(run.train_step, run.state, batch, run.config.synthetic_steps)
  if run.is_chief:
    print(f"compiled in {compiled:.1f} s; training", flush=True)
  return synthetic


def log_window(run: Run, window: Window, metrics: dict, progress: report.Progress) -> None:
  """The window's loss, speed and input wait: into the history, and printed and logged by
  process 0."""
  elapsed = window.elapsed()
  wait = min(1.0, window.blocked / elapsed)
  ips = window.steps * run.plan.batch_size / elapsed
  lr = float(schedule(run.plan)(run.step))
  stages = pipeline.stats_of(run.train_it)
  made, run.requests = run.requests, stages.storage.requests
  # The gather comes last: the next window starts on every host together.
  mine = window.steps * run.plan.local_batch_size / elapsed
  hosts = podview.gather(mine, wait, (run.requests - made) / elapsed)
  run.history["images_per_sec"].append(ips)
  run.history["hosts"].append(hosts)
  if not run.is_chief:
    return
  worst = podview.worst(hosts).input_wait_share
  print(
    f"step {run.step:6d}  loss {metrics['loss']:.4f}  acc {metrics['accuracy']:.3f}  "
    f"lr {lr:.2e}  {ips:7.0f} img/s  input wait {100 * worst:4.1f}% ({verdict(worst)}"
    f"{podview.which(hosts)}; step {1000 * elapsed / window.steps:.0f} ms, "
    f"{1000 * run.synthetic:.0f} ms on device data)  ETA {progress.eta(run.step)}",
    flush=True,
  )
  if podview.differ(hosts):
    print(podview.rows(hosts, verdict), flush=True)
  scalars = {"loss": metrics["loss"], "accuracy": metrics["accuracy"], "lr": lr}
  run.log.scalars(run.step, "train", {**scalars, "images_per_sec": ips, "input_wait_share": worst})
  run.log.scalars(run.step, "pipeline", report.stage_scalars(stages))
  if len(hosts) > 1:
    for h in hosts:
      run.log.scalars(
        run.step,
        f"process{h.process}",
        {
          "images_per_sec": h.images_per_sec,
          "input_wait_share": h.input_wait_share,
          "requests_per_sec": h.requests_per_sec,
        },
      )


def finish(run: Run) -> dict:
  """The final evaluation and the run's summary (written by process 0); everything closed."""
  ev = evaluate(run.eval_step, run.state, run.eval_ds)
  hosts = podview.mean(run.history["hosts"])
  wait = podview.worst(hosts).input_wait_share if hosts else None
  speeds = run.history["images_per_sec"]
  summary = {
    **ev,
    "steps": run.step,
    "images_per_sec": float(np.mean(speeds)) if speeds else None,
    "synthetic_step_s": run.synthetic,
    "input_wait_share": wait,  # the worst host's
    "verdict": verdict(wait) if hosts else None,
    "verdict_process": podview.worst(hosts).process if hosts else None,
    "hosts": [{**dataclasses.asdict(h), "verdict": verdict(h.input_wait_share)} for h in hosts],
    "params_sha256": checkpoints.checksum(run.state),
    "devices": jax.device_count(),
    "processes": jax.process_count(),
    "plan": dataclasses.asdict(run.plan),
  }
  if run.is_chief:
    print(
      f"eval: top-1 {ev['eval_top1']:.4f}  top-5 {ev['eval_top5']:.4f} over "
      f"{ev['eval_examples']} examples; "
      f"{summary['verdict'] + podview.which(hosts) if hosts else 'no steps timed'}",
      flush=True,
    )
    run.log.scalars(run.step, "eval", {"top1": ev["eval_top1"], "top5": ev["eval_top5"]})
    run.log.close()
    report.write_atomically(
      run.workdir / "summary.json", (json.dumps(summary, indent=2) + "\n").encode()
    )
  run.ckpt.close()
  if hasattr(run.train_it, "close"):
    run.train_it.close()
  if run.lock is not None:
    run.lock.close()
  return summary
