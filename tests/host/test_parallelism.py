"""The host model and the automatic choice of worker processes x decode threads.

Core counts and memory are faked; the costs are the measured constants, so these specify
the choice the model makes, not any speed.
"""

import dataclasses
import os

import pytest

from pipeline.host import parallelism
from pipeline.host.parallelism import COSTS, Plan, plan, project

GIB = 2**30
IMAGE = 224 * 224 * 3  # bytes of an image at 224 px
BATCH = 128 * IMAGE


def test_two_cores_keep_one_process_with_a_thread_per_core():
  chosen = plan(2, memory_bytes=16 * GIB)
  assert (chosen.workers, chosen.threads) == (0, 2)
  assert "auto for 2 cores" in chosen.why


@pytest.mark.parametrize("cores", [96, 224])
def test_many_cores_run_workers_with_a_few_threads_each(cores):
  chosen = plan(cores, memory_bytes=cores * GIB, batch_size=128, image_bytes=IMAGE)
  assert chosen.workers >= 2 and 2 <= chosen.threads <= 16
  assert chosen.workers * chosen.threads <= cores
  one_process = max(project(cores, COSTS, Plan(0, t)) for t in range(1, cores + 1))
  # one process is capped by its GIL; workers multiply it until receiving their batches binds
  assert project(cores, COSTS, chosen) > 3 * one_process


def test_eight_cores_beat_one_thread_per_core_in_one_process_without_oversubscribing():
  chosen = plan(8, memory_bytes=8 * GIB)
  assert max(chosen.workers, 1) * chosen.threads <= 8
  assert project(8, COSTS, chosen) >= project(8, COSTS, Plan(0, 8))


def test_without_a_gil_bound_eight_cores_stay_in_one_process():
  light = dataclasses.replace(COSTS, gil_us=20.0)  # Python per image no longer binds
  chosen = plan(8, costs=light, memory_bytes=8 * GIB)
  assert (chosen.workers, chosen.threads) == (0, 8)


def test_one_process_never_passes_its_gil_ceiling_however_many_threads():
  for threads in (1, 4, 16, 64, 224):
    assert project(224, COSTS, Plan(0, threads)) <= 1e6 / COSTS.gil_us


def test_workers_pay_the_main_process_receiving_every_batch():
  for workers in (1, 16, 64, 224):
    assert project(224, COSTS, Plan(workers, 8)) <= 1e6 / COSTS.receive_us


def test_projection_grows_with_cores():
  rates = [project(c, COSTS, plan(c, memory_bytes=c * GIB)) for c in (2, 8, 32, 96, 224)]
  assert rates == sorted(rates) and rates[-1] > rates[0]


def test_settings_you_give_are_kept_and_the_rest_chosen():
  assert plan(224, num_workers=3, num_threads=5) == Plan(3, 5, "set by you")
  workers_given = plan(224, num_workers=3, memory_bytes=224 * GIB)
  assert workers_given.workers == 3 and 1 <= workers_given.threads <= 224 // 3
  assert "num_workers set by you" in workers_given.why
  threads_given = plan(224, num_threads=2, memory_bytes=224 * GIB)
  assert threads_given.threads == 2 and threads_given.workers >= 1
  one_process = plan(224, num_workers=0, memory_bytes=224 * GIB)
  assert one_process.workers == 0 and 1 <= one_process.threads < 224


def test_workers_fit_in_half_the_memory():
  per_worker = COSTS.worker_mb * 2**20 + (2 + parallelism.WORKER_BATCHES) * BATCH
  chosen = plan(224, memory_bytes=int(2 * 3.5 * per_worker), batch_size=128, image_bytes=IMAGE)
  assert chosen.workers == 3 and "memory for at most 3 workers" in chosen.why
  assert plan(224, memory_bytes=per_worker, batch_size=128, image_bytes=IMAGE).workers == 0


def test_default_is_this_hosts_cores():
  assert f"auto for {len(os.sched_getaffinity(0))} cores" in plan().why


def test_the_choice_is_printed_once_per_process(capsys):
  chosen = Plan(5, 3, "a test plan")
  parallelism.announce(chosen)
  parallelism.announce(chosen)
  err = capsys.readouterr().err
  assert err.count("5 worker processes x 3 decode threads (a test plan)") == 1


def test_larger_batches_spread_the_main_process_receiving_over_more_images():
  small = plan(224, batch_size=128, image_bytes=IMAGE, memory_bytes=224 * GIB)
  large = plan(224, batch_size=1024, image_bytes=IMAGE, memory_bytes=224 * GIB)
  assert large.workers >= small.workers
  assert project(224, parallelism.at_batch(COSTS, 1024), large) > project(
    224, parallelism.at_batch(COSTS, 128), small
  )


def test_a_hyperthread_counts_as_less_than_a_core():
  smt = dataclasses.replace(COSTS, threads_per_core=2, smt_yield=0.25)
  assert parallelism.core_equivalents(224, smt) == pytest.approx(140.0)
  assert parallelism.core_equivalents(224, COSTS) == 224  # no SMT siblings: a core each
  cores_bound = dataclasses.replace(smt, gil_us=1.0, receive_us=0.0, receive_free_us=0.0)
  many = Plan(16, 14)
  assert project(224, cores_bound, many) == pytest.approx(
    140 * 1e6 / (smt.cpu_us + smt.send_us), rel=1e-6
  )


def test_every_main_process_cost_and_the_training_step_bound_a_host_with_workers():
  costs = dataclasses.replace(COSTS, receive_us=3.0, receive_free_us=2.0, step_us=1280.0)
  lim = parallelism.limits(224, costs, Plan(8, 8), batch_size=128)
  assert lim["main"] == pytest.approx(1e6 / (3.0 + 2.0 + 10.0))
  # a bigger step spreads the step's host work over more images
  assert parallelism.limits(224, costs, Plan(8, 8), batch_size=1024)["main"] > lim["main"]
  # without workers the main process decodes: only the step's work is added there
  alone = parallelism.limits(224, costs, Plan(0, 8), batch_size=128)
  assert alone["main"] == pytest.approx(1e6 / 10.0)
