"""Train and evaluate a MobileNet on the pipeline: one loop a newcomer can read in a sitting.

`train_and_evaluate` is `start` (config checked, data opened, every process agreeing),
`set_up` (state, steps), `train_loop` and `finish` (the final eval and summary). Data:
`pipeline.input` of `config.input` and `config.eval_input`: uint8 batches sharded on the
mesh's data axis, normalized on the device, their image size the dataset spec's. State: model
+ optimizer, replicated; BatchNorm statistics are over the global batch because the step is
one jitted program on the mesh. Checkpoints (`train.checkpoints`) hold the state *and* each
process's data-iterator state, so a resumed run sees exactly the batches an uninterrupted one
would. What the run says, and its input-bound verdict, is `train.report`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import time
import typing
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import optax
from etils import epath
from flax import nnx

import pipeline
from train import UsageError, agreement, checkpoints, fit, hosts, inputs, models, preemption, report
from train import config as config_lib

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
Lock = typing.TextIO | None  # `checkpoints.lock`'s file, held by process 0


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
  """The jitted, pure train and eval steps over the (model, optimizer) state. The train step
  donates its state: updated in place, and a third less of the step's host work (buffers
  to dispatch; docs/HISTORY.md)."""
  dtype = jnp.dtype(config.compute_dtype)

  @functools.partial(jax.jit, donate_argnums=0)
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
    onehot = jax.nn.one_hot(batch["label"], num_classes)  # a padded row's (-1): zeros
    loss = optax.softmax_cross_entropy(logits.astype(jnp.float32), onehot)
    return {
      "loss": jnp.sum(loss * mask),
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
  train: pipeline.Input
  eval: inputs.Evals
  notes: str  # what the pipeline chose for this host


@models.quick_tracing()
def prepare(config: ml_collections.ConfigDict) -> Setup:
  """Checks the config, opens the data and resolves the plan; refuses, with a UsageError
  naming the field, anything that would fail later (no model is built, nothing compiled)."""
  mesh = make_mesh(config)
  data_devices = mesh.shape["data"]
  config_lib.local_batch_size(config, jax.process_count(), data_devices)
  notes = io.StringIO()
  with contextlib.redirect_stderr(notes):  # the pipeline's notes: shown with the plan
    train = inputs.open_input(config, mesh, evaluation=False)
    val = inputs.open_evals(config, mesh, beside=train)
  abstract = nnx.eval_shape(lambda: create_model(config, train.num_classes))
  fit.check(abstract, train.image_size, config.compute_dtype, train.batch_size, data_devices)
  plan = config_lib.resolve(config, train.num_examples, jax.process_count(), data_devices)
  make_optimizer(config, plan)  # an unknown optimizer is refused here
  return Setup(mesh, plan, train, val, notes.getvalue() + plan.notes())


def synthetic_step_time(train_step, scratch, batch, steps: int) -> float:
  """Seconds per step with the batch already on the devices (the no-input baseline), on
  `scratch`, a copy of the state (the step donates it)."""
  scratch, _ = train_step(scratch, batch)  # compiled already
  jax.block_until_ready(scratch)
  start = time.perf_counter()
  for _ in range(steps):
    scratch, metrics = train_step(scratch, batch)
  jax.block_until_ready((scratch, metrics))
  return (time.perf_counter() - start) / steps


def start(config: ml_collections.ConfigDict, workdir: epath.Path) -> tuple[Setup, Lock]:
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
  fields = {}
  if not error:
    data = (setup.train, setup.eval)
    fields = agreement.start_fields(config, data, setup.plan, setup.mesh, workdir, token)
  differ = hosts.agree(fields, error, agreement.host_settings(config))
  return dataclasses.replace(setup, notes=setup.notes + "".join(f"{d}\n" for d in differ)), lock


@models.quick_tracing()
def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains `config` in `workdir` (resuming from its last checkpoint) and evaluates; returns
  the run's summary (also WORKDIR/summary.json)."""
  workdir = epath.Path(workdir) if "://" in os.fspath(workdir) else epath.Path(workdir).absolute()
  setup, lock = start(config, workdir)
  done = checkpoints.already_done(workdir, setup.plan.num_steps)
  if done is not None:
    if jax.process_index() == 0:
      print(
        f"already done: {done['steps']} steps, eval top-1 {done['eval_top1']:.4f} "
        f"({workdir / 'summary.json'}); raise {config_lib.length_field(config)} to train further",
        flush=True,
      )
    return done
  run = set_up(config, workdir, setup, lock)
  try:
    with run.reporter.watchdog:
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
  train_step: Callable[[nnx.State, Batch], tuple[nnx.State, Metrics]]
  eval_step: Callable[[nnx.State, Batch], Metrics]
  state: nnx.State  # the model's and the optimizer's
  step: int
  train: pipeline.Input
  eval: inputs.Evals
  ckpt: checkpoints.Checkpoints
  reporter: report.Reporter
  lock: Lock
  stop: preemption.Stop


