"""The mixture recipe (configs/mixture.py): digits and photos in one stream, eval on digits."""

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
