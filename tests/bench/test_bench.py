"""Benchmarks at tiny sizes: each runs end to end and reports well-formed, sane figures;
the tools stay beside the library, and the committed report's pictures exist once.

No speed is asserted here (the machines are shared); `make bench` measures.
"""

import importlib.util
import json
import os
import pathlib
import re

import grain
import pytest

from bench import all as bench_all
from bench import ceiling, gets, host, measure, peers, storage, throughput
from pipeline.catalog import manifest, records
from pipeline.convert import tfrecord

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_ceiling_decodes_every_image_whole_and_scaled(photos_dir, tmp_path):
  out = tmp_path / "ceiling.json"
  result = ceiling.main(
    [str(photos_dir), "--images", "8", "--repeats", "1", "--threads", "2", "--json", str(out)]
  )
  assert result["images"] == 8 and result["mean_megapixels"] > 0.1
  combos = {(r["decoder"], r["scale"], r["threads"]) for r in result["rows"]}
  assert combos == {(d, s, t) for d in ceiling.decoders() for s in ("1/1", "1/2") for t in (1, 2)}
  assert all(r["images_per_sec"] > 0 and r["megapixels_per_sec"] > 0 for r in result["rows"])
  assert set(result["ceiling_images_per_sec"]) == {"1/1", "1/2"}
  saved = json.loads(out.read_text())
  assert saved["command"].startswith("python -m bench ceiling") and saved["machine"]


def test_storage_can_reshard_in_class_order_as_an_image_folder_converts(photos_dir, tmp_path):
  out = storage.prepare(str(photos_dir), "train", 0.2, str(tmp_path), class_order=True)
  meta = manifest.load(out)
  paths = [os.fspath(p) for p in meta.shard_paths(out, "train")]
  labels = [records.parse(r, meta.keys)[1] for r in peers.records(paths)]
  assert labels == sorted(labels) and len(set(labels)) > 1 and len(paths) > 1


@pytest.mark.slow
def test_storage_reshards_once_and_reads_through_the_rig_and_locally(
  storage_rig, photos_dir, tmp_path
):
  work = tmp_path / "work"
  argv = [str(photos_dir), "--latency-ms", "2", "--rounds", "1", "--batches", "3"]
  argv += ["--batch-size", "8", "--shard-size-mb", "0.2", "--loaders", "pipeline"]
  argv += ["--requests-per-s", "2000", "--max-requests-per-s", "1000"]
  result = storage.main([*argv, "--work-dir", str(work), "--json", str(tmp_path / "s.json")])
  data = result["dataset"]
  assert data["records"] == 48 and data["shards"] > 1  # the 1-shard split, re-sharded
  assert data["tfrecord_files"] == data["shards"]
  # The TFRecord twin holds the same records, shard by shard.
  meta = manifest.load(data["dir"])
  for path in meta.shard_paths(data["dir"], "train"):
    twin = pathlib.Path(
      data["dir"], "peers-tfrecord", path.name.replace("array_record", "tfrecord")
    )
    with open(twin, "rb") as f:
      got = [
        tfrecord.read_record(f, str(twin), i, *span) for i, span in enumerate(tfrecord.scan(twin))
      ]
    source = grain.sources.ArrayRecordDataSource([os.fspath(path)])
    assert got == source.__getitems__(list(range(len(source))))
  local, slow = result["rows"]
  assert (local["storage"], slow["storage"]) == ("local disk", "2 ms")
  assert local["rounds"] == slow["rounds"] == 1 and "reads_per_image" not in local
  assert slow["images_per_sec_min"] <= slow["images_per_sec"] <= slow["images_per_sec_max"]
  # Reads ahead (and a record cache) may leave the timed batches nothing to read.
  assert slow["first_batch_reads"] > 0 and slow["max_in_flight"] >= 1
  assert slow["reads_per_image"] >= 0 and slow["kb_per_read"] >= 0
  saved = json.loads((tmp_path / "s.json").read_text())
  assert saved["command"].startswith("python -m bench storage") and len(saved["runs"]) == 2
  assert saved["requests_per_s"] == 2000 and saved["runs"][1]["rig"]["timed"]["requests_per_s"]
  assert saved["max_requests_per_s"] == 1000
  stamp = (pathlib.Path(data["dir"]) / "manifest.json").stat().st_mtime_ns
  assert storage.prepare(str(photos_dir), "train", 0.2, str(work)) == pathlib.Path(data["dir"])
  assert (pathlib.Path(data["dir"]) / "manifest.json").stat().st_mtime_ns == stamp  # reused


