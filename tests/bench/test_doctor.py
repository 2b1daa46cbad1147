"""The pipeline doctor names the bottleneck and recommends the fix.

The reasoning is specified on given measurements (stage costs and a run, as the doctor
measures them), so no test here depends on this machine's speed. The command line runs
the real pipeline on real shards; the slow tests inject slowness into it for real.
"""

import json
import math
import pathlib
import subprocess
import sys
import textwrap

import pytest
from array_record.python.array_record_module import ArrayRecordReader

import pipeline.catalog.manifest
from bench import doctor, storage_check
from bench.doctor import Measurements, Settings
from pipeline import explain
from pipeline.explain import Cost, Requests, Run
from pipeline.order import blocks

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECORD_KB = 110.0  # a stored photo


def stage_costs(
  read=(0.02, 0.02), parse=0.02, decode=(1.0, 1.0), augment=0.2, decode_dct=None
) -> dict[str, Cost]:
  """Milliseconds per image, (wall, cpu) where a stage waits off-CPU."""
  costs = {
    "read": Cost(*read),
    "parse": Cost(parse, parse),
    "decode": Cost(*decode),
    "augment": Cost(augment, augment),
  }
  if decode_dct is not None:
    costs["decode_dct"] = Cost(decode_dct, decode_dct)
  return {**costs, "cache_fill": Cost(3.0, 3.0), "augment_cached": Cost(0.3, 0.3)}


def measured(
  costs: dict[str, Cost], rate=500.0, other_ms=0.1, cores=2, consumer=None
) -> Measurements:
  """Measurements of a run whose storage requests, one a record, take the read's wall time."""
  cpu = sum(costs[s].cpu_ms for s in explain.STAGES) + other_ms
  latency = costs["read"].wall_ms
  q = Requests(2000, rate, RECORD_KB, 1.0, "global", None, None, latency, latency)
  return Measurements(
    cores=cores,
    load_average=0.5,
    num_records=100_000,
    num_shards=64,
    costs=costs,
    cache_bytes_per_image=1e6,
    dct_share=0.4,
    run=Run(rate, 0.5, 2000, 4.0, cpu, requests=q),
    consumer_run=consumer,
  )


def settings(batch_size=16, decoding=None, **performance) -> Settings:
  return Settings(
    "data/photos",
    batch_size=batch_size,
    image_size=224,
    performance={"num_threads": 2, **performance},
    decoding=decoding or {},
  )


def proposal(d: doctor.Diagnosis, field: str):
  return next((r for r in d.recommendations if r.field == field), None)


SLOW = stage_costs(read=(50.0, 0.05))  # storage with 50 ms of latency per request


def test_slow_reads_with_a_small_read_ahead_are_named_and_more_read_ahead_recommended():
  # 2 MB holds one batch of 16 records of 110 KB: 16 in flight at 50 ms, 320 img/s
  d = doctor.diagnose(settings(read_ahead_mb=2.0), measured(SLOW, rate=300))
  assert d.bottleneck == "read" and d.limits["reads"] == 320.0, doctor.report(d)
  assert "16 records in flight (read_ahead_mb=2)" in d.limit and "50.0 ms" in d.limit
  more = proposal(d, "read_ahead_mb")
  assert more.current == 2.0 and more.proposed > 2.0 and more.gain > 1.05, doctor.report(d)
  assert more.writes == {"performance.read_ahead_mb": more.proposed}
  assert more.expected_images_per_sec > 300  # scaled from the measured rate
  assert proposal(d, "prefetch") is None  # the batches being decoded are not the reads
  assert any("reading is slow" in n for n in d.notes)


def test_slow_reads_with_the_default_read_ahead_are_not_the_bottleneck():
  # 256 MB holds 148 batches: 512 requests in flight (the I/O threads) at 50 ms
  d = doctor.diagnose(settings(), measured(SLOW, rate=1500))
  assert d.bottleneck != "read" and d.limits["reads"] == 512 / 0.05, doctor.report(d)
  assert not {"read_ahead_mb", "prefetch"} & {r.field for r in d.recommendations}


