"""The trainer's train stream ends at the run's last step, so its read-ahead never plans past
it; after a resume, the steps left count in the stream's own batches (a checkpoint saved at
another global batch resumes at another batch index). The stream's side, fast:
tests/stages/test_read_ahead_ends.py."""

import itertools

import pytest

from configs import default
from train import train


def prepared(data_dir, workdir, global_batch: int) -> train.Run:
  config = default.get_config()
  config.input.data_dir = str(data_dir)
  config.batch_size = global_batch
  config.num_steps = 5
  return train.set_up(config, workdir, train.prepare(config), None)


def closed(run: train.Run) -> None:
  run.ckpt.close(), run.train.close(), run.eval.close()


@pytest.mark.slow  # 60 s on 2 loaded cores (model init, a checkpoint): the stream's own tests
def test_the_train_stream_ends_at_the_last_step_also_resumed_at_another_global_batch(
  digits_dir, tmp_path
):
  run = prepared(digits_dir, tmp_path, 16)
  taken = [next(run.train) for _ in range(2)]
  run.ckpt.save(2, run.state, run.train)
  assert len(taken + list(itertools.islice(run.train, 10))) == 5
  closed(run)
  run = prepared(digits_dir, tmp_path, 8)  # 2 steps of 16 are 4 batches of 8
  assert run.step == 2 and run.train.get_state()["position"] == 32
  assert len(list(itertools.islice(run.train, 10))) == 3
  closed(run)