def test_host_runs_both_orders_locally_and_through_the_rig_beside_the_model(
  storage_rig, photos_dir, tmp_path
):
  argv = [str(photos_dir), "--batch-size", "8", "--image-size", "64", "--batches", "3"]
  argv += [
    "--latency-ms",
    "2",
    "--requests-per-s",
    "2000",
    "--pss",
    "--json",
    str(tmp_path / "h.json"),
  ]
  out = host.main(argv)
  where = [(row["storage"].split()[0], row["order"]) for row in out["rows"]]
  assert where == [(s, o) for s in ("local", "rig") for o in ("blocks", "global")]
  for row in out["rows"]:
    assert row["images_per_sec"] > 0 and row["planned_memory_mb"] > 0
    assert row["loader_pss_mb"] < row["peak_rss_mb"]  # the loader above its imports, not the tree
    assert row["model"]["projected_img_s"] > 0 and row["model"]["threads"] >= 1
  saved = json.loads((tmp_path / "h.json").read_text())
  assert saved["command"].startswith("python -m bench host") and saved["cores"] >= 1


def test_page_cache_share_follows_reads_and_eviction(tmp_path):
  """`measure.cached_share` (the report's header): the pages of a file just read, then none
  once dropped (where the filesystem drops them: not tmpfs or an overlay's upper layer)."""
  path = tmp_path / "blob"
  path.write_bytes(os.urandom(1 << 20))
  path.read_bytes()
  assert measure.cached_share([str(path)]) == 1.0
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fdatasync(fd)  # dirty pages cannot be dropped: written back first
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)
  if filesystem(path) not in ("tmpfs", "ramfs", "overlay"):
    assert measure.cached_share([str(path)]) < 0.5


def filesystem(path: pathlib.Path) -> str:
  """The type of the filesystem holding `path`: its longest mount point in /proc/mounts."""
  real = os.path.realpath(path)
  mounts = [line.split()[1:3] for line in pathlib.Path("/proc/mounts").read_text().splitlines()]
  under = [m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")]
  return max(under, key=lambda m: len(m[0]))[1]


def test_throughput_reports_rate_and_stage_breakdown(photos_dir, tmp_path):
  out = throughput.main(
    [
      str(photos_dir),
      "--epochs",
      "0.5",
      "--batch-size",
      "8",
      "--image-size",
      "64",
      "--pss",
      "--json",
      str(tmp_path / "t.json"),
    ]
  )
  assert {"images_per_sec", "first_batch_s", "peak_rss_mb"} <= out.keys()
  memory = out["memory"]  # planned (pipeline.host.memory) and measured (peak PSS of the tree)
  # PSS shares a library's pages among every process mapping it: others' runs move it by a few MB
  assert 0 < memory["planned_mb"] <= memory["budget_mb"] and isinstance(memory["measured_mb"], int)
  assert memory["plan"].startswith(f"memory: {memory['planned_mb']:,} of")
  assert memory["measured_mb"] == out["loader_pss_mb"] <= out["peak_pss_mb"]
  assert out["images"] >= 24
  phases = out["first_batch_phases_s"]  # where the first batch's time went, in order
  assert list(phases) == ["open", "probe", "plan", "chain", "first reads", "decode", "hand-off"]
  assert all(v >= 0 for v in phases.values()) and phases["decode"] > 0
  assert sum(phases.values()) <= out["first_batch_s"] + 1e-3
  assert out["first_batch_cpu_s"] > 0  # this process's CPU to the first batch, all its threads
  stages = out["stages_ms_per_image"]
  assert {"read", "parse", "decode", "resize_flip", "batch"} <= stages.keys()
  assert all(v >= 0 for v in stages.values()) and stages["decode"] > 0
  limit = out["crop_ceiling"]  # the cores' raw decode of the same crop windows, this run
  assert limit["images_per_sec"] > 0 and limit["threads"] >= 1
  assert limit["pipeline_share"] == round(out["images_per_sec"] / limit["images_per_sec"], 3)
  # and of its decode stage alone on the same records in memory (no reading, no hand-off)
  stage = out["images_per_sec"] / limit["decode_stage_images_per_sec"]
  assert limit["pipeline_share_of_decode_stage"] == round(stage, 3)
  by_cpu = limit["decode_stage_cpu_us_per_image"] / out["cpu_us_per_image"]  # the same, by CPU
  assert limit["pipeline_share_of_decode_stage_by_cpu"] == round(by_cpu, 3) and by_cpu > 0
  by_thread = out["cpu_by_thread"]  # this process's CPU per image, by thread group
  assert "pipeline-decode" in by_thread and sum(g["share"] for g in by_thread.values()) <= 1.001
  if importlib.util.find_spec("tensorflow") is None:
    assert "tensorflow not installed" in out["tfdata"]["skipped"]
  else:
    assert out["tfdata"]["ours_x_peak_rss"] > 0 and out["tfdata"]["ours_x_peak_pss"] > 0
    assert out["tfdata"]["ours_x_first_batch_cpu"] > 0


def test_peers_runs_each_contender_in_its_own_process(photos_dir, tmp_path):
  out = tmp_path / "p.json"
  results = peers.main(
    [
      str(photos_dir),
      "--loaders",
      "pipeline",
      "--epochs",
      "0.5",
      "--batch-size",
      "8",
      "--image-size",
      "64",
      "--json",
      str(out),
    ]
  )
  assert [r["name"] for r in results] == ["pipeline"]
  assert results[0]["images_per_sec"] > 0
  assert results[0]["command"].startswith("python -m bench throughput")  # a child
  assert json.loads(out.read_text())["results"] == results


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="peers extra")
def test_peers_tfdata_reads_the_same_records(photos_dir):
  results = peers.main(
    [
      str(photos_dir),
      "--loaders",
      "tfdata",
      "--epochs",
      "0.5",
      "--batch-size",
      "8",
      "--image-size",
      "64",
    ]
  )
  assert results and results[0]["name"] == "tfdata" and results[0]["images_per_sec"] > 0


