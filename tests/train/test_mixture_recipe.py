"""The mixture recipe (configs/mixture.py): digits and photos in one stream, each evaluated."""

import json
import re

import jax.numpy as jnp
import pytest

import pipeline
from configs import mixture
from tests.train.test_train_config import plan_line, run_train
from train import UsageError, inputs, train
from train import config as config_lib


def recipe(digits_dir, photos_dir):
  config = mixture.get_config()
  for section in (config.input, config.eval_input):
    section.data_dir.digits, section.data_dir.photos = str(digits_dir), str(photos_dir)
  return config


def test_the_mixture_recipe_passes_its_sources_and_weights_and_evaluates_each_source():
  config = mixture.get_config()
  train_kwargs = config_lib.dataset_kwargs(config)
  assert (
    set(train_kwargs["data_dir"]) == {"digits", "photos"} and train_kwargs["labels"] == "offset"
  )
  assert train_kwargs["weights"] == {"digits": 0.3, "photos": 0.7}
  evaluation = config_lib.dataset_kwargs(config, evaluation=True)
  assert set(evaluation["data_dir"]) == {"digits", "photos"}


def in_photos_classes(state, batch):
  """An eval step that scores a row right where its label is one of the photos' classes
  under labels="offset" (after the digits' 10)."""
  mask = batch["mask"].astype(jnp.float32)
  hit = jnp.sum((batch["label"] >= 10) * mask)
  return {"top1": hit, "top5": hit, "loss": jnp.sum(mask) * 0, "count": jnp.sum(mask)}


def test_each_eval_source_is_its_own_stream_beside_the_train_in_the_mixtures_classes(
  digits_dir, photos_dir
):
  setup = train.prepare(recipe(digits_dir, photos_dir))
  try:
    streams = setup.eval.streams
    assert list(streams) == ["digits", "photos"]
    left = setup.train.memory.budget - setup.train.memory.total
    assert all(s.memory.budget == left for s in streams.values())  # each within the one budget
    ev = inputs.evaluate(in_photos_classes, None, setup.eval)
  finally:
    setup.train.close()
    setup.eval.close()
  by_source = ev["eval_sources"]
  assert by_source["photos"]["top1"] == 1.0 and by_source["digits"]["top1"] == 0.0
  for name, stream in streams.items():
    assert by_source[name]["examples"] == stream.num_examples
  assert ev["eval_examples"] == sum(s.num_examples for s in streams.values())


def test_an_eval_source_the_mixture_lacks_is_refused_in_one_line(digits_dir, photos_dir):
  config = recipe(digits_dir, photos_dir)
  config.eval_input.data_dir = {"digits": str(digits_dir), "other": str(photos_dir)}
  with pytest.raises(UsageError, match="names 'other', not a source of config.input.data_dir"):
    train.prepare(config)


def test_the_trainer_plans_a_mixture(digits_dir, photos_dir, tmp_path):
  out = run_train(
    "--config",
    "mixture",
    "--dry_run",
    f"--config.input.data_dir.digits={digits_dir}",
    f"--config.input.data_dir.photos={photos_dir}",
    f"--config.eval_input.data_dir.digits={digits_dir}",
    f"--config.eval_input.data_dir.photos={photos_dir}",
    cwd=tmp_path,
  )
  plan = plan_line(out)
  assert plan["batch"] == 128
  assert "mixture of 2 sources (digits 30.0% of 240 records, photos 70.0% of 48" in out.stdout


@pytest.mark.slow
def test_the_trainer_trains_on_a_mixture_and_logs_each_sources_share_and_eval(
  digits_dir, photos_dir, tmp_path
):
  out = run_train(
    "--config",
    "mixture",
    "--workdir",
    tmp_path / "run",
    f"--config.input.data_dir.digits={digits_dir}",
    f"--config.input.data_dir.photos={photos_dir}",
    f"--config.eval_input.data_dir.digits={digits_dir}",
    f"--config.eval_input.data_dir.photos={photos_dir}",
    "--config.batch_size=32",
    "--config.num_steps=2",
    "--config.log_every=1",
    "--config.eval_every_steps=2",
    "--config.checkpoint_every_steps=2",
    "--config.synthetic_steps=1",
    cwd=tmp_path,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  said = [line for line in out.stdout.splitlines() if line.startswith("sources: ")]
  assert len(said) == 2
  shares = r"sources: digits (29|30|31)\.\d% \(weight 30\.0%, \d+ img/s\), photos (69|70|71)\.\d%"
  assert re.match(shares, said[1])
  assert "eval: top-1" in out.stdout
  for name in ("digits", "photos"):
    assert re.search(
      rf"^eval {name}: top-1 [\d.]+  top-5 [\d.]+  loss [\d.]+ over \d+ ", out.stdout, re.M
    )
  rows = [
    json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  ]
  logged = set().union(*rows)
  assert {"eval/loss", "eval/digits_top1", "eval/photos_top1", "eval/photos_loss"} <= logged


def test_eval_sources_may_be_pipeline_sources_with_their_own_split_pp_and_size(
  digits_dir, photos_dir
):
  config = recipe(digits_dir, photos_dir)
  config.eval_input.data_dir = {
    "digits": pipeline.Source(digits_dir, split="train", image_size=24),
    "photos": pipeline.Source(photos_dir, pp="decode|resize_small(48)|central_crop(40)"),
  }
  shapes = []

  def step(state, batch):
    shapes.append(batch["image"].shape[1:])
    return in_photos_classes(state, batch)

  setup = train.prepare(config)
  try:
    streams = setup.eval.streams
    assert streams["digits"].num_examples == 240  # its own split: train, not validation's 60
    ev = inputs.evaluate(step, None, setup.eval)
  finally:
    setup.train.close()
    setup.eval.close()
  assert shapes == [(24, 24, 3)] * 2 + [(40, 40, 3)]  # digits in 2 batches of 128, photos 1
  assert ev["eval_sources"]["photos"]["top1"] == 1.0  # in the mixture's classes
  assert ev["eval_sources"]["digits"]["examples"] == 240
