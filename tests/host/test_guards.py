"""Setups refused before anything is built: a batch no epoch can hold, and a script whose
worker processes would build the pipeline again (no `if __name__ == "__main__":`)."""

import subprocess
import sys
import textwrap
import types

import pytest

import pipeline
from pipeline.host import guards
from tests.conftest import REPO, run_command

BUILD = """
import pipeline
from pipeline.host import guards
guards.check_main_guard()  # what make_dataset runs before starting worker processes
ds = pipeline.make_dataset({data!r}, "train", batch_size=8, image_size=16,
                           performance={{"num_workers": 1, "num_threads": 1}})
it = iter(ds)
print("batch", next(it)["image"].shape)
it.close()
"""


def bare_env(home, path: str = str(REPO)) -> dict:
  """A user's bare environment: PYTHONPATH `path` (this checkout), HOME `home`."""
  return {"PYTHONPATH": path, "PATH": "/usr/bin:/bin", "HOME": str(home)}


def run_script(tmp_path, source: str, name: str = "experiment.py") -> subprocess.CompletedProcess:
  script = tmp_path / name
  script.write_text(source)
  return run_command([sys.executable, script], cwd=tmp_path, env=bare_env(tmp_path), timeout=240)


def indented(code: str) -> str:
  return textwrap.indent(code.strip(), "  ")


def test_an_unguarded_script_is_refused_in_one_line_before_any_worker_starts(tmp_path, digits_dir):
  out = run_script(tmp_path, BUILD.format(data=str(digits_dir)))
  assert out.returncode == 1
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith("ValueError: worker processes re-import the main script, and ")
  assert "experiment.py:4 builds the pipeline at module level" in last
  assert 'put that code under `if __name__ == "__main__":`' in last
  assert "terminated unexpectedly" not in out.stderr and "bootstrapping" not in out.stderr
  # A function called from the unguarded module level is the same mistake.
  wrapped = "def main():\n" + indented(BUILD.format(data=str(digits_dir))) + "\nmain()\n"
  out = run_script(tmp_path, wrapped, "wrapped.py")
  line = wrapped.splitlines().index("main()") + 1
  assert f"wrapped.py:{line} builds the pipeline at module level" in out.stderr


def test_a_guarded_script_starts_its_worker_processes_and_gets_batches(tmp_path, digits_dir):
  guarded = 'if __name__ == "__main__":\n' + indented(BUILD.format(data=str(digits_dir)))
  out = run_script(tmp_path, guarded)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "batch (8, 16, 16, 3)" in out.stdout


def test_notebooks_and_python_c_are_not_scripts_to_guard():
  code = "from pipeline.host import guards; guards.check_main_guard(); print('ok')"
  out = run_command([sys.executable, "-c", code], timeout=60)
  assert out.stdout.strip() == "ok", out.stderr
  guards.check_main_guard()  # under pytest: called from a function, never module level


def test_make_dataset_refuses_an_unguarded_script_that_needs_workers(tmp_path, digits_dir):
  source = BUILD.format(data=str(digits_dir)).replace("guards.check_main_guard()", "")
  out = run_script(tmp_path, source)
  assert "put that code under `if __name__" in out.stderr.strip().splitlines()[-1]


THREADS_ONLY = """
import os
os.sched_setaffinity(0, {{min(os.sched_getaffinity(0))}})  # a 1-core host: no workers chosen
import pipeline
ds = pipeline.make_dataset({data!r}, "train", batch_size=8, image_size=16{performance})
it = iter(ds)
print("batch", next(it)["image"].shape)
it.close()
"""


@pytest.mark.slow
def test_an_unguarded_script_is_refused_at_start_even_where_no_worker_would_start(
  tmp_path, digits_dir
):
  # The same script on a many-core host would start workers: refused here too, at once.
  out = run_script(tmp_path, THREADS_ONLY.format(data=str(digits_dir), performance=""))
  assert out.returncode == 1 and "batch" not in out.stdout
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith("ValueError: worker processes, which make_dataset starts on many-core ")
  assert "experiment.py:5 builds the pipeline at module level" in last
  assert 'put that code under `if __name__ == "__main__":`' in last
  # Threads pinned by the script (no worker on any host): nothing to guard.
  pinned = THREADS_ONLY.format(data=str(digits_dir), performance=", performance={'num_workers': 0}")
  out = run_script(tmp_path, pinned)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "batch (8, 16, 16, 3)" in out.stdout
  # Guarded, the same threads-only script runs.
  lines = THREADS_ONLY.format(data=str(digits_dir), performance="").strip().splitlines()
  guarded = "\n".join(lines[:3]) + '\nif __name__ == "__main__":\n' + indented("\n".join(lines[3:]))
  out = run_script(tmp_path, guarded)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "batch (8, 16, 16, 3)" in out.stdout


