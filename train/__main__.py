"""`python -m train --config NAME --workdir DIR [--config.FIELD=VALUE ...]`

Trains and evaluates; re-running the same command resumes from the latest checkpoint (or
says "already done"). NAME is a recipe in the repo's configs/ (`default`,
`imagenet_mobilenet_v1`, ...) or the path of one. `--dry_run` checks the config, the data
and the fit, prints the plan and stops. On a TPU pod slice run it on every host
(`--worker=all`); JAX joins the hosts. Elsewhere name them: `--coordinator_address HOST:PORT
--num_processes N --process_id I` on each. Mistakes are one line (exit 2); `--verbose` shows
the traceback.
"""

import ast
import logging as pylogging
import os
import re
import sys
import traceback
import warnings

from train import supervise

if __name__ == "__main__" and supervise.wanted(sys.argv[1:]):  # one of several processes
  raise SystemExit(supervise.run(sys.argv[1:]))

try:  # the 'train' extra: named in one line when missing (`pip install .` has only the library)
  import flax  # noqa: F401
  import ml_collections  # noqa: F401
  import optax  # noqa: F401
  import orbax.checkpoint  # noqa: F401
except ModuleNotFoundError as e:
  from pipeline.host import extras

  if extras.hint(e.name, "python -m train") is None:
    raise
  print(extras.hint(e.name, "python -m train"), file=sys.stderr)
  raise SystemExit(2) from None

from absl import app, flags, logging
from ml_collections import config_flags

from train import TrainError, UsageError
from train import config as config_lib

WORKDIR = flags.DEFINE_string("workdir", None, "checkpoints, TensorBoard logs, summary.json")
config_flags.DEFINE_config_file(  # default set by config_path: one given here is read at
  "config",  # import with the --config.* overrides, a misspelt one a traceback
  None,
  "a recipe: a name in the repo's configs/ or a path (default: default)",
)
MULTIHOST = flags.DEFINE_bool(
  "multihost",
  None,
  "join the other processes with jax.distributed (default: on a TPU pod slice, or when "
  "--num_processes is given)",
)
COORDINATOR = flags.DEFINE_string(
  "coordinator_address", None, "HOST:PORT of process 0, for clusters JAX does not detect"
)
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "how many processes run the job")
PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index, 0 to N-1")
HEARTBEAT = flags.DEFINE_integer(
  "heartbeat_timeout", 60, "seconds without a heartbeat after which a process counts as lost"
)
JOIN_TIMEOUT = flags.DEFINE_integer(
  "join_timeout", 120, "seconds to wait for every process to join; then name those missing"
)
CACHE = flags.DEFINE_string(
  "compilation_cache",
  os.path.expanduser("~/.cache/jax"),
  "persistent XLA compilation cache ('' to disable)",
)
DRY_RUN = flags.DEFINE_bool("dry_run", False, "check the config, data and fit; print the plan")
VERBOSE = flags.DEFINE_bool("verbose", False, "tracebacks for errors; Orbax's and gcsfs' logs")


def fail(message: str, code: int = 2):
  from pipeline.storage import stalled

  print(f"python -m train: {message}", file=sys.stderr, flush=True)
  if stalled.happened():  # reads wait on in their threads: an orderly exit would wait for them
    stalled.leave(code)
  raise SystemExit(code)


def cause(error: Exception) -> str | None:
  """What ended the run, in one line, for errors that are not the trainer's own bug (the
  data, memory, files); None for others, whose traceback is shown."""
  import pipeline
  from train import checkpoints

  if isinstance(error, pipeline.BadRecordError):
    return f"{error}; --config.input.on_error=skip skips bad records (counted)"
  if isinstance(error, MemoryError):
    return "out of host memory (MemoryError)"
  text = " ".join(str(error).split())
  if text.startswith("RESOURCE_EXHAUSTED"):
    return f"out of device memory: {text[:240]}"
  if isinstance(error, OSError):
    return checkpoints.one_line(error)
  return None


def fail_here(message: str):
  """Exit 1 with `message`; with several processes, naming this one to all of them."""
  import jax

  from train import hosts

  if jax.process_count() == 1:
    fail(message, 1)
  line = f"python -m train: process {jax.process_index()} failed: {message}"
  print(line, file=sys.stderr, flush=True)  # first: once process 0 exits, the service is gone
  hosts.report_failure(line)
  sys.stdout.flush()
  os._exit(1)  # JAX's exit handlers would wait for the processes this one ends


def config_path(argv: list[str]) -> list[str]:
  """`--config NAME` (or a path relative to configs/) replaced by the recipe's path; none
  given: configs/default.py."""
  out = list(argv)
  if not any(a == "--config" or a.startswith("--config=") for a in out):
    out[1:1] = [f"--config={config_lib.CONFIGS / 'default.py'}"]
  for i, arg in enumerate(out):
    if arg == "--config" and i + 1 < len(out):
      out[i + 1] = str(config_lib.find(out[i + 1]))
    elif arg.startswith("--config="):
      out[i] = "--config=" + str(config_lib.find(arg.split("=", 1)[1]))
  return out