def test_reads_past_the_io_threads_name_more_images_a_request():
  # 512 requests of one image in flight at 500 ms: 1,024 img/s whatever the read-ahead
  d = doctor.diagnose(settings(), measured(stage_costs(read=(500.0, 0.05)), rate=1000))
  assert d.bottleneck == "read" and d.limits["reads"] == 1024.0, doctor.report(d)
  assert proposal(d, "read_ahead_mb") is None
  assert any("512 I/O threads" in n and "order='blocks'" in n for n in d.notes), d.notes


def test_a_read_ahead_in_batches_that_caps_the_reads_is_lifted():
  d = doctor.diagnose(settings(read_ahead=1), measured(SLOW, rate=300))
  assert d.bottleneck == "read" and "read_ahead=1" in d.limit, doctor.report(d)
  lifted = proposal(d, "read_ahead")
  assert (lifted.current, lifted.proposed) == (1, None), doctor.report(d)
  assert lifted.writes == {"performance.read_ahead": None}
  assert proposal(d, "read_ahead_mb") is None  # 256 MB hold enough


def test_small_batches_on_many_threads_need_more_batches_being_decoded():
  # a batch of 4 is 4 decode tasks: prefetch=2 gives 8 of 16 threads work
  costs = stage_costs(decode=(4.0, 4.0))
  d = doctor.diagnose(settings(4, num_threads=16, prefetch=2), measured(costs, cores=16))
  assert d.limit.startswith("prefetch=2 batches being decoded"), doctor.report(d)
  more = proposal(d, "prefetch")
  assert more.proposed == 4 and more.writes == {"performance.prefetch": 4}, doctor.report(d)


def test_decode_heavy_work_on_one_thread_gets_a_thread_per_core():
  d = doctor.diagnose(settings(num_threads=1), measured(stage_costs(), rate=700))
  assert d.bottleneck == "decode" and "num_threads=1" in d.limit, doctor.report(d)
  rec = proposal(d, "num_workers x num_threads")
  assert (rec.current, rec.proposed) == ("0 x 1", "0 x 2") and rec.gain > 1.5
  assert rec.writes == {"performance.num_workers": 0, "performance.num_threads": 2}


def test_work_that_waits_gets_more_threads_than_cores():
  costs = stage_costs(decode=(15.0, 1.0))  # e.g. a remote decoder: mostly waiting
  d = doctor.diagnose(settings(), measured(costs, rate=120))
  rec = proposal(d, "num_workers x num_threads")
  workers, threads = map(int, rec.proposed.split(" x "))
  assert workers == 0 and threads > d.cores, doctor.report(d)
  assert "threads beyond the 2 cores" in rec.why


def test_on_a_many_core_host_one_process_is_gil_bound_and_workers_are_recommended():
  costs = stage_costs(read=(0.1, 0.1), parse=0.05)
  d = doctor.diagnose(
    settings(128, num_workers=0, num_threads=None), measured(costs, other_ms=0.2), cores=224
  )
  assert not d.here and d.cores == 224
  assert "the GIL" in d.limit and d.bottleneck in ("read", "other"), doctor.report(d)
  rec = proposal(d, "num_workers x num_threads")
  workers, threads = map(int, rec.proposed.split(" x "))
  assert workers > 1 and workers * threads <= 224 and rec.gain > 3
  assert rec.expected_images_per_sec == pytest.approx(d.predicted * rec.gain, rel=0.01)
  assert "projected" in doctor.report(d)
  assert "\nbottleneck on a projected host of 224 cores: " in doctor.report(d)


def test_the_main_process_receiving_batches_can_bind_and_is_named():
  """Many workers of cheap images on a large host: the main process's receiving is the
  lowest limit (it was a StopIteration in `binding`, issue 37 row 13)."""
  cheap = stage_costs(read=(0.01, 0.01), parse=0.01, decode=(0.05, 0.05), augment=0.01)
  d = doctor.diagnose(
    settings(128, num_workers=8, num_threads=2),
    measured(cheap, rate=5000, other_ms=0.01),
    cores=224,
  )
  assert min(d.limits, key=d.limits.get) == "main", d.limits
  assert d.limit.startswith("the main process receiving every worker's batches"), d.limit
  assert d.input_stage == "transfer"


def test_auto_settings_are_named_and_not_re_proposed():
  d = doctor.diagnose(settings(num_threads=None), measured(stage_costs(), rate=1500))
  assert proposal(d, "num_workers x num_threads") is None, doctor.report(d)
  assert any("make_dataset chooses no worker processes, 2 decode threads" in n for n in d.notes)


