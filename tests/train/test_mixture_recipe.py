"""The mixture recipe (configs/mixture.py): digits and photos in one stream, eval on digits."""

import re

import pytest

from configs import mixture
from tests.train.test_train_config import plan_line, run_train
from train import config as config_lib


def test_the_mixture_recipe_passes_its_sources_and_weights_and_evaluates_one_source():
  config = mixture.get_config()
  train = config_lib.dataset_kwargs(config)
  assert set(train["data_dir"]) == {"digits", "photos"} and train["labels"] == "offset"
  assert train["weights"] == {"digits": 0.3, "photos": 0.7}
  evaluation = config_lib.dataset_kwargs(config, evaluation=True)
  assert isinstance(evaluation["data_dir"], str) and "weights" not in evaluation


def test_the_trainer_plans_a_mixture(digits_dir, photos_dir, tmp_path):
  out = run_train(
    "--config",
    "mixture",
    "--dry_run",
    f"--config.input.data_dir.digits={digits_dir}",
    f"--config.input.data_dir.photos={photos_dir}",
    f"--config.eval_input.data_dir={digits_dir}",
    cwd=tmp_path,
  )
  plan = plan_line(out)
  assert plan["batch"] == 128
  assert "mixture of 2 sources (digits 30.0% of 240 records, photos 70.0% of 48" in out.stdout


@pytest.mark.slow
def test_the_trainer_trains_on_a_mixture_and_logs_each_sources_share(
  digits_dir, photos_dir, tmp_path
):
  out = run_train(
    "--config",
    "mixture",
    "--workdir",
    tmp_path / "run",
    f"--config.input.data_dir.digits={digits_dir}",
    f"--config.input.data_dir.photos={photos_dir}",
    f"--config.eval_input.data_dir={digits_dir}",
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
