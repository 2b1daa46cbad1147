"""Train configs: one input block passed whole to make_dataset, fields derived after the
command line's overrides, recipes found by name from any folder, mistakes refused in one
line before anything is built or compiled."""

import dataclasses
import inspect
import os
import re
import subprocess
import sys

import pytest
from flax import nnx

import pipeline
from configs import default, imagenet_mobilenet_v1, imagenet_mobilenet_v2
from tests.train.test_train import ROOT
from train import UsageError, fit, models, train
from train import config as config_lib


def run_train(*args, cwd, devices=1):
  """`python -m train ARGS` from `cwd` with the repo on PYTHONPATH (not installed)."""
  env = dict(
    os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}"
  )
  return subprocess.run(
    [sys.executable, "-m", "train", *args],
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )


def plan_line(out) -> dict[str, float]:
  assert out.returncode == 0, out.stderr[-3000:]
  line = next(x for x in out.stdout.splitlines() if x.startswith("plan: "))
  numbers = re.match(
    r"plan: (\d+) steps of (\d+) .* lr ([\d.e-]+), warmup (\d+) steps, "
    r"eval every (\d+), checkpoint every (\d+)",
    line,
  )
  keys = ("steps", "batch", "lr", "warmup", "eval_every", "checkpoint_every")
  return dict(zip(keys, map(float, numbers.groups())))


@pytest.mark.slow
def test_the_learning_rate_and_schedule_follow_the_batch_size_given_on_the_command_line(
  digits_dir, tmp_path
):
  plans = {
    batch: plan_line(
      run_train(
        "--config",
        "imagenet_mobilenet_v1",
        "--dry_run",
        f"--config.input.data_dir={digits_dir}",
        f"--config.batch_size={batch}",
        cwd=tmp_path,
      )
    )
    for batch in (16, 32)
  }
  for batch, plan in plans.items():  # 0.1 per 256 examples; 300 and 5 epochs of 240 examples
    assert plan["lr"] == pytest.approx(0.1 * batch / 256)
    assert plan["steps"] == round(300 * 240 / batch)
    assert plan["warmup"] == round(5 * 240 / batch)
    assert plan["eval_every"] == round(5 * 240 / batch)
  steps = plan_line(
    run_train(
      "--config",
      "imagenet_mobilenet_v1",
      "--dry_run",
      f"--config.input.data_dir={digits_dir}",
      "--config.batch_size=16",
      "--config.num_steps=7",
      cwd=tmp_path,
    )
  )
  assert steps["steps"] == 7  # a count in steps, when given, wins over the epochs


@pytest.mark.slow
def test_recipes_are_found_by_name_or_path_from_any_folder(digits_dir, tmp_path):
  data = f"--config.input.data_dir={digits_dir}"
  for recipe in (
    "default",
    "imagenet_mobilenet_v2",
    "imagenet_mobilenet_v1.py",
    str(ROOT / "configs" / "default.py"),
  ):
    plan_line(
      run_train("--config", recipe, "--dry_run", data, "--config.batch_size=16", cwd=tmp_path)
    )
  missing = run_train("--config", "mobilenet_v3", "--dry_run", cwd=tmp_path)
  assert missing.returncode == 2
  assert missing.stderr.strip().splitlines() == [missing.stderr.strip()]
  assert "mobilenet_v3" in missing.stderr and "imagenet_mobilenet_v1" in missing.stderr


