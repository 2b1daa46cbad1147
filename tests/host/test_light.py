"""Light worker processes (`pipeline.host.light`): Grain's workers and the converters' never
load JAX, even under a script that imports it, unless `performance.worker_jax` lets them; an
op that imports JAX in a light worker fails in one line naming that setting."""

from __future__ import annotations

import json
import os
import sys

import pytest

import pipeline
from pipeline.host import light
from tests.conftest import REPO, run_command
from tests.host.light_probes import jax_op

ENV = {**os.environ, "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1"}

# A user's training script: JAX imported at the top, an op of its own, workers.
SCRIPT = """
import json, os, sys
import jax  # as a trainer's script does: spawned workers would import it again
import numpy as np
import pipeline

def probe(batch, rng):  # defined here: it reaches the workers by pickle, not by import
  with open("/proc/self/maps") as f:
    mapped = "jaxlib" in f.read()
  rows = len(batch["label"])
  batch["pid"] = np.full(rows, os.getpid())
  batch["jax_imported"] = np.full(rows, "jax" in sys.modules)
  batch["jaxlib_mapped"] = np.full(rows, mapped)
  return batch

if __name__ == "__main__":
  ds = pipeline.make_dataset(sys.argv[1], batch_size=8, image_size=32, shard_index=0,
                             shard_count=1, batch_ops=[probe],
                             performance=dict(num_workers=2, num_threads=1))
  it = iter(ds)
  batches = [next(it) for _ in range(6)]
  processes = it.stats().processes
  it.close()
  print(json.dumps({
    "workers": sorted({int(p) for b in batches for p in b["pid"]} - {os.getpid()}),
    "jax_imported": [bool(x) for b in batches for x in b["jax_imported"]],
    "jaxlib_mapped": [bool(x) for b in batches for x in b["jaxlib_mapped"]],
    "processes": [[p.process, p.rss_mb, p.started_s, p.jax] for p in processes],
  }))
"""


def test_worker_processes_never_load_jax_even_when_the_script_imports_it(tmp_path, digits_dir):
  script = tmp_path / "train.py"
  script.write_text(SCRIPT)
  proc = run_command([sys.executable, script, digits_dir], cwd=tmp_path, env=ENV)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert len(out["workers"]) == 2  # the op ran in two worker processes
  assert len(out["jax_imported"]) == 6 * 8
  assert not any(out["jax_imported"]) and not any(out["jaxlib_mapped"])
  assert "Failed to load jax profiler" not in proc.stderr  # Grain's warning, ours to drop
  # iterator.stats() says so too, with each worker's memory and start-up
  main, *workers = out["processes"]
  assert main[0].startswith("main") and main[3] is True  # the script's own JAX
  assert [w[0].split(" (")[0] for w in workers] == ["worker 0", "worker 1"]
  for _, rss_mb, started_s, jax in workers:
    assert not jax and 20 < rss_mb < 1000 and started_s > 0


def stream(data_dir, **performance):
  return iter(
    pipeline.make_dataset(
      data_dir,
      batch_size=8,
      image_size=16,
      shard_index=0,
      shard_count=1,
      batch_ops=[jax_op],
      performance={"num_workers": 1, "num_threads": 1, **performance},
    )
  )


def test_an_op_that_imports_jax_in_a_worker_fails_in_one_line_naming_the_opt_in(digits_dir):
  it = stream(digits_dir)
  with pytest.raises(light.JaxBlockedError) as error:
    next(it)
  it.close()
  message = str(error.value)
  assert "\n" not in message
  assert message == (
    "jax is not imported in pipeline worker processes (each stays ~140 MB lighter): an op "
    "that needs JAX runs in them with performance.worker_jax=True"
  )


@pytest.mark.slow
def test_worker_jax_lets_an_op_import_jax_in_the_workers(digits_dir):
  it = stream(digits_dir, worker_jax=True)
  batch = next(it)
  it.close()
  assert batch["jax_imported"].all()


CONVERT = """
import json, os, sys
import jax  # the script that runs the converter has JAX
from pipeline.convert import shards
from tests.host.light_probes import probe_task

if __name__ == "__main__":
  print(json.dumps(list(shards.ordered_map(probe_task, list(range(8)), 2))))
"""


def test_converter_workers_never_load_jax_even_when_the_script_imports_it(tmp_path):
  script = tmp_path / "convert.py"
  script.write_text(CONVERT)
  proc = run_command([sys.executable, script], cwd=tmp_path, env=ENV)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads(proc.stdout.strip().splitlines()[-1])
  assert len(results) == 8
  assert {(jax, mapped) for _, jax, mapped in results} == {(False, False)}
