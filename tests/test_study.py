"""The tf.data guide's study on Grain: each schedule reaches its minimum; timelines record and draw."""

import collections
import dataclasses
import pathlib
import subprocess
import sys
import threading

import pytest

from bench import timeline
from bench import study

ROOT = pathlib.Path(__file__).resolve().parent.parent

# The guide's study with every cost halved and smaller chains: about 3 s for all of it.
SMALL = dataclasses.replace(study.Params().scaled(0.5), chain_records=10, chain_epochs=2,
                            fast_elements=2000, picture_elements=256)


def fastest(name: str, repeats: int = 2) -> tuple[float, list[timeline.Event]]:
  """The fastest of `repeats` runs of a variant: sleeps only ever run late on busy cores."""
  runs = []
  for _ in range(repeats):
    recorder = timeline.Recorder()
    runs.append((study.VARIANTS[name].run(SMALL, recorder), recorder.events()))
  return min(runs, key=lambda run: run[0])


def trained(events: list[timeline.Event]) -> collections.Counter:
  return collections.Counter(e.element for e in events if e.stage == "train")


def records(files: dict[int, int], epochs: int) -> collections.Counter:
  """Each record of each file (file: record count) trained once per epoch."""
  return collections.Counter({f"{f}:{r}": epochs for f, n in files.items() for r in range(n)})


P = SMALL
EXPECTED_TRAINING = {
    "naive": records({0: P.records}, P.epochs),
    "prefetch": records({0: P.records}, P.epochs),
    "sequential_interleave": records(dict(enumerate(study.GUIDE_INTERLEAVE_SIZES)), P.epochs),
    "parallel_interleave": records(dict(enumerate(study.GUIDE_INTERLEAVE_SIZES)), P.epochs),
    "sequential_map": records({0: P.records}, P.epochs),
    "parallel_map": records({0: P.records}, P.epochs),
    "cache": records({0: P.records}, P.cache_epochs),
    "naive_chain": records({0: P.chain_records, 1: P.chain_records}, P.chain_epochs),
    "optimized_chain": records({0: P.chain_records, 1: P.chain_records}, P.chain_epochs),
}


@pytest.mark.parametrize("name", EXPECTED_TRAINING)
def test_each_schedule_trains_every_record_once_per_epoch_near_its_minimum(name):
  seconds, events = fastest(name)
  minimum = study.VARIANTS[name].minimum(SMALL)
  assert trained(events) == EXPECTED_TRAINING[name]
  assert seconds >= 0.99 * minimum, "faster than the schedule allows: the minimum is wrong"
  assert seconds <= 1.5 * minimum


def test_optimized_chain_beats_naive_by_the_guides_margin_within_reach_of_its_minimum():
  naive, _ = fastest("naive_chain")
  optimized, _ = fastest("optimized_chain")
  assert naive / optimized >= study.GUIDE_BEST_SPEEDUP
  assert optimized <= 1.25 * study.VARIANTS["optimized_chain"].minimum(SMALL)


def test_parallel_interleave_opens_the_files_at_once_on_two_workers():
  _, events = fastest("parallel_interleave", repeats=1)
  first, second = [e for e in events if e.stage == "open"][:2]
  assert first.worker != second.worker and "main" not in (first.worker, second.worker)
  assert first.start < second.end and second.start < first.end


def test_sequential_variants_do_all_their_work_on_the_main_thread():
  for name in ("naive", "sequential_interleave", "sequential_map", "naive_chain"):
    _, events = fastest(name, repeats=1)
    assert {e.worker for e in events} == {"main"}, name


def test_cache_reads_and_maps_only_in_the_first_epoch():
  _, events = fastest("cache", repeats=1)
  stages = collections.Counter(e.stage for e in events)
  assert stages == {"open": 1, "read": P.records, "map": P.records,
                    "train": P.records * P.cache_epochs}


def test_vectorized_map_is_faster_than_scalar_map():
  scalar, scalar_events = fastest("scalar_map", repeats=3)
  vectorized, vectorized_events = fastest("vectorized_map", repeats=3)
  assert vectorized < scalar
  # The picture run maps once per element, or once per batch.
  maps = lambda events: sum(e.stage == "map" for e in events)
  assert maps(scalar_events) == P.picture_elements
  assert maps(vectorized_events) == -(-P.picture_elements // P.fast_batch)


def test_recorder_keeps_every_event_from_many_threads_one_row_per_live_thread():
  recorder = timeline.Recorder()
  together = threading.Barrier(8)

  def work(i):
    together.wait()  # All eight record at once, and are alive at once.
    for j in range(500):
      with recorder.span("read", (i, j)):
        pass
    together.wait()

  threads = [threading.Thread(target=work, args=(i,), name="worker") for i in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  events = recorder.events()
  assert len(events) == 8 * 500
  assert {e.element for e in events} == {(i, j) for i in range(8) for j in range(500)}
  rows = collections.defaultdict(set)
  for e in events:
    rows[e.worker].add(e.element[0])
  assert sorted(rows) == [f"worker {k}" for k in range(1, 9)]
  assert all(len(threads_in_row) == 1 for threads_in_row in rows.values())
  assert all(e.start <= e.end for e in events)


def test_draw_writes_png_and_svg(tmp_path):
  _, events = fastest("parallel_map", repeats=1)
  png, svg = tmp_path / "t.png", tmp_path / "t.svg"
  timeline.draw(events, png, svg, "Parallel map")
  assert png.read_bytes().startswith(b"\x89PNG") and png.stat().st_size > 5000
  text = svg.read_text()
  assert "<svg" in text and "Parallel map" in text and "grain-thread-prefetch" in text
  with pytest.raises(ValueError, match="no events"):
    timeline.draw([], png, svg, "empty")


def test_cli_writes_results_table_and_timelines(tmp_path, capsys):
  study.main(["--out", str(tmp_path), "--scale", "0.2", "--repeats", "1",
              "--variants", "naive,parallel_interleave"])
  results = (tmp_path / "RESULTS.md").read_text()
  assert "| naive |" in results and "| parallel_interleave |" in results
  assert "--scale 0.2" in results
  for name in ("naive", "parallel_interleave"):
    assert (tmp_path / f"{name}.png").stat().st_size > 0
    assert (tmp_path / f"{name}.svg").stat().st_size > 0
  assert "| naive |" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    study.main(["--out", str(tmp_path), "--variants", "naive,warp_drive"])


def test_help_runs_as_a_module():
  out = subprocess.run([sys.executable, "-m", "pipeline.bench", "study", "--help"], cwd=ROOT,
                       capture_output=True, text=True, check=True, timeout=120).stdout
  assert "--out" in out and "--repeats" in out