def test_the_default_recipe_reads_the_repos_data_from_any_folder():
  assert config_lib.dataset_kwargs(default.get_config())["data_dir"] == str(
    ROOT / "data" / "digits"
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  "override, says",
  [
    ("--config.input.data_dir={tmp}/nowhere", "nowhere/manifest.json not found"),
    ("--config.input.split=test", "split 'test' not in"),
    ("--config.eval_input.split=test", "config.eval_input: split 'test' not in"),
    (
      "--config.batch_sise=4",
      "unknown config field --config.batch_sise (did you mean batch_size?)",
    ),
    ("--config.input.image_size=0", "image_size must be positive, got 0"),
    ("--config.batch_size=12", "config.batch_size=12 does not divide over the 8 devices"),
    ("--config.batch_size=256", "config.input: batch_size=256 is larger than the 240 records"),
    ("--config.input.augment.crop_fraction=2.0", "crop_fraction must be in (0, 1]"),
    ("--config.optimizer=adam", "unknown config.optimizer 'adam'"),
  ],
)
def test_a_user_error_is_one_line_exit_2_and_nothing_is_written(
  digits_dir, tmp_path, override, says
):
  workdir = tmp_path / "run"
  out = run_train(
    "--config",
    "default",
    "--workdir",
    str(workdir),
    f"--config.input.data_dir={digits_dir}",
    override.format(tmp=tmp_path),
    cwd=tmp_path,
    devices=8,
  )
  assert out.returncode == 2, out.stderr[-3000:]
  assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
  assert says in out.stderr
  assert not workdir.exists()


def test_a_misspelt_field_of_the_default_recipe_is_one_line_too(tmp_path):
  out = run_train("--workdir", str(tmp_path / "run"), "--config.batch_sise=4", cwd=tmp_path)
  assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
  assert out.stderr.strip() == (
    "python -m train: unknown config field --config.batch_sise (did you mean batch_size?)"
  )
  assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_verbose_shows_the_traceback(digits_dir, tmp_path):
  out = run_train(
    "--config",
    "default",
    "--workdir",
    str(tmp_path / "run"),
    "--verbose",
    "--config.input.split=test",
    f"--config.input.data_dir={digits_dir}",
    cwd=tmp_path,
  )
  assert out.returncode != 0 and "Traceback" in out.stderr


def test_the_input_block_is_exactly_make_datasets_keywords_with_every_option_settable():
  keywords = set(inspect.signature(pipeline.make_dataset).parameters)
  for recipe in (default, imagenet_mobilenet_v1, imagenet_mobilenet_v2):
    config = recipe.get_config()
    for evaluation in (False, True):
      kwargs = config_lib.dataset_kwargs(config, evaluation)
      assert set(kwargs) <= keywords - {"batch_size", "train"}
      for group, cls in config_lib.OPTIONS.items():
        assert set(kwargs[group]) == {f.name for f in dataclasses.fields(cls)}
        cls(**kwargs[group])  # valid as given
    assert config_lib.dataset_kwargs(config, evaluation=True)["split"] == "validation"


@pytest.mark.slow
def test_options_left_to_the_host_are_typed_placeholders_that_overrides_can_set(
  digits_dir, tmp_path
):
  performance = default.get_config().input.performance
  assert performance.num_threads is None and performance.num_workers is None
  performance.num_threads = 4
  with pytest.raises(TypeError):
    performance.num_workers = "two"
  out = run_train(
    "--config",
    "default",
    "--dry_run",
    f"--config.input.data_dir={digits_dir}",
    "--config.input.performance.num_threads=4",
    "--config.input.performance.num_workers=0",
    "--config.input.augment.aspect_range=(0.5,2.0)",
    "--config.input.on_error=skip",
    "--config.eval_input.split=train",
    cwd=tmp_path,
  )
  plan_line(out)


def test_every_make_dataset_keyword_is_a_config_input_field():
  keywords = set(inspect.signature(pipeline.make_dataset).parameters) - {"batch_size", "train"}
  for recipe in (default, imagenet_mobilenet_v1, imagenet_mobilenet_v2):
    config = recipe.get_config()
    assert set(config.input) == keywords
    assert set(config.eval_input) == keywords