def set_up(config: ml_collections.ConfigDict, workdir: epath.Path, setup: Setup, lock: Lock) -> Run:
  """The state (restored from the last checkpoint, if any) and the jitted steps."""
  report.begin(setup.plan, setup.notes)
  num_classes = setup.train.num_classes
  graphdef, state = init_state(config, num_classes, setup.plan, setup.mesh)
  train_step, eval_step = make_steps(graphdef, num_classes, config)
  hosts.together("set-up")  # Orbax's first collective, next, sets up Gloo
  ckpt = checkpoints.Checkpoints(workdir, config.keep_checkpoints)
  step, state = ckpt.restore(state, setup.train)
  # the steps left, in the stream's batches from where it resumed: no read past the last step
  setup.train.stop_after(max(setup.plan.num_steps - step, 0))
  setup.train.start_prefetch()
  reporter = report.Reporter(
    workdir,
    setup.plan,
    chief=jax.process_index() == 0,
    memory=setup.train.memory,
    eval_memory=setup.eval.memory,
    spec=setup.train.spec,
  )
  if step:
    reporter.say(ckpt.resumed(step))
  return Run(
    config=config,
    workdir=workdir,
    plan=setup.plan,
    train_step=train_step,
    eval_step=eval_step,
    state=state,
    step=step,
    train=setup.train,
    eval=setup.eval,
    ckpt=ckpt,
    reporter=reporter,
    lock=lock,
    stop=preemption.Stop(),
  )


def train_loop(run: Run) -> None:
  """Steps to `plan.num_steps`, logging, saving and evaluating on the plan's schedule; a stop
  signal saves and exits (`train.preemption`). The first step compiles and times the no-input
  baseline."""
  config, plan, chief = run.config, run.plan, jax.process_index() == 0
  profile = tuple(config.profile_steps)
  window, metrics, progress = report.Window(), {}, None
  while run.step < plan.num_steps:
    run.reporter.watchdog.step = run.step  # the step a stall of this process delays
    if profile and run.step == profile[0] and chief:
      jax.profiler.start_trace(os.fspath(run.workdir / "profile"))
    with jax.profiler.StepTraceAnnotation("train", step_num=run.step):
      if metrics:  # the devices wait for input only once the previous step is done
        jax.block_until_ready(metrics)
      t0, c0 = time.perf_counter(), time.thread_time()
      batch = next(run.train)
      window.receiving_cpu += time.thread_time() - c0
      if window.settling:  # right after an eval or a save: not a steady-state wait
        window.settling -= 1
      else:
        window.blocked += time.perf_counter() - t0
      if run.reporter.synthetic is None:
        run.reporter.synthetic = compile_and_time(run, batch)
        window, progress = report.Window(), report.Progress(run.step, plan.num_steps)
      run.state, metrics = run.train_step(run.state, batch)
    run.step += 1
    window.steps += 1
    if profile and run.step == profile[1] and chief:
      jax.profiler.stop_trace()

    step = run.step
    stopping = run.stop.after(step)  # read once: a signal may land at any moment
    log_now = step % config.log_every == 0 or step == plan.num_steps
    save_now = step % plan.checkpoint_every == 0 or stopping
    eval_now = step % plan.eval_every == 0 and step < plan.num_steps
    if log_now or save_now or eval_now:
      jax.block_until_ready(run.state)  # the steps' compute belongs to the window
    if log_now:
      lr = float(schedule(plan)(step))
      run.reporter.window(step, window, jax.device_get(metrics), lr, run.train.stats(), progress)
      window = report.Window()
    else:
      run.reporter.progress(progress, step, window)
    if save_now:
      with window.pause():
        run.ckpt.save(step, run.state, run.train)
    if stopping:
      run.reporter.close()
      run.reporter.say(run.stop.say(step))
      raise SystemExit(128 + run.stop.signum)
    if eval_now:
      with window.pause():
        run.reporter.eval(step, inputs.evaluate(run.eval_step, run.state, run.eval))
  if run.ckpt.latest_step() != run.step:
    run.ckpt.save(run.step, run.state, run.train)


def compile_and_time(run: Run, batch: Batch) -> float:
  """Compiles the train step on the first batch; returns the seconds per step on it."""
  run.reporter.say("compiling the train step...")
  compile_start = time.perf_counter()
  scratch, _ = run.train_step(jax.tree.map(jnp.copy, run.state), batch)
  jax.block_until_ready(scratch)
  compiled = time.perf_counter() - compile_start
  synthetic = synthetic_step_time(run.train_step, scratch, batch, run.config.synthetic_steps)
  run.reporter.say(f"compiled in {compiled:.1f} s; training")
  return synthetic


def finish(run: Run) -> dict:
  """The final evaluation and the run's summary (written by process 0); everything closed."""
  ev = inputs.evaluate(run.eval_step, run.state, run.eval)
  summary = run.reporter.summary(ev, run.step, checkpoints.checksum(run.state))
  run.ckpt.close()
  run.train.close()
  run.eval.close()
  if run.lock is not None:
    run.lock.close()
  return summary