def test_code_typed_into_the_interpreter_is_not_a_script_to_guard(tmp_path, digits_dir):
  # As a REPL or a notebook cell: __main__ has no file, so module-level code is fine.
  code = THREADS_ONLY.format(data=str(digits_dir), performance="")
  out = run_command(
    [sys.executable, "-"], cwd=tmp_path, env=bare_env(tmp_path), input=code, timeout=240
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert "batch (8, 16, 16, 3)" in out.stdout


def test_a_guarded_module_run_with_python_m_is_not_refused(tmp_path, digits_dir):
  package = tmp_path / "exp"
  package.mkdir()
  (package / "__init__.py").write_text("")
  body = THREADS_ONLY.format(data=str(digits_dir), performance="").strip().splitlines()
  (package / "__main__.py").write_text(
    "\n".join(body[:3]) + '\nif __name__ == "__main__":\n' + indented("\n".join(body[3:]))
  )
  env = bare_env(tmp_path, f"{REPO}:{tmp_path}")
  out = run_command([sys.executable, "-m", "exp"], cwd=tmp_path, env=env, timeout=240)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "batch (8, 16, 16, 3)" in out.stdout


def test_a_batch_no_epoch_can_hold_is_refused_naming_the_sizes():
  with pytest.raises(
    ValueError,
    match=r"batch_size=256 is larger than the 240 records of "
    r"'train' this process reads.*at most 240, or drop_remainder=False",
  ):
    guards.check_batch_fits(256, 240, drop_remainder=True, split="'train'")
  guards.check_batch_fits(240, 240, drop_remainder=True)
  guards.check_batch_fits(256, 240, drop_remainder=False)  # one padded batch: fine


def test_make_dataset_refuses_a_batch_larger_than_the_split(digits_dir):
  with pytest.raises(ValueError, match="is larger than the 240 records"):
    pipeline.make_dataset(digits_dir, "train", batch_size=256, image_size=16)


def test_a_missing_c_decoder_is_reported_once_with_its_cost(digits_dir):
  # As on a host without libjpeg headers, where pip builds no extension and says so only
  # with -v: the first batch prints one line, once, and the batches still come.
  code = (
    "import sys; sys.modules['pipeline.image._jpeg'] = None\n"
    "import pipeline\n"
    f"ds = pipeline.make_dataset({str(digits_dir)!r}, 'train', batch_size=8, image_size=16,"
    " performance={'num_threads': 1})\n"
    "it = iter(ds); [next(it) for _ in range(3)]; it.close(); print('batches')\n"
  )
  out = run_command([sys.executable, "-c", code], timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = [line for line in out.stderr.splitlines() if "C JPEG decoder" in line]
  assert len(lines) == 1, out.stderr
  assert "not available" in lines[0] and "half the throughput" in lines[0]
  assert "install libjpeg-dev" in lines[0] and out.stdout.strip() == "batches"


def run_as_main(monkeypatch, tmp_path, source: str) -> None:
  """Runs `source` in-process as the module-level code of a script `experiment.py` that is
  `__main__`, where `pipeline.host.guards.check_main_guard` judges it as in a real script."""
  script = tmp_path / "experiment.py"
  script.write_text(source)
  main = types.ModuleType("__main__")
  main.__file__ = str(script)
  monkeypatch.setitem(sys.modules, "__main__", main)
  exec(compile(source, str(script), "exec"), vars(main))


CHECK = "from pipeline.host import guards\n{test}\n  guards.check_main_guard()\n"


@pytest.mark.parametrize(
  "test",
  [
    'if __name__ == "__main__" and len(sys.argv) >= 1:',
    'if "__main__" == __name__ and True:',
    'if False:\n  pass\nelif __name__ == "__main__":',
    'if __name__ != "__main__":\n  pass\nelse:',
    'if not (__name__ != "__main__" or False):',
  ],
)
def test_any_if_whose_test_requires_the_main_name_is_a_guard(monkeypatch, tmp_path, test):
  run_as_main(monkeypatch, tmp_path, "import sys\n" + CHECK.format(test=test))


@pytest.mark.parametrize(
  "test",
  [
    'if __name__ == "__main__" or True:',
    'if len(sys.argv) >= 1:',
    'if __name__ != "__main__" and False:\n  pass\nelse:',
  ],
)
def test_an_if_that_also_runs_in_a_worker_is_not_a_guard(monkeypatch, tmp_path, test):
  with pytest.raises(ValueError, match=r"experiment.py:\d+ builds the pipeline at module level"):
    run_as_main(monkeypatch, tmp_path, "import sys\n" + CHECK.format(test=test))