def test_a_fast_input_beside_a_slow_step_names_the_step():
  consumer = Run(160.0, 0.5, 320, 2.0, 1.3, wait_share=0.01)
  d = doctor.diagnose(
    settings(), measured(stage_costs(), rate=1500, consumer=consumer), step_ms=100
  )
  assert d.bottleneck == "train step" and not d.recommendations, doctor.report(d)
  assert "not input-bound" in doctor.report(d)


def test_dct_scaling_off_is_priced_and_turning_it_on_recommended():
  costs = stage_costs(decode=(2.0, 2.0), decode_dct=1.0)
  d = doctor.diagnose(settings(decoding={"dct_scaling": False}), measured(costs, rate=600))
  rec = d.recommendations[0]
  assert (rec.field, rec.proposed, rec.writes) == (
    "dct_scaling",
    True,
    {"decoding.dct_scaling": True},
  )


def config_package(tmp_path, name, data_dir) -> pathlib.Path:
  """A package `name` holding a recipe with an `input` block (as configs/default.py)."""
  package = tmp_path / name
  package.mkdir()
  (package / "__init__.py").write_text("")
  (package / "base.py").write_text(
    textwrap.dedent(f"""\
      import ml_collections

      def get_config():
        c = ml_collections.ConfigDict()
        c.input = ml_collections.ConfigDict(dict(
            data_dir={str(data_dir)!r}, split="train", image_size=32,
            augment=dict(area_range=(0.5, 1.0), flip=False),
            decoding=dict(cache_mb=0.0),
            performance=dict(num_threads=None, num_workers=None, prefetch=2)))
        c.batch_size = 16
        c.seed = 0
        c.model = "mobilenet_v1"
        return c
      """)
  )
  return package / "base.py"


def test_apply_writes_the_recommendations_into_the_input_block(tmp_path):
  base = config_package(tmp_path, "recipes_apply", "data/digits")
  s = doctor.settings_from_config(doctor.load_config(str(base)))
  assert (s.data_dir, s.image_size, s.batch_size, s.augment["flip"]) == (
    "data/digits",
    32,
    16,
    False,
  )
  s.data_dir, s.performance["read_ahead_mb"] = "/elsewhere", 2.0
  d = doctor.diagnose(s, measured(SLOW, rate=180))
  tuned = base.parent / "tuned.py"
  doctor.write_config(str(tuned), d, "recipes_apply.base", doctor.load_config(str(base)), "")
  assert "from recipes_apply import base as base" in tuned.read_text()
  config = doctor.load_config(str(tuned))
  assert config.input.data_dir == "/elsewhere"
  assert config.input.performance.read_ahead_mb == proposal(d, "read_ahead_mb").proposed
  assert config.input.augment.area_range == (0.5, 1.0) and config.model == "mobilenet_v1"


def test_cli_measures_projects_for_another_host_and_applies(digits_dir, tmp_path):
  base = config_package(tmp_path, "recipes_cli", digits_dir)
  tuned, picture, out = base.parent / "tuned.py", tmp_path / "timeline.png", tmp_path / "d.json"
  d = doctor.main(
    [
      "--config",
      str(base),
      "--cores",
      "224",
      "--seconds",
      "0.3",
      "--sample",
      "16",
      "--apply",
      str(tuned),
      "--timeline",
      str(picture),
      "--json",
      str(out),
    ]
  )
  assert d.cores == 224 and not d.here
  assert set(d.costs) >= {"read", "parse", "decode", "augment", "other"}
  assert all(c.wall_ms >= 0 and c.cpu_ms >= 0 for c in d.costs.values())
  assert d.predicted == min(d.limits.values())
  config = doctor.load_config(str(tuned))
  for rec in d.recommendations:
    for key, value in rec.writes.items():
      group, field = key.split(".")
      assert config.input[group][field] == value
  assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  saved = json.loads(out.read_text())
  assert saved["cores"] == 224 and saved["bottleneck"] == d.bottleneck
  levels = saved["storage"]["check"]["levels"]
  assert [x["concurrency"] for x in levels] == [1, 16, 128]
  assert all({"median_ms", "mb_per_s"} <= x.keys() for x in levels)
  assert saved["storage"]["advice"]["host_cores"] == 224