def test_device_bench_prints_its_figures(run_python):
  proc = run_python(
    "-m",
    "bench",
    "device",
    "--source",
    "premade",
    "--batches",
    "2",
    "--rounds",
    "1",
    "--batch",
    "4",
  )
  assert proc.returncode == 0, proc.stderr
  figures = json.loads(proc.stdout.strip().splitlines()[-1])
  rate = {name: figures[name]["images_per_s"] for name in ("host", "device")}
  assert figures["ratio"] == pytest.approx(rate["device"] / rate["host"])


def check_report(report: str, names: list[str]) -> None:
  """A section per benchmark, each with the machine and the command beside its figures."""
  steps = [s for s in bench_all.STEPS if s.name in names]
  summary, *sections = report.split("\n## ")[1:]
  assert summary.startswith("Summary\n\n- ")  # the headline figures come first
  assert [s.split("\n")[0] for s in sections] == [s.title for s in steps]
  for section in sections:
    assert "*Machine: " in section and "Command: `python -m " in section, section
  assert "Not reported" not in report


def pictures(markdown: pathlib.Path) -> list[pathlib.Path]:
  """The files a Markdown page shows, resolved from its folder."""
  links = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", markdown.read_text())
  return [(markdown.parent / link).resolve() for link in links]


@pytest.mark.slow
def test_all_writes_a_report_with_machine_and_command_beside_every_figure(photos_dir, tmp_path):
  out = tmp_path / "bench"
  names = ["ceiling", "throughput", "doctor"]
  report = bench_all.main(
    [str(photos_dir), "--out", str(out), "--quick", "--only", ",".join(names)]
  ).read_text()
  check_report(report, names)
  assert "of the cores' raw full-decode rate" in report  # throughput quoted against ceiling
  assert "- Doctor: bottleneck " in report
  assert "Bottleneck: **" in report
  assert (out / "doctor_timeline.png").read_bytes()[:4] == b"\x89PNG"
  assert pictures(out / "REPORT.md") == [(out / "doctor_timeline.png").resolve()]


@pytest.mark.slow
def test_all_runs_every_benchmark(photos_dir, tmp_path):
  out = tmp_path / "bench"
  report = bench_all.main([str(photos_dir), "--out", str(out), "--quick"]).read_text()
  check_report(report, [s.name for s in bench_all.STEPS])
  shown = pictures(out / "REPORT.md")
  for picture in ("throughput.png", "doctor_timeline.png"):
    assert (out / picture).read_bytes()[:4] == b"\x89PNG" and (out / picture).resolve() in shown


def test_all_reports_a_failing_benchmark_and_goes_on(tmp_path):
  out = tmp_path / "bench"
  report = bench_all.main(
    [str(tmp_path / "missing"), "--out", str(out), "--only", "ceiling"]
  ).read_text()
  assert "Not reported: ceiling failed (exit 2): " in report
  assert "manifest.json not found" in report.split("Not reported: ")[1].split("\n")[0]
  assert "manifest.json not found" in (out / "ceiling.log").read_text()


