"""Train a Flax MobileNet on the pipeline: `python -m train --config NAME --workdir DIR`."""


class UsageError(ValueError):
  """A mistake in the config or the command line; the CLI prints it in one line, exit 2."""


class TrainError(RuntimeError):
  """A run that cannot go on (a failed save, no checkpoint that restores); one line, exit 1."""