def test_cli_files_go_to_a_folder_under_runs_never_the_current_one(
  digits_dir, tmp_path, monkeypatch, capsys
):
  monkeypatch.chdir(tmp_path)
  quick = [str(digits_dir), "--seconds", "0.3", "--sample", "16", "--storage-levels", ""]
  d = doctor.main(quick)
  printed = capsys.readouterr().out
  assert d.here and f"\nbottleneck on this host ({d.cores} cores): " in printed
  (run,) = (tmp_path / "runs" / "doctor").iterdir()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
  assert sorted(p.name for p in run.iterdir()) == ["diagnosis.json", "timeline.png"]
  assert f"timeline: {run.relative_to(tmp_path)}/timeline.png" in printed
  assert json.loads((run / "diagnosis.json").read_text())["bottleneck"] == d.bottleneck
  doctor.main([*quick, "--out", "mine/today"])
  assert (tmp_path / "mine" / "today" / "timeline.png").read_bytes()[:4] == b"\x89PNG"
  assert (tmp_path / "mine" / "today" / "diagnosis.json").exists()


def test_the_runs_recipe_and_its_config_overrides_are_what_is_diagnosed(digits_dir):
  def settings(*argv):
    args, overrides = doctor.parser().parse_known_args([str(a) for a in argv])
    return doctor._settings(args, overrides)

  s, module, base = settings(
    "--config",
    "default",  # by name, as the trainer takes it
    f"--config.input.data_dir={digits_dir}",
    "--config.input.image_size=48",
    "--config.batch_size=16",
    "--config.input.augment.flip=True",
  )
  assert (s.data_dir, s.image_size, s.batch_size, s.augment["flip"]) == (
    str(digits_dir),
    48,
    16,
    True,
  )
  assert s.recipe == str(ROOT / "configs" / "default.py") and module == "configs.default"
  assert base.input.image_size == 32 and base.batch_size == 128  # the recipe --apply imports
  s, _, _ = settings(f"--config.input.data_dir={digits_dir}")  # alone: the default recipe
  assert (s.image_size, s.batch_size, s.recipe) == (32, 128, str(ROOT / "configs/default.py"))
  s, _, _ = settings(digits_dir)  # a dataset alone: the doctor's defaults, said so
  assert (s.image_size, s.batch_size, s.recipe) == (224, 128, None)


@pytest.mark.parametrize(
  "argv, message",
  [
    ([], "give DATA_DIR or --config"),
    (["{missing}"], "manifest.json not found"),
    (["{photos}", "--split", "nope"], "has no split 'nope'"),
    (["{photos}", "--cores", "0"], "--cores must be positive"),
    (["{photos}", "--num-threads", "0"], "performance.num_threads must be"),
    (["--config", "{missing}/x.py"], "no config file"),
    (["--config", "{flat}"], "has no `input` block"),
    (["{photos}", "--apply", "x.py"], "--apply needs a --config inside a package"),
    (
      ["--config", "{root}/configs/default.py", "--apply", "{root}/configs/../configs/default.py"],
      "configs/../configs/default.py is the recipe itself: name a new file",
    ),
    (["{photos}", "--storage-levels", "1,x"], "--storage-levels takes integers"),
    (["{photos}", "--get-price", "-1"], "--get-price >= 0"),
    (["--config", "nosuch"], "no config file nosuch"),
    (["--config.input.nope=1"], "unknown config field input.nope"),
    (["--config.batch_size=big"], "--config.batch_size=big: "),
    (["{photos}", "--frobnicate"], "unrecognized arguments: --frobnicate"),
  ],
)
def test_user_errors_are_one_line_with_exit_2(argv, message, photos_dir, tmp_path, capsys):
  flat = tmp_path / "flat.py"
  flat.write_text(
    "import ml_collections\n\ndef get_config():\n"
    "  return ml_collections.ConfigDict(dict(data_dir='x'))\n"
  )
  paths = {"missing": tmp_path / "missing", "photos": photos_dir, "flat": flat, "root": ROOT}
  with pytest.raises(SystemExit) as exit_:
    doctor.main([a.format(**paths) for a in argv])
  err = capsys.readouterr().err.strip()
  assert exit_.value.code == 2 and message in err
  assert len(err.splitlines()) == 1, err