def test_refresh_is_refused_for_a_partial_or_quick_run_and_writes_nothing(photos_dir, tmp_path):
  report = ROOT / "bench" / "REPORT.md"
  before = report.read_bytes()
  for extra in (["--quick"], ["--only", "ceiling"]):
    with pytest.raises(SystemExit) as exit_:
      bench_all.main([str(photos_dir), "--out", str(tmp_path / "out"), "--refresh", *extra])
    assert exit_.value.code == 2
  assert report.read_bytes() == before and not (tmp_path / "out").exists()


def test_refresh_writes_the_committed_report_with_links_into_docs():
  out = bench_all.Outputs.at(pathlib.Path("runs/bench"), refresh=True)
  assert out.report.resolve() == ROOT / "bench" / "REPORT.md"
  assert out.pictures.resolve() == ROOT / "docs" / "bench"
  assert out.link(out.pictures / "throughput.png") == "../docs/bench/throughput.png"
  plain = bench_all.Outputs.at(pathlib.Path("runs/bench"), refresh=False)
  assert plain.report == pathlib.Path("runs/bench/REPORT.md")
  assert plain.link(plain.pictures / "throughput.png") == "throughput.png"


def test_committed_pictures_are_pngs_under_docs_and_every_shown_one_exists():
  pages = [ROOT / "README.md", ROOT / "bench" / "REPORT.md", *(ROOT / "docs").rglob("*.md")]
  shown = [p for page in pages for p in pictures(page)]
  assert shown and all(p.is_file() for p in shown), [p for p in shown if not p.is_file()]
  generated = {".git", ".venv", ".venv-beam", "data", "runs", "build"}  # not in the repository
  kept = [
    p
    for top in ROOT.iterdir()
    if top.name not in generated
    for p in ([top] if top.is_file() else top.rglob("*"))
    if p.suffix.lower() in (".png", ".svg", ".jpg", ".jpeg", ".gif")
  ]
  inputs = ROOT / "tests" / "reference"  # test inputs (JPEGs the decoder reads), not pictures
  pictures_kept = [p for p in kept if not p.is_relative_to(inputs)]
  assert pictures_kept and all(
    p.suffix == ".png" and p.is_relative_to(ROOT / "docs") for p in pictures_kept
  ), pictures_kept


@pytest.mark.slow
def test_a_failing_tool_prints_one_line_and_the_traceback_only_when_asked(run_python, tmp_path):
  missing = str(tmp_path / "missing")
  proc = run_python("-m", "bench.ceiling", missing)  # bad input: exit 2, as a usage error
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
  assert proc.stderr.startswith(f"error: {missing}/manifest.json not found"), proc.stderr
  verbose = run_python("-m", "bench.ceiling", missing, "--verbose")
  assert verbose.returncode == 1 and "Traceback (most recent call last)" in verbose.stderr
  usage = run_python("-m", "bench.ceiling", missing, "--no-such-flag")
  assert usage.returncode == 2 and usage.stderr.count("\n") == 1
  assert "unrecognized arguments: --no-such-flag (see --help)" in usage.stderr
  zero = run_python("-m", "bench.ceiling", missing, "--repeats", "0")
  assert zero.returncode == 2 and zero.stderr.count("\n") == 1
  assert "argument --repeats: takes a positive int: '0'" in zero.stderr
  entry = run_python("-m", "bench", "ceiling", missing)  # the commands' entry point
  assert entry.returncode == 2 and entry.stderr.count("\n") == 1 and missing in entry.stderr


def test_import_pipeline_loads_neither_the_tools_nor_their_dependencies(run_python):
  proc = run_python("-c", "import sys, pipeline; print(*sorted(sys.modules))")
  loaded = {name.split(".")[0] for name in proc.stdout.split()}
  assert proc.returncode == 0 and "pipeline" in loaded
  tools = {
    "bench",
    "train",
    "configs",
    "matplotlib",
    "sklearn",
    "skimage",
    "tensorboardX",
    "flax",
    "optax",
    "ml_collections",
  }
  assert not loaded & tools, loaded & tools


@pytest.mark.parametrize("module", [storage, gets, ceiling, host, bench_all])
def test_cli_help(module, capsys):
  with pytest.raises(SystemExit) as exit_:
    module.main(["--help"])
  assert exit_.value.code == 0 and "usage: python -m bench" in capsys.readouterr().out