@pytest.mark.slow
def test_config_input_takes_sharding_and_pp_on_the_command_line(digits_dir, tmp_path):
  out = run_train(
    "--config",
    "default",
    "--dry_run",
    f"--config.input.data_dir={digits_dir}",
    "--config.input.sharding=shards",
    "--config.input.pp=decode_jpeg_and_inception_crop(32, area_min=50)",
    "--config.eval_input.pp=decode|resize_small(36)|central_crop(32)",
    "--config.input.seed=3",
    cwd=tmp_path,
  )
  plan_line(out)
  config = default.get_config()
  config.input.pp, config.input.sharding = "decode_jpeg_and_inception_crop(32)", "shards"
  assert config_lib.dataset_kwargs(config)["pp"] == "decode_jpeg_and_inception_crop(32)"
  assert config_lib.dataset_kwargs(config)["sharding"] == "shards"
  assert config_lib.dataset_kwargs(config)["seed"] == config.seed  # unset: the run's seed
  with pytest.raises(UsageError, match="config.eval_input.pp is not"):  # a train head in eval
    config_lib.dataset_kwargs(config, evaluation=True)


EVAL_PP = "decode|resize_small(36)|central_crop(32)"  # the recipe's image_size


@pytest.mark.parametrize(
  "train_pp, eval_pp, says",
  [
    (
      "decode_jpeg_and_inception_crop(32, area_min=50)|value_range(-1, 1)",
      EVAL_PP,
      "config.input.pp makes float32 images; the train and eval steps take uint8 pixels",
    ),
    (
      "decode_jpeg_and_inception_crop(32, area_min=50)|onehot(num_classes, key_result='labels')"
      "|keep('image', 'labels')",
      EVAL_PP,
      "config.input.pp makes no 'label' (it keeps ['image', 'labels']); the steps take uint8 "
      "pixels in 'image' and the integer class in 'label'",
    ),
    (
      "decode_jpeg_and_inception_crop(32, area_min=50)",
      EVAL_PP + "|onehot(num_classes)",
      "config.eval_input.pp makes 'label' of float32[2, 10]",
    ),
  ],
)
def test_a_pp_string_whose_batches_the_steps_cannot_take_is_refused_before_the_run(
  digits_dir, train_pp, eval_pp, says
):
  config = default.get_config()
  config.input.data_dir, config.input.pp, config.eval_input.pp = str(digits_dir), train_pp, eval_pp
  with pytest.raises(UsageError) as refused:
    train.prepare(config)
  assert says in str(refused.value)


def test_the_dry_run_says_in_one_line_what_a_big_vision_pp_string_would_fail_on(
  digits_dir, tmp_path
):
  bit_i1k = (  # big_vision's bit_i1k, at the recipe's size
    "decode_jpeg_and_inception_crop(32, area_min=50)|flip_lr|value_range(-1, 1)"
    "|onehot(num_classes, key='label', key_result='labels')|keep('image', 'labels')"
  )
  out = run_train(
    "--config",
    "default",
    "--dry_run",
    f"--config.input.data_dir={digits_dir}",
    f"--config.input.pp={bit_i1k}",
    "--config.input.augment.flip=True",  # the recipe's digits are not flipped
    f"--config.eval_input.pp={EVAL_PP}",
    cwd=tmp_path,
  )
  assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-3000:]
  assert out.stderr.startswith("python -m train: config.input.pp makes float32 images")


@pytest.mark.slow
def test_the_image_size_is_the_pp_strings_where_it_sets_one(digits_dir, tmp_path):
  config = default.get_config()  # image_size=32
  config.input.data_dir = str(digits_dir)
  config.input.pp = "decode_jpeg_and_inception_crop(24, area_min=50)"
  config.eval_input.pp = "decode|resize_small(image_size)|central_crop(image_size)"
  setup = train.prepare(config)
  assert setup.train.image_size == 24
  assert setup.eval.image_size == 32  # written as image_size
  setup.train.close()
  setup.eval.close()
  out = run_train(
    "--config",
    "default",
    "--dry_run",
    f"--config.input.data_dir={digits_dir}",
    "--config.input.pp=decode_jpeg_and_inception_crop(24, area_min=50)",  # the recipe's crops
    "--config.eval_input.pp=decode|resize_small(28)|central_crop(24)",
    cwd=tmp_path,
  )
  plan_line(out)


