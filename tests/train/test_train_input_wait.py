"""The input-wait share counts only waiting for input: not checkpoint saves, evals or logging.

Timing-based, so marked slow. The step is made slow honestly: the real train step, then a
second of sleep inside it, in the timed no-input baseline and in training alike; the input
(digits from the RAM cache) is instant next to it.
"""

import time

import jax
import pytest

from configs import default
from train import report, train

SLEEP_S = 1.0


@pytest.mark.slow
def test_input_wait_is_near_zero_when_the_step_is_slow_despite_frequent_evals_and_saves(
  digits_dir, tmp_path, monkeypatch
):
  make_steps = train.make_steps

  def slow_steps(*args):
    train_step, eval_step = make_steps(*args)

    def slow_train_step(state, batch):
      out = jax.block_until_ready(train_step(state, batch))
      time.sleep(SLEEP_S)
      return out

    return slow_train_step, eval_step

  monkeypatch.setattr(train, "make_steps", slow_steps)
  config = default.get_config()
  config.input.data_dir = str(digits_dir)
  config.batch_size = 32
  config.num_steps = 9
  config.log_every = 3
  config.eval_every_steps = 1  # an eval and a save after every step: seconds each
  config.checkpoint_every_steps = 1
  config.synthetic_steps = 2
  result = train.train_and_evaluate(config, tmp_path)
  assert result["synthetic_step_s"] >= SLEEP_S
  assert result["input_wait_share"] < report.MODERATE, result
  assert result["verdict"] == "not input-bound"


def small_config(digits_dir, num_steps: int):
  config = default.get_config()
  config.input.data_dir = str(digits_dir)
  config.batch_size = 32
  config.num_steps = num_steps
  config.log_every = 4
  config.synthetic_steps = 2
  return config


@pytest.mark.slow
def test_evals_and_saves_every_few_steps_on_instant_input_are_not_input_bound(
  digits_dir, tmp_path, capsys
):
  # The step right after an eval or a save, and a step slowed by a save's background work,
  # are not waits for input: the digits come from the RAM cache, faster than any step.
  config = small_config(digits_dir, 24)
  config.eval_every_steps = 3
  config.checkpoint_every_steps = 2
  result = train.train_and_evaluate(config, tmp_path)
  assert result["input_wait_share"] < report.MODERATE, result
  assert result["verdict"] == "not input-bound"
  out = capsys.readouterr().out
  assert "input wait: share of step time the devices sat idle for the next batch" in out


@pytest.mark.slow
def test_two_identical_runs_agree_on_the_input_wait_within_five_points(digits_dir, tmp_path):
  shares, params = [], []
  for run in ("a", "b"):
    result = train.train_and_evaluate(small_config(digits_dir, 20), tmp_path / run)
    shares.append(result["input_wait_share"])
    params.append(result["params_sha256"])
  assert params[0] == params[1]  # the same run
  assert abs(shares[0] - shares[1]) < 0.05, shares
  assert {report.verdict(s) for s in shares} == {report.verdict(shares[0])}