def flag_error(e: Exception, argv: list[str]) -> str:
  """A flag or config-override error as one line."""
  text = str(e)
  if isinstance(e, (AttributeError, KeyError)):  # ml_collections: an unknown field
    text = ast.literal_eval(text) if text[:1] in "'\"" else text
    key = text.partition("\n")[0].strip("'\"")
    given = [
      a.split("=")[0]
      for a in argv
      if a.startswith("--config.") and key in a.split("=")[0].split(".")
    ]
    hint = re.search(r'Did you mean "([^"]+)"', text)
    return f"unknown config field {given[0] if given else key}" + (
      f" (did you mean {hint.group(1)}?)" if hint else ""
    )
  return " ".join(text.split())


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing with one-line errors; quiet logs (warnings and up, none of Orbax's
  or gcsfs') unless --verbose."""
  verbose = any(a in ("--verbose", "--verbose=true", "--verbose=True") for a in argv)
  try:
    rest = flags.FLAGS(config_path(argv))
    if WORKDIR.value is None and not DRY_RUN.value:
      raise UsageError("--workdir is required (checkpoints, logs and summary.json go there)")
  except (flags.Error, AttributeError, KeyError, ValueError, OSError) as e:
    if verbose:
      raise
    fail(flag_error(e, argv))
  if flags.FLAGS["verbosity"].using_default_value and not verbose:
    flags.FLAGS.verbosity = logging.WARNING  # no Orbax INFO flood; --verbosity=0 shows it
    logging.get_absl_logger().addFilter(quiet_orbax)
    pylogging.getLogger("asyncio").setLevel(pylogging.CRITICAL)  # Orbax's unread futures
    pylogging.getLogger("gcsfs").setLevel(pylogging.CRITICAL)  # its retries: ours say one line
    sys.unraisablehook = quiet_orbax_leftovers
    warnings.filterwarnings(  # Orbax's writes a failed save abandoned, collected at exit
      "ignore", message="coroutine .* was never awaited", category=RuntimeWarning
    )
  return rest


def quiet_orbax(record) -> bool:
  """Drops Orbax's own log lines: its failures reach the trainer as exceptions, reported in
  one line (a failed save logged hundreds of lines of tracebacks from its threads)."""
  return f"{os.sep}orbax{os.sep}" not in record.pathname


def quiet_orbax_leftovers(unraisable):
  """Drops what Orbax's aborted operations leave behind after a failed save or restore, which
  the trainer reports itself: TensorStore callbacks into a closed event loop and coroutines
  that died with the error (hundreds of tracebacks). Anything else is reported as usual."""
  value, tb = unraisable.exc_value, unraisable.exc_traceback
  closed_loop = isinstance(value, RuntimeError) and str(value) == "Event loop is closed"
  files = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(tb)]
  if not (closed_loop or any(f"{os.sep}orbax{os.sep}" in f for f in files)):
    sys.__unraisablehook__(unraisable)


def main(argv):
  del argv
  import jax

  from train import hosts

  named = (COORDINATOR.value, NUM_PROCESSES.value, PROCESS_ID.value)
  if any(v is not None for v in named) and None in named:
    fail("--coordinator_address, --num_processes and --process_id go together")
  multihost = MULTIHOST.value
  if multihost is None:  # TPU VMs of a pod slice list their peers here
    multihost = NUM_PROCESSES.value is not None or "," in os.environ.get("TPU_WORKER_HOSTNAMES", "")
  if multihost:
    try:
      hosts.initialize(*named, HEARTBEAT.value, JOIN_TIMEOUT.value)
    except UsageError as e:  # the coordinator's port taken: every process says it
      fail(str(e))
    except (ValueError, RuntimeError) as e:
      if VERBOSE.value:
        raise
      fail(
        f"cannot join the other processes ({' '.join(str(e).split())[:200]}); off a TPU pod "
        "slice name them: --coordinator_address HOST:PORT --num_processes N --process_id I"
      )
  if CACHE.value:
    jax.config.update("jax_compilation_cache_dir", CACHE.value)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  from pipeline.storage import remote, stalled
  from train import train

  config = flags.FLAGS.config
  try:
    if DRY_RUN.value:
      setup = train.prepare(config)
      print(f"plan: {setup.plan.describe()}; fits\n{setup.notes}", end="")
    else:
      train.train_and_evaluate(config, WORKDIR.value)
      supervise.completed()  # JAX's exit may still abort: the parent then says it lost nothing
  except UsageError as e:  # the same on every process (`hosts.agree`)
    if VERBOSE.value:
      raise
    hosts.leave_together()
    fail(str(e), 2)
  except TrainError as e:
    if VERBOSE.value:
      traceback.print_exc()
    fail_here(str(e))
  except KeyboardInterrupt:
    if VERBOSE.value:
      raise
    fail("interrupted; steps since the last checkpoint are lost", 130)
  except remote.RemoteStorageError as e:
    # Storage that stopped answering mid-run: its reads may hang on in their threads (and an
    # orderly exit joins them), the other processes wait in a collective for this one (and
    # an orderly exit waits for them): leave at once, in one line, told to the others, which
    # print it and leave too (not a heartbeat timeout later, naming no cause).
    if VERBOSE.value:
      traceback.print_exc()
    if jax.process_count() == 1:
      print(f"python -m train: {e}", file=sys.stderr, flush=True)
    else:
      line = f"python -m train: process {jax.process_index()} failed: {e}"
      print(line, file=sys.stderr, flush=True)
      hosts.report_failure(line)
    stalled.leave(1)
  except Exception as e:
    if hosts.lost_peer(e):  # the distributed service will say which process
      hosts.await_verdict(e)
    message = cause(e)
    if message is None and jax.process_count() == 1:
      raise
    if message is None or VERBOSE.value:
      traceback.print_exc()
    fail_here(message or f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