def test_cli_help():
  help_ = subprocess.run(
    [sys.executable, "-m", "bench.doctor", "--help"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=True,
  )
  assert "--apply" in help_.stdout and "--cores" in help_.stdout
  assert "bottleneck" in help_.stdout


@pytest.mark.slow
def test_slow_storage_behind_a_small_read_ahead_is_named_read_in_a_real_run(
  storage_rig, photos_dir
):
  perf = {"num_threads": 2, "read_ahead_mb": 0.1, "record_cache_mb": 0}  # one batch ahead
  with storage_rig.mount(photos_dir, latency_ms=50) as rig:
    s = Settings(str(rig.path), batch_size=8, image_size=64, performance=perf)
    d = doctor.diagnose(s, doctor.measure_all(s, seconds=1.0, sample=24))
  assert d.bottleneck == "read" and "8 records in flight" in d.limit, doctor.report(d)
  assert proposal(d, "read_ahead_mb").proposed > 0.1, doctor.report(d)
  assert proposal(d, "prefetch") is None


@pytest.mark.slow
@pytest.mark.skipif(doctor.parallelism.available_cores() < 2, reason="needs two cores")
def test_one_thread_on_decode_heavy_photos_is_named_decode_in_a_real_run(photos_dir):
  s = Settings(
    str(photos_dir), batch_size=8, image_size=224, performance={"num_threads": 1, "num_workers": 0}
  )
  d = doctor.diagnose(s, doctor.measure_all(s, seconds=1.0, sample=24))
  assert d.bottleneck == "decode", doctor.report(d)
  assert proposal(d, "num_workers x num_threads").proposed == "0 x 2"


def test_storage_check_times_reads_through_the_rig_and_applies_littles_law(storage_rig, photos_dir):
  with storage_rig.mount(photos_dir, latency_ms=10) as rig:
    check = storage_check.measure(rig.path, "train", levels=(1, 8), reads_per_level=24)
    stats = rig.reset()
    shard = pipeline.catalog.manifest.load(rig.path).shard_paths(rig.path, "train")[0]
    ArrayRecordReader(str(shard), "readahead_buffer_size:0").close()
    open_reads = rig.stats()["reads"]  # what opening a reader reads (footer and index)
  one, eight = check.levels
  assert one.reads == eight.reads == 24 and check.records == 48
  assert stats["max_in_flight"] >= 2  # 8 threads' reads waited together (the rig's count)
  # Every read reached storage: each record read once, plus each shard's open.
  assert check.shards == 1 and stats["reads"] == 48 + open_reads
  advice = storage_check.advise(check, 1000, 224, 40_000, price_per_1000=0.0004, processes=2)
  assert advice.host_needs_in_flight == math.ceil(40_000 * check.latency_s)
  assert advice.keep_in_flight >= math.ceil(1000 * check.latency_s)
  assert advice.gets_per_epoch == 48 + storage_check.READS_PER_OPEN * check.shards * 2
  assert advice.cost_per_epoch == pytest.approx(advice.gets_per_epoch * 0.0004 / 1000)
  text = storage_check.report(check, advice)
  assert "Little's law" in text and "40,000 GET/s" in text and "$0.0004 per 1,000" in text
  assert (
    f"({48:,} records, {advice.gets_per_epoch - 48} for opening shards: 2 per shard and " in text
  )
  k = blocks.block_records(check.record_kb * 1e3)  # the pipeline's, for these records
  assert f"{k} records a request) about 1/{k}" in text and "request budget" not in text
  assert f"~{40_000 / k:,.0f} GET/s for the host" in text


def test_storage_check_names_the_request_budget_when_requests_queue(storage_rig, photos_dir):
  with storage_rig.mount(photos_dir, latency_ms=1, requests_per_s=100) as rig:
    check = storage_check.measure(rig.path, "train", levels=(1, 16), reads_per_level=48)
    capped = rig.stats()["capped"]
  budget = check.request_budget_per_s(cores=64)
  # 48 reads need 47 turns of 10 ms: never faster than the cap
  assert capped > 0 and budget is not None and budget <= 100 * 48 / 47
  text = storage_check.report(check)
  assert "The request budget binds" in text and "performance.max_requests_per_s=" in text