def test_the_train_and_eval_streams_plan_within_one_default_budget(digits_dir):
  config = default.get_config()
  config.input.data_dir = str(digits_dir)
  setup = train.prepare(config)
  first, then = setup.train.memory, setup.eval.memory
  setup.train.close()
  setup.eval.close()
  assert then.budget == first.budget - first.total  # eval plans within what train left
  assert first.total + then.total <= first.budget


def test_eval_whose_least_exceeds_what_train_left_plans_within_its_own_budget(digits_dir):
  config = default.get_config()
  config.input.data_dir = str(digits_dir)
  config.input.performance.record_cache_mb = 10**7  # train's cache takes what the budget has
  setup = train.prepare(config)
  first, then = setup.train.memory, setup.eval.memory
  setup.train.close()
  setup.eval.close()
  assert first.total == first.budget  # nothing left: eval was refused there, then planned alone
  assert then.budget == pytest.approx(first.budget, rel=0.1)  # half the memory available then
  assert 0 < then.total <= then.budget


def test_a_budget_the_user_sets_holds_both_streams_or_is_refused_in_one_line(digits_dir):
  config = default.get_config()
  config.input.data_dir = str(digits_dir)
  config.input.performance.memory_mb = 500
  setup = train.prepare(config)
  first, then = setup.train.memory, setup.eval.memory
  setup.train.close()
  setup.eval.close()
  assert first.budget == 500 * 2**20 and then.budget == first.budget - first.total
  assert first.total + then.total <= 500 * 2**20
  config.input.performance.record_cache_mb = 10**7  # train takes the whole budget: none left
  with pytest.raises(UsageError) as e:
    train.prepare(config)
  assert str(e.value).startswith("config.eval_input: ") and "\n" not in str(e.value)


def test_a_run_shorter_than_the_recipes_intervals_and_warmup_says_so_with_the_plan(digits_dir):
  config = default.get_config()  # digits: 240 examples; eval every 20, save every 10 epochs
  config.input.data_dir = str(digits_dir)
  config.batch_size = 32
  config.num_steps = 60  # 8 epochs: warmup 4.5 epochs is 34 steps, 57% of the run
  setup = train.prepare(config)
  setup.train.close()
  setup.eval.close()
  assert (setup.plan.eval_every, setup.plan.checkpoint_every) == (150, 75)
  notes = setup.notes.splitlines()  # shown under the plan line, and by --dry_run
  assert notes[-2] == (
    "note: the run's 60 steps end before its first eval (every 150) and checkpoint (every "
    "75): it evaluates and saves at its end only"
  )
  assert notes[-1] == (
    "warning: warmup takes 34 of the run's 60 steps (57%), so the learning rate peaks late: "
    "set config.warmup_steps (or warmup_epochs) to at most 15"
  )
  config.num_steps, config.warmup_steps = 150, 30  # an eval at its end only; 20% warmup
  notes = config_lib.resolve(config, 240, processes=1, data_devices=1).notes()
  assert notes == (
    "note: the run's 150 steps end before its first eval (every 150): it does so at its end only\n"
  )
  config.num_steps = None  # the recipe's 40 epochs: nothing to say
  assert config_lib.resolve(config, 240, processes=1, data_devices=1).notes() == ""


@pytest.mark.parametrize("num_steps, field", [(6, "config.num_steps"), (None, "config.num_epochs")])
def test_already_done_names_the_field_that_sets_the_runs_length(
  digits_dir, tmp_path, capsys, num_steps, field
):
  config = default.get_config()
  config.input.data_dir = str(digits_dir)
  config.batch_size = 32
  config.num_steps = num_steps
  steps = num_steps or round(config.num_epochs * 240 / 32)
  (tmp_path / "summary.json").write_text(f'{{"steps": {steps}, "eval_top1": 0.5}}')
  assert train.train_and_evaluate(config, tmp_path)["steps"] == steps
  out = capsys.readouterr().out
  assert out.startswith(f"already done: {steps} steps, eval top-1 0.5000 (")
  assert out.endswith(f"); raise {field} to train further\n")  # not num_epochs when steps set


def test_eval_input_overrides_only_what_it_names():
  config = default.get_config()
  config.eval_input.decoding = {"cache_mb": 0.0}
  train_kwargs = config_lib.dataset_kwargs(config)
  eval_kwargs = config_lib.dataset_kwargs(config, evaluation=True)
  assert eval_kwargs["split"] == "validation" and train_kwargs["split"] == "train"
  assert eval_kwargs["decoding"] == {**train_kwargs["decoding"], "cache_mb": 0.0}
  assert eval_kwargs["augment"] == train_kwargs["augment"]
  assert eval_kwargs["performance"] == train_kwargs["performance"]


def test_keywords_the_trainer_sets_or_make_dataset_lacks_are_refused():
  config = default.get_config()
  config.input.batch_size = 8
  with pytest.raises(UsageError, match="config.input.batch_size is set by the trainer"):
    config_lib.dataset_kwargs(config)
  config = default.get_config()
  config.eval_input.num_thread = 2
  with pytest.raises(UsageError, match="num_thread is not a pipeline.make_dataset keyword"):
    config_lib.dataset_kwargs(config, evaluation=True)


@pytest.mark.slow
def test_a_batch_too_large_for_the_host_is_refused_before_compiling(digits_dir, tmp_path):
  free, _ = fit.available_bytes()
  if free > 300 * 2**30:
    pytest.skip("this host has room for the ImageNet recipe's batch of 4096")
  out = run_train(
    "--config",
    "imagenet_mobilenet_v1",
    "--workdir",
    str(tmp_path / "run"),
    f"--config.input.data_dir={digits_dir}",
    "--config.input.drop_remainder=False",  # else 4096 > the 240 digits is said first
    cwd=tmp_path,
  )
  assert out.returncode == 2, out.stderr[-3000:]
  assert out.stderr.count("\n") == 1
  assert "config does not fit: 4096 examples of 224x224" in out.stderr
  assert "lower config.batch_size" in out.stderr


def test_the_activation_estimate_is_near_what_xla_allocates():
  # XLA's temporary buffers for this model's train step (CPU, float32): 66 MiB per example.
  model = nnx.eval_shape(lambda: models.create_model("mobilenet_v1", 1000, rngs=nnx.Rngs(0)))
  per_example = fit.activation_bytes_per_example(model, 224, "float32")
  assert 50 * 2**20 < per_example < 100 * 2**20


def test_the_input_order_each_host_chose_from_its_storage_is_agreed_before_step_one(digits_dir):
  """The same command picks the block order where the data is a mount or a bucket and the
  global order on local disk: hosts that chose differently would train on mismatched global
  batches, so the order is one of the fields every process must agree on."""
  from train import agreement

  def order(**keywords):
    stream = pipeline.input(
      digits_dir, "train", global_batch_size=8, seed=0, performance={"num_workers": 0}, **keywords
    )
    try:
      return agreement.input_order(stream)
    finally:
      stream.close()

  local, mount = order(order="global"), order(order="blocks", block_records=16)
  assert local.startswith("global; ") and mount.startswith("blocks of 16, ")
  assert local.partition("; ")[2] == mount.partition("; ")[2]  # the rest alike
  assert order(order="global") == local  # the same choice, the same field


def test_a_synthetic_baseline_of_no_steps_is_refused_in_one_line():
  config = default.get_config()
  config.synthetic_steps = 0
  with pytest.raises(UsageError, match=r"^config.synthetic_steps must be >= 1, got 0$"):
    config_lib.resolve(config, 240, processes=1, data_devices=1)
