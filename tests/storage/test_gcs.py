"""Datasets in a gs:// bucket: read end to end from a local Cloud Storage emulator, and every
way it cannot work said in one line that names the fix.

The emulator (`tests/gcs_emulator.py`, gcp-storage-emulator on 127.0.0.1) serves both
readers a dataset has: gcsfs (manifest, shard sizes) through STORAGE_EMULATOR_HOST and
array_record's own C++ reader (the shards) through CLOUD_STORAGE_EMULATOR_ENDPOINT. Reads
run in fresh processes, because epath picks and caches its gs:// backend per process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request

import pytest

from pipeline.storage import backend, remote
from pipeline.storage.gcs import EMULATOR_VARS
from tests import gcs_emulator

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EMULATOR_MISSING = [
  name for name in ("gcp_storage_emulator", "gcsfs") if importlib.util.find_spec(name) is None
]
# Both are in the dev extra, so CI has them: there a missing one fails instead of skipping.
needs_emulator = pytest.mark.skipif(
  bool(EMULATOR_MISSING) and os.environ.get("CI") != "true",
  reason=f"not installed: {EMULATOR_MISSING} (pip install -e '.[dev]')",
)
# A plain install: `import gcsfs` raises ImportError, and epath finds no TensorFlow either.
WITHOUT_GCSFS = "import sys; sys.modules['gcsfs'] = None; sys.modules['tensorflow'] = None\n"


def run(
  code: str, env: dict | None = None, cwd: str = REPO, args=(), timeout: float = 300
) -> subprocess.CompletedProcess:
  """Runs `python -c CODE ARGS...` (or `python ARGS...` when CODE is empty) from `cwd` with
  this checkout first on the path."""
  command = [sys.executable, *(["-c", code] if code else []), *args]
  return subprocess.run(
    command,
    cwd=cwd,
    capture_output=True,
    text=True,
    timeout=timeout,
    env={**os.environ, "PYTHONPATH": REPO, "TQDM_DISABLE": "1", **(env or {})},
  )


# --- one-line refusals ---------------------------------------------------------------------


def test_a_local_data_dir_is_not_looked_at():
  backend.check("/no/such/dir")
  backend.check("relative/dir")


def test_a_scheme_array_record_cannot_open_is_refused_in_one_line():
  with pytest.raises(remote.RemoteStorageError, match=r"^cannot read s3://b/ds: .*mount") as e:
    backend.check("s3://b/ds")
  assert "\n" not in str(e.value)


def test_gs_without_gcsfs_says_what_to_install():
  p = run(WITHOUT_GCSFS + "from pipeline.storage import backend; backend.check('gs://bucket/ds')")
  last = p.stderr.strip().splitlines()[-1]
  assert last == (
    "pipeline.storage.remote.RemoteStorageError: reading gs://bucket/ds needs gcsfs: "
    "pip install -e '.[gcs]' in the checkout (or pip install gcsfs); or mount the bucket with "
    "gcsfuse and pass the mount path"
  )


@pytest.mark.slow
def test_make_dataset_of_gs_without_gcsfs_is_one_line():
  p = run(WITHOUT_GCSFS + "import pipeline; pipeline.make_dataset('gs://bucket/ds', batch_size=2)")
  assert p.returncode == 1
  assert (
    p.stderr.strip()
    .splitlines()[-1]
    .endswith(
      "reading gs://bucket/ds needs gcsfs: pip install -e '.[gcs]' in the checkout "
      "(or pip install gcsfs); "
      "or mount the bucket with gcsfuse and pass the mount path"
    )
  )


@pytest.mark.slow
def test_the_trainer_on_gs_without_gcsfs_is_one_line_naming_the_install():
  # As `python -m train ...` on a plain install: the manifest is the first thing it reads.
  argv = ["train", "--config", "default", "--workdir", "w", "--dry_run"]
  argv.append("--config.input.data_dir=gs://bucket/ds")
  p = run(
    "import runpy, sys; sys.modules['gcsfs'] = None\n"
    f"sys.argv = {argv!r}; runpy.run_module('train', run_name='__main__', alter_sys=True)",
    env={"EPATH_USE_TF": "false"},  # as without TensorFlow, whichever extras are here
  )
  assert p.returncode == 2, p.stderr[-2000:]
  assert "Traceback" not in p.stderr
  assert p.stderr.strip() == (
    "python -m train: config.input: reading gs://bucket/ds needs gcsfs: pip install -e "
    "'.[gcs]' in the checkout (or pip install gcsfs); or mount the bucket with gcsfuse and "
    "pass the mount path"
  )


def test_an_emulator_set_for_one_reader_only_is_refused():
  p = run(
    "from pipeline.storage import backend; backend.check('gs://bucket/ds')",
    env={"STORAGE_EMULATOR_HOST": "http://127.0.0.1:1", "CLOUD_STORAGE_EMULATOR_ENDPOINT": ""},
  )
  assert p.stderr.strip().splitlines()[-1] == (
    "pipeline.storage.remote.RemoteStorageError: STORAGE_EMULATOR_HOST is set but "
    "CLOUD_STORAGE_EMULATOR_ENDPOINT is not: the manifest and the shards would be read from "
    "different places (gcsfs reads the first, array_record the second); set both to the "
    "emulator's URL, or neither"
  )


@needs_emulator
def test_an_emulator_without_the_gcsfs_setting_it_needs_is_refused():
  p = run(
    "from pipeline.storage import backend; backend.check('gs://bucket/ds')",
    env={
      "STORAGE_EMULATOR_HOST": "http://127.0.0.1:1",
      "CLOUD_STORAGE_EMULATOR_ENDPOINT": "http://127.0.0.1:1",
      "EPATH_USE_TF": "false",
      "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "",
    },
  )
  assert (
    p.stderr.strip()
    .splitlines()[-1]
    .startswith(
      "pipeline.storage.remote.RemoteStorageError: STORAGE_EMULATOR_HOST is set: also set "
      "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false (else gcsfs asks the emulator"
    )
  )


def test_convert_builtin_into_a_scheme_array_record_cannot_open_is_one_line_making_nothing(
  tmp_path,
):
  p = run(
    "",
    cwd=str(tmp_path),
    env={"XDG_CACHE_HOME": str(tmp_path / "cache")},
    args=["-m", "pipeline.convert", "builtin", "s3://bkt/ds"],
  )
  assert p.returncode == 2, p.stderr
  assert p.stderr == (
    "error: cannot read s3://bkt/ds: shards are read by array_record, which opens local paths "
    "and gs:// only; mount the s3:// storage and pass the mount path\n"
  )
  assert os.listdir(tmp_path) == []  # no raw images made, no folder named s3:


def test_convert_verify_of_a_scheme_array_record_cannot_open_refuses_in_one_line():
  p = run("", args=["-m", "pipeline.convert", "verify", "s3://bkt/ds"])
  assert p.returncode == 2
  assert p.stderr == (
    "error: cannot read s3://bkt/ds: shards are read by array_record, which opens local paths "
    "and gs:// only; mount the s3:// storage and pass the mount path\n"
  )


def test_errors_of_reading_gcs_are_explained():
  assert remote.explain(PermissionError("401 Anonymous caller does not have access")).startswith(
    "no access (PermissionError: 401 Anonymous caller does not have access): run `gcloud auth "
  )
  assert remote.explain(OSError("Cannot connect to host storage.googleapis.com:443")).startswith(
    "cannot reach Cloud Storage (OSError: Cannot connect to host storage.googleapis.com:443)"
  )
  assert remote.explain(RuntimeError("first\nsecond")) == "RuntimeError: first"


# --- end to end against the local emulator --------------------------------------------------


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
  """A local Cloud Storage with bucket "bkt"; yields the environment that points gcsfs, epath
  and array_record at it, and GCS_EMULATOR_COUNT: the file counting its GETs."""
  assert not EMULATOR_MISSING, f"CI=true but not installed: {EMULATOR_MISSING}"
  count = os.path.join(tmp_path_factory.mktemp("gcs"), "gets")  # the GETs served so far
  with gcs_emulator.serving("bkt", {"GCS_EMULATOR_COUNT": count}) as (env, _):
    yield {**env, "GCS_EMULATOR_COUNT": count}


@pytest.mark.slow
@needs_emulator
def test_a_dataset_in_a_bucket_reads_as_it_does_from_disk(gcs, digits_dir):
  code = textwrap.dedent(
    """
    import sys
    import gcsfs
    import numpy as np
    from pipeline import make_dataset
    from pipeline.catalog import manifest
    from pipeline.storage import backend
    from pipeline.storage.source import ShardedSource

    local, url = sys.argv[1], "gs://bkt/digits"
    gcsfs.GCSFileSystem(token="anon").put(local, "bkt/digits", recursive=True)
    backend.check(url)

    meta = manifest.load(url)
    assert meta == manifest.load(local)
    for split in meta.splits:
      paths = manifest.checked_shards(url, meta, split, verify="sha256")
      assert [str(p) for p in paths][0].startswith("gs://bkt/digits/"), paths
      counts = [s.num_records for s in meta.splits[split].shards]
      remote_src = ShardedSource(paths, counts)
      local_src = ShardedSource(manifest.checked_shards(local, meta, split), counts)
      shuffled = np.random.default_rng(0).permutation(len(local_src))
      assert remote_src.read(shuffled) == local_src.read(shuffled), split

    def batches(data_dir):
      ds = make_dataset(data_dir, "validation", batch_size=16, train=False, image_size=32)
      return [(b["image"], b["label"], b["mask"]) for b in ds]

    got, want = batches(url), batches(local)
    assert len(got) == len(want) > 1
    for g, w in zip(got, want):
      for a, b in zip(g, w):
        np.testing.assert_array_equal(a, b)
    print("same", len(got), "batches")
    """
  )
  p = run(code, env=gcs, args=[str(digits_dir)])
  assert p.returncode == 0, p.stderr[-3000:]
  assert "same" in p.stdout


@pytest.mark.slow
@needs_emulator
def test_a_shard_written_again_in_the_bucket_is_refused_not_served(gcs, digits_dir, tmp_path):
  """Issue 31: a shard object overwritten after conversion (same size, its records in another
  order) was served under the old manifest, with wrong labels, and the record cache kept them."""
  code = textwrap.dedent(
    """
    import sys
    import gcsfs
    import numpy as np
    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter
    from pipeline import make_dataset
    from pipeline.catalog import manifest
    from pipeline.convert import shards
    from pipeline.storage.source import ShardedSource

    local, work = sys.argv[1], sys.argv[2]
    url, fs = "gs://bkt/pinned", gcsfs.GCSFileSystem(token="anon")
    fs.put(local, "bkt/pinned", recursive=True)
    meta = manifest.load(url)
    name = meta.splits["validation"].shards[0].file
    reader = ArrayRecordReader(f"{local}/{name}")
    recs = reader.read(list(range(reader.num_records())))
    writer = ArrayRecordWriter(f"{work}/other", shards.OPTIONS)
    for rec in reversed(recs):
      writer.write(rec)
    writer.close()
    assert fs.size(f"bkt/pinned/{name}") == len(open(f"{work}/other", "rb").read())

    def batches(cache=True):
      perf = dict(record_cache_mb=0, num_workers=0)
      perf.update(record_cache_dir=f"{work}/cache") if cache else None
      ds = make_dataset(url, "validation", batch_size=16, train=False, image_size=32,
                        performance=perf)
      return [b["label"] for b in ds]

    truth = batches()  # fills the disk cache
    fs.put(f"{work}/other", f"bkt/pinned/{name}")  # written again: a new generation
    try:
      wrong = sum(not np.array_equal(a, b) for a, b in zip(batches(cache=False), truth))
      print(f"open: served, {wrong} of {len(truth)} batches with other labels")
    except manifest.ManifestError as e:
      print("open:", e)
    fs.put(f"{local}/{name}", f"bkt/pinned/{name}")  # the bucket restored
    paths, pins = manifest.pinned_shards(url, meta, "validation")
    fs.put(f"{work}/other", f"bkt/pinned/{name}")  # ... and written again after the check
    try:
      ShardedSource(paths, [len(recs)], pins).read([0])
      print("read: served")
    except OSError as e:
      print("read:", e)
    fs.put(f"{local}/{name}", f"bkt/pinned/{name}")
    for got, want in zip(batches(), truth, strict=True):
      np.testing.assert_array_equal(got, want)
    print("restored: same batches")
    """
  )
  p = run(code, env=gcs, args=[str(digits_dir), str(tmp_path)])
  assert p.returncode == 0, p.stderr[-3000:]
  shard = "gs://bkt/pinned/validation.array_record-00000-of-00001"
  opened, read, restored = p.stdout.strip().splitlines()
  assert re.fullmatch(
    f"open: shard {shard} has crc32c [0-9a-f]{{8}}, gs://bkt/pinned/manifest.json says "
    "[0-9a-f]{8}: it changed after conversion",
    opened,
  )
  assert read.startswith(f"read: shard {shard} was replaced after this dataset was opened")
  assert restored == "restored: same batches"


@pytest.mark.slow
@needs_emulator
def test_from_a_bucket_the_block_order_reads_many_images_per_get(gcs, photos_dir):
  code = textwrap.dedent(
    """
    import os, pathlib, sys
    import gcsfs
    from pipeline import dataset, Spec

    gcsfs.GCSFileSystem(token="anon").put(sys.argv[1], "bkt/per-get", recursive=True)
    count = pathlib.Path(os.environ["GCS_EMULATOR_COUNT"])
    for order in ("global", "blocks"):
      perf = dict(record_cache_mb=0, num_workers=0)
      spec = Spec.of("gs://bkt/per-get", batch_size=8, image_size=16, order=order,
                     shard_index=0, shard_count=1, performance=perf)
      st = dataset.build(spec)
      it = iter(dataset.chain(st))
      next(it)  # opened
      before, read = int(count.read_text()), st.read.stats.request_records
      for _ in range(18):  # 3 epochs of 48
        next(it)
      gets = int(count.read_text()) - before
      print(order, st.read.stats.request_records - read, gets)
      it.close()
    """
  )
  p = run(code, env=gcs, args=[str(photos_dir)])
  assert p.returncode == 0, p.stderr[-3000:]
  (_, g_records, g_gets), (_, b_records, b_gets) = [
    line.split() for line in p.stdout.splitlines()[-2:]
  ]
  assert 0 < int(g_records) <= 2 * int(g_gets)  # about a GET per image (~1.1 here)
  assert int(b_records) >= 8 * int(b_gets) > 0  # a block, or more, per GET


@needs_emulator
def test_a_missing_dataset_in_a_bucket_says_convert_first(gcs):
  p = run(
    "from pipeline.catalog import manifest; from pipeline.storage import backend; "
    "backend.check('gs://bkt/none'); "
    "manifest.load('gs://bkt/none')",
    env=gcs,
  )
  assert p.stderr.strip().splitlines()[-1] == (
    "FileNotFoundError: gs://bkt/none/manifest.json not found: convert the dataset first "
    "(python -m pipeline.convert --help)"
  )


def bucket_names(gcs: dict, prefix: str) -> list[str]:
  """The names of the objects under gs://bkt/`prefix`, listed through the JSON API."""
  url = f"{gcs['STORAGE_EMULATOR_HOST']}/storage/v1/b/bkt/o?prefix={prefix}"
  with urllib.request.urlopen(url, timeout=30) as r:
    return sorted(item["name"] for item in json.load(r).get("items", []))


@pytest.mark.slow
@needs_emulator
def test_a_run_with_its_workdir_in_a_bucket_writes_everything_there_and_nothing_here(
  gcs, digits_dir, tmp_path
):
  argv = ["-m", "train", "--workdir", "gs://bkt/run", f"--config.input.data_dir={digits_dir}"]
  argv += ["--config.batch_size=32", "--config.num_steps=2", "--config.synthetic_steps=2"]
  argv += [
    "--config.log_every=1",
    "--config.eval_every_steps=2",
    "--config.checkpoint_every_steps=2",
  ]
  env = {**gcs, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  p = run("", env=env, cwd=str(tmp_path), args=argv)
  assert p.returncode == 0, p.stderr[-3000:]
  assert list(tmp_path.iterdir()) == []  # no ./gs:/bkt/run folder
  names = bucket_names(gcs, "run/")
  for name in ("summary.json", "metrics.jsonl", "curves.png", "checkpoints/2/commit_success.txt"):
    assert f"run/{name}" in names, names
  assert any(n.startswith("run/tensorboard/events.out.tfevents.") for n in names), names
  again = run("", env=env, cwd=str(tmp_path), args=argv)  # reads its summary back from there
  assert again.returncode == 0, again.stderr[-3000:]
  assert "already done: 2 steps" in again.stdout and "gs://bkt/run/summary.json" in again.stdout


# --- what retrying cannot mend: one line at once ---------------------------------------------

# No DNS (as on a host without network): every name fails to resolve at once, as it does there.
NO_DNS = (
  "import socket\n"
  "def _no_dns(*args, **kwargs):\n"
  "  raise socket.gaierror(socket.EAI_NONAME, 'Name or service not known')\n"
  "socket.getaddrinfo = _no_dns\n"
)


def no_credentials(home) -> dict:
  """An environment without Application Default Credentials or an emulator."""
  unset = ("GOOGLE_APPLICATION_CREDENTIALS", "CLOUDSDK_CONFIG", *EMULATOR_VARS)
  return {"HOME": str(home), "EPATH_USE_TF": "false", **dict.fromkeys(unset, "")}


@pytest.mark.slow
def test_the_trainer_without_dns_or_credentials_says_both_in_one_line_at_once(tmp_path):
  argv = ["train", "--config", "default", "--workdir", "w", "--dry_run"]
  argv.append("--config.input.data_dir=gs://bkt/ds")
  p = run(
    NO_DNS + f"import runpy, sys; sys.argv = {argv!r}\n"
    "runpy.run_module('train', run_name='__main__', alter_sys=True)",
    env=no_credentials(tmp_path),
  )
  assert p.returncode == 2, p.stderr[-2000:]
  assert p.stderr.strip() == (  # no gcsfs warnings, no tracebacks, no "no answer within 20 s"
    "python -m train: config.input: cannot read gs://bkt/ds: cannot reach Cloud Storage "
    "(storage.googleapis.com does not resolve: Name or service not known): check the network "
    "and DNS; no credentials either (Your default credentials were not found): run `gcloud "
    "auth application-default login`, or on a TPU/GCE VM give its service account Storage "
    "Object Viewer on the bucket; or mount the bucket with gcsfuse and pass the mount path"
  )


def test_an_emulator_host_that_does_not_resolve_is_one_line_naming_it(tmp_path):
  url = "http://gcs-emulator.internal:9023"
  env = {**no_credentials(tmp_path), **dict.fromkeys(EMULATOR_VARS, url)}
  p = run(
    NO_DNS + "import pipeline; pipeline.make_dataset('gs://bkt/ds', batch_size=2)",
    env={**env, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"},
  )
  assert p.returncode == 1, p.stderr[-2000:]
  assert p.stderr.strip().splitlines()[-1] == (
    "pipeline.storage.remote.RemoteStorageError: cannot read gs://bkt/ds: "
    "cannot reach Cloud Storage "
    "(gcs-emulator.internal does not resolve: Name or service not known): check the network "
    "and DNS; or mount the bucket with gcsfuse and pass the mount path"
  )


@pytest.mark.parametrize("verbose", [False, True])
def test_the_trainer_shows_gcsfs_logs_only_when_verbose(verbose):
  p = run(
    "import logging, sys\n"
    "from train import __main__ as cli\n"
    "cli.parse_flags(sys.argv)\n"
    "logging.getLogger('gcsfs').error('_request out of retries on exception: Cannot connect')\n",
    args=["--dry_run", *(["--verbose"] if verbose else [])],
  )
  assert p.returncode == 0, p.stderr[-2000:]
  assert ("_request out of retries" in p.stderr) == verbose, p.stderr[-2000:]


# --- converting where the data lives: gs:// in, gs:// out ------------------------------------

BUCKET_CONVERT = "--val-fraction 0.2 --shard-size-mb 0.02 --no-progress".split()


def convert(src: str, out: str, *flags: str, env: dict) -> subprocess.CompletedProcess:
  return run("", env=env, args=["-m", "pipeline.convert", "images", src, out, *flags])


# `convert images ARGS... --workers 1` killed (exit 9, no cleanup) as it would upload shard N+1;
# prints the shards it uploaded or tried to, its exit status, and the most files it held
# in its local temporary folder (killed: that folder).
KILLED_AFTER = textwrap.dedent(
  """
  import os, sys
  from pipeline.convert import __main__ as cli, bucket

  uploads, upload, staged = [], bucket.upload, []

  def counted(*args):
    uploads.append(args[2].name)
    staged.append(os.listdir(os.path.dirname(args[1])))  # the local temporary folder
    if len(uploads) > int(sys.argv[1]):
      print(os.path.dirname(args[1]), flush=True)
      os._exit(9)
    return upload(*args)

  bucket.upload = counted
  code = cli.main(["images", *sys.argv[2:], "--workers", "1"])
  print(len(uploads), code, max(map(len, staged)))
  """
)


# `convert images ARGS...` killed (exit 9) as it copies its second shard into OUT: the old
# manifest is gone, some shards are new and some old.
KILLED_IN_SWAP = textwrap.dedent(
  """
  import os, sys
  from pipeline.convert import __main__ as cli, bucket

  writing, copied = bucket._writing, []

  def counted(fn, what):
    if "/.convert-build/" not in what and ".array_record-" in what:
      copied.append(what)
      if len(copied) > 1:
        os._exit(9)
    return writing(fn, what)

  bucket._writing = counted
  sys.exit(cli.main(["images", *sys.argv[1:]]))
  """
)


SAME_AS_LOCAL = textwrap.dedent(
  """
  import json, os, sys
  import gcsfs
  fs, prefix, local, least = gcsfs.GCSFileSystem(token="anon"), *sys.argv[1:3], int(sys.argv[3])
  names = sorted(os.listdir(local))
  assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(prefix)) == names
  assert len(names) > least, names
  assert all(fs.cat_file(f"{prefix}/{n}") == open(f"{local}/{n}", "rb").read()
             for n in names if n != "manifest.json")
  got = json.loads(fs.cat_file(f"{prefix}/manifest.json"))
  want = json.load(open(f"{local}/manifest.json"))
  for sh in (sh for s in got["splits"].values() for sh in s["shards"]):
    assert sh.pop("generation")  # the object's, in the bucket's manifest only
  assert (got["splits"], got["classes"]) == (want["splits"], want["classes"])
  """
)


def same_as_local(gcs: dict, prefix: str, local, shards: int = 1) -> None:
  """gs://`prefix` holds what local folder `local` holds (at least `shards` shards): the same
  files, shards byte for byte, and a manifest of the same splits and classes (plus each
  shard's generation)."""
  check = run(SAME_AS_LOCAL, env=gcs, args=[prefix, str(local), str(shards)])
  assert check.returncode == 0, check.stderr[-2000:]


@pytest.mark.slow
@needs_emulator
def test_images_from_a_bucket_into_a_bucket_are_the_local_conversion(gcs, digits_raw, tmp_path):
  code = "import gcsfs, sys; gcsfs.GCSFileSystem(token='anon').put(*sys.argv[1:], recursive=True)"
  assert run(code, env=gcs, args=[str(digits_raw), "bkt/conv/raw"]).returncode == 0
  local = convert(str(digits_raw), str(tmp_path / "local"), *BUCKET_CONVERT, env=gcs)
  assert local.returncode == 0, local.stderr[-2000:]
  flags = [*BUCKET_CONVERT, "--workers", "2"]
  p = convert("gs://bkt/conv/raw", "gs://bkt/conv/out", *flags, env=gcs)
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout == local.stdout.replace(str(tmp_path / "local"), "gs://bkt/conv/out")
  assert "17 shards" not in p.stdout and "13 shards" in p.stdout  # several shards per split
  code = textwrap.dedent(
    """
    import json, os, sys
    import gcsfs
    import numpy as np
    from pipeline import make_dataset

    local, url, fs = sys.argv[1], "gs://bkt/conv/out", gcsfs.GCSFileSystem(token="anon")
    names = sorted(os.listdir(local))
    listed = sorted(p.rsplit("/", 1)[1] for p in fs.ls("bkt/conv/out"))
    assert [n for n in listed if n[0] != "."] == names, listed  # (a killed run's build, lock)
    for name in names[1:]:  # every shard, byte for byte
      assert fs.cat_file(f"bkt/conv/out/{name}") == open(f"{local}/{name}", "rb").read(), name
    got = json.loads(fs.cat_file("bkt/conv/out/manifest.json"))
    want = json.load(open(f"{local}/manifest.json"))
    for sh in (sh for s in got["splits"].values() for sh in s["shards"]):  # the object's own
      assert sh.pop("generation") == str(fs.info(f"bkt/conv/out/{sh['file']}")["generation"])
    assert got["splits"] == want["splits"] and got["skipped"] == want["skipped"]
    assert got["created_by"]["source"] == "gs://bkt/conv/raw"
    assert got["written_to"] == url and "written_to" not in want

    def batches(data_dir):
      ds = make_dataset(data_dir, "validation", batch_size=16, train=False, image_size=32)
      return [(b["image"], b["label"]) for b in ds]

    for g, w in zip(batches(url), batches(local), strict=True):
      np.testing.assert_array_equal(g[0], w[0])
      np.testing.assert_array_equal(g[1], w[1])
    print(json.dumps({n: fs.info(f"bkt/conv/out/{n}")["generation"] for n in names}))
    """
  )
  check = run(code, env=gcs, args=[str(tmp_path / "local")])
  assert check.returncode == 0, check.stderr[-3000:]
  # The same command again: done already, nothing written; another one: refused.
  again = convert("gs://bkt/conv/raw", "gs://bkt/conv/out", *flags, env=gcs)
  assert (again.returncode, again.stdout) == (0, p.stdout)
  assert run(code, env=gcs, args=[str(tmp_path / "local")]).stdout == check.stdout
  other = convert("gs://bkt/conv/raw", "gs://bkt/conv/out", "--seed", "1", *flags, env=gcs)
  assert (other.returncode, other.stderr) == (
    2,
    "error: gs://bkt/conv/out already holds split(s) ['train', 'validation'] of another "
    "conversion; pass --overwrite to replace them, or convert into another folder\n",
  )
  # Replacing it: killed half way, the old dataset is still there and reads as before.
  overwrite = ["gs://bkt/conv/raw", "gs://bkt/conv/out", "--seed", "1", "--overwrite"]
  killed = run(KILLED_AFTER, env=gcs, args=["3", *overwrite, *BUCKET_CONVERT])
  assert killed.returncode == 9, killed.stderr[-2000:]
  assert run(code, env=gcs, args=[str(tmp_path / "local")]).stdout == check.stdout
  # Killed as it swaps the new shards in: no dataset (not a mix of the two) until it is re-run.
  swapping = run(KILLED_IN_SWAP, env=gcs, args=[*overwrite, *flags])
  assert swapping.returncode == 9, swapping.stderr[-2000:]
  load = "from pipeline.catalog import manifest; manifest.load('gs://bkt/conv/out')"
  assert "FileNotFoundError: gs://bkt/conv/out/manifest.json not found" in run(load, env=gcs).stderr
  replaced = convert(*overwrite, *flags, env=gcs)
  assert replaced.returncode == 0, replaced.stderr[-2000:]
  assert run(code, env=gcs, args=[str(tmp_path / "local")]).returncode != 0  # other bytes
  verify = run("", env=gcs, args=["-m", "pipeline.convert", "verify", "gs://bkt/conv/out"])
  assert verify.returncode == 0 and verify.stdout.endswith("; OK\n"), verify.stdout  # the new one
  seed = "from pipeline.catalog import manifest; "
  seed += "print(manifest.load('gs://bkt/conv/out').created_by['args']['seed'])"
  assert run(seed, env=gcs).stdout == "1\n"


@pytest.mark.slow
@needs_emulator
def test_an_empty_class_folder_is_refused_locally_as_its_bucket_copy_would_lack_it(
  gcs, digits_raw, tmp_path
):
  """Sorted class folders are the labels; a bucket keeps no empty folder, so one here would
  shift every label after it between the local and the bucket conversion of the same data."""
  src = tmp_path / "raw"
  shutil.copytree(digits_raw, src)
  (src / "1_new").mkdir()  # sorts between classes 1 and 2
  code = "import gcsfs, sys; gcsfs.GCSFileSystem(token='anon').put(*sys.argv[1:], recursive=True)"
  assert run(code, env=gcs, args=[str(src), "bkt/empty/raw"]).returncode == 0
  refused = convert(str(src), str(tmp_path / "local"), *BUCKET_CONVERT, env=gcs)
  assert (refused.returncode, refused.stderr) == (
    2,
    f"error: class folder {src / '1_new'} holds no files to convert: remove it (a copy in a "
    "bucket has no empty folders, so the labels of the classes after it would differ), "
    "or pin every label with --label-map\n",
  )
  assert not (tmp_path / "local").exists()
  # As the refusal says: a label map numbers the empty class alike on both ...
  label_map = tmp_path / "classes.txt"
  label_map.write_text("\n".join(sorted(p.name for p in src.iterdir())))
  pinned = [*BUCKET_CONVERT, "--label-map", str(label_map)]
  in_bucket = convert("gs://bkt/empty/raw", "gs://bkt/empty/pinned", *pinned, env=gcs)
  assert in_bucket.returncode == 0, in_bucket.stderr[-2000:]
  local = convert(str(src), str(tmp_path / "pinned"), *pinned, env=gcs)
  assert local.returncode == 0, local.stderr[-2000:]
  same_as_local(gcs, "bkt/empty/pinned", tmp_path / "pinned")
  # ... and without the folder both number the classes alike too.
  in_bucket = convert("gs://bkt/empty/raw", "gs://bkt/empty/out", *BUCKET_CONVERT, env=gcs)
  assert in_bucket.returncode == 0, in_bucket.stderr[-2000:]
  (src / "1_new").rmdir()
  local = convert(str(src), str(tmp_path / "local"), *BUCKET_CONVERT, env=gcs)
  assert local.returncode == 0, local.stderr[-2000:]
  same_as_local(gcs, "bkt/empty/out", tmp_path / "local")


@pytest.mark.slow
@needs_emulator
def test_a_conversion_into_a_bucket_killed_mid_run_resumes_with_the_same_bytes(
  gcs, digits_raw, tmp_path
):
  """Killed after 3 shards were uploaded: no dataset yet; the same command uploads the rest,
  holding one shard at a time on local disk."""
  put = "import gcsfs, sys; gcsfs.GCSFileSystem(token='anon').put(*sys.argv[1:], recursive=True)"
  assert run(put, env=gcs, args=[str(digits_raw), "bkt/resume/raw"]).returncode == 0
  flags = BUCKET_CONVERT
  where = ["gs://bkt/resume/raw", "gs://bkt/resume/out", *flags]
  killed = run(KILLED_AFTER, env=gcs, args=["3", *where])
  assert killed.returncode == 9, killed.stderr[-2000:]
  p = run("from pipeline.catalog import manifest; manifest.load('gs://bkt/resume/out')", env=gcs)
  assert "manifest.json not found" in p.stderr  # no dataset while it is being converted
  resumed = run(KILLED_AFTER, env=gcs, args=["100", *where])
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  # 17 shards, 3 kept; on local disk never more than the shard being uploaded (1 worker)
  assert resumed.stdout.splitlines()[-1] == "14 0 1"
  stage = killed.stdout.strip()
  assert os.path.basename(stage).startswith("pipeline-convert-"), stage
  assert not os.path.exists(stage)  # the killed run's local temporary folder is removed
  local = tmp_path / "local"
  assert convert(str(digits_raw), str(local), *flags, env=gcs).returncode == 0
  same_as_local(gcs, "bkt/resume/out", local)
  verify = ["-m", "pipeline.convert", "verify", "gs://bkt/resume/out", "--no-progress"]
  ok = run("", env=gcs, args=verify)
  assert (ok.returncode, ok.stdout) == (
    0,
    "gs://bkt/resume/out: train: 240, validation: 60 records; OK\n",
  )
  # A copy elsewhere (other generations) reads; in OUT, the same bytes written again (a new
  # generation, the same CRC32C) are refused by name.
  copy = "import gcsfs; gcsfs.GCSFileSystem(token='anon').copy('bkt/resume/out', "
  copy += "'bkt/resume/copy', recursive=True)\n"
  copy += "from pipeline.catalog import split; split.open('gs://bkt/resume/copy', 'train')"
  copied = run(copy, env=gcs)
  assert copied.returncode == 0, copied.stderr[-2000:]
  copied = run("", env=gcs, args=["-m", "pipeline.convert", "verify", "gs://bkt/resume/copy"])
  assert copied.stdout == "gs://bkt/resume/copy: train: 240, validation: 60 records; OK\n"
  shard = "bkt/resume/out/train.array_record-00003-of-00013"
  rewrite = "import gcsfs, sys; fs = gcsfs.GCSFileSystem(token='anon')\n"
  rewrite += "fs.pipe_file(sys.argv[1], fs.cat_file(sys.argv[1]))"
  assert run(rewrite, env=gcs, args=[shard]).returncode == 0
  opened = run(
    "from pipeline.catalog import split; split.open('gs://bkt/resume/out', 'train')", env=gcs
  )
  assert re.fullmatch(
    f"pipeline.catalog.schema.ManifestError: shard gs://{shard} is generation \\d+, "
    "gs://bkt/resume/out/manifest.json says \\d+: the object was replaced after conversion",
    opened.stderr.strip().splitlines()[-1],
  ), opened.stderr[-2000:]
  replaced = run("", env=gcs, args=verify)
  assert replaced.returncode == 1, replaced.stderr[-2000:]
  assert re.fullmatch(
    r"gs://bkt/resume/out: train: 240, validation: 60 records; 1 problems:\n"
    r"  train.array_record-00003-of-00013: generation \d+ != manifest.json \d+ "
    r"\(the object was replaced after conversion\)\n",
    replaced.stdout,
  ), replaced.stdout
  flip = (
    "import gcsfs, sys; fs, name = gcsfs.GCSFileSystem(token='anon'), sys.argv[1]\n"
    "b = bytearray(fs.cat_file(name)); b[500] ^= 1; fs.pipe_file(name, bytes(b))"
  )
  assert run(flip, env=gcs, args=[shard]).returncode == 0
  bad = run("", env=gcs, args=verify)
  assert bad.returncode == 1, bad.stderr[-2000:]
  lines = bad.stdout.splitlines()
  assert lines[0] == "gs://bkt/resume/out: train: 239, validation: 60 records; 4 problems:"
  assert lines[1].startswith("  train.array_record-00003-of-00013: generation ")
  assert lines[2].startswith("  train.array_record-00003-of-00013: sha256 ")
  assert lines[3].startswith("  train.array_record-00003-of-00013: crc32c ")


def _tree_bytes(root: str) -> int:
  """Bytes of the files under `root` now (files that vanish while it looks count as 0)."""
  total = 0
  for folder, _, files in os.walk(root):
    for name in files:
      try:
        total += os.lstat(os.path.join(folder, name)).st_size
      except FileNotFoundError:
        pass
  return total


@needs_emulator
def test_a_conversion_between_buckets_holds_under_3_shards_per_worker_on_local_disk(
  gcs, photos_raw
):
  """Issue 39: local disk used stays under 3 shards per worker, sampled from another process
  while `convert images gs:// gs:// --workers 2` runs with its temporary folder in TMPDIR."""
  put = "import gcsfs, sys; gcsfs.GCSFileSystem(token='anon').put(*sys.argv[1:], recursive=True)"
  assert run(put, env=gcs, args=[str(photos_raw), "bkt/disk/raw"]).returncode == 0
  # A short TMPDIR: multiprocessing's sockets go there, and a socket path is at most 107 bytes.
  tmp, workers = tempfile.mkdtemp(prefix="t", dir="/tmp"), 2
  flags = ["--val-fraction", "0.25", "--shard-size-mb", "0.5", "--no-progress"]
  command = [sys.executable, "-m", "pipeline.convert", "images", "gs://bkt/disk/raw"]
  command += ["gs://bkt/disk/out", *flags, "--workers", str(workers)]
  env = {**os.environ, "PYTHONPATH": REPO, "TMPDIR": str(tmp), **gcs}
  proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  peak = 0
  while proc.poll() is None:
    peak = max(peak, _tree_bytes(str(tmp)))
    time.sleep(0.001)
  out, err = proc.communicate()
  assert proc.returncode == 0, err.decode()[-2000:]
  code = "from pipeline.catalog import manifest; import json\n"
  code += "m = manifest.load('gs://bkt/disk/out')\n"
  code += "print(json.dumps([sh.bytes for s in m.splits.values() for sh in s.shards]))"
  listed = run(code, env=gcs)
  sizes = json.loads(listed.stdout)
  assert len(sizes) >= 4 * workers  # several shards per worker
  print(f"peak local disk {peak} bytes; shards up to {max(sizes)} bytes, {workers} workers")
  assert 0 < peak <= 3 * max(sizes) * workers
  assert _tree_bytes(str(tmp)) == 0  # its temporary folder is gone
  shutil.rmtree(tmp)


@pytest.mark.slow
@needs_emulator
def test_tfrecords_from_a_bucket_into_a_bucket_are_the_local_conversion(gcs, digits_dir, tmp_path):
  from array_record.python.array_record_module import ArrayRecordReader

  from tests.convert.test_tfrecord import write_tfrecord

  name = sorted(p.name for p in digits_dir.glob("train.array_record-*"))[0]
  reader = ArrayRecordReader(str(digits_dir / name))
  examples = reader.read(list(range(reader.num_records())))
  (tmp_path / "tf").mkdir()
  write_tfrecord(tmp_path / "tf" / "a-00000-of-00002.tfrecord", examples[:100])
  write_tfrecord(tmp_path / "tf" / "a-00001-of-00002.tfrecord", examples[100:])
  flags = ["--num-classes", "10", "--shard-size-mb", "0.05", "--no-progress", "--workers", "2"]
  command = ["-m", "pipeline.convert", "tfrecord"]
  out = str(tmp_path / "local")
  local = run("", env=gcs, args=[*command, str(tmp_path / "tf" / "*.tfrecord"), out, *flags])
  assert local.returncode == 0, local.stderr[-2000:]
  code = "import gcsfs, sys; gcsfs.GCSFileSystem(token='anon').put(*sys.argv[1:], recursive=True)"
  assert run(code, env=gcs, args=[str(tmp_path / "tf"), "bkt/tfr/src"]).returncode == 0
  p = run("", env=gcs, args=[*command, "gs://bkt/tfr/src/*.tfrecord", "gs://bkt/tfr/out", *flags])
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout == local.stdout.replace(out, "gs://bkt/tfr/out")
  same_as_local(gcs, "bkt/tfr/out", tmp_path / "local", shards=3)
  verify = run("", env=gcs, args=["-m", "pipeline.convert", "verify", "gs://bkt/tfr/out"])
  assert verify.returncode == 0 and verify.stdout.endswith("; OK\n"), verify.stdout


@pytest.mark.slow
@needs_emulator
def test_a_tfds_build_converts_into_a_bucket_as_into_a_folder(gcs, tmp_path):
  from tests.convert.test_tfds import TinyShapes, prepared

  version = str(prepared(TinyShapes, tmp_path / "tfds"))
  command = ["-m", "pipeline.convert", "tfds", "tiny_shapes"]
  flags = ["--data-dir", version, "--shard-size-mb", "0.004", "--no-progress", "--workers", "2"]
  out = str(tmp_path / "local")
  local = run("", env=gcs, args=[*command, out, *flags])
  assert local.returncode == 0, local.stderr[-2000:]
  p = run("", env=gcs, args=[*command, "gs://bkt/tfds/out", *flags])
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout == local.stdout.replace(out, "gs://bkt/tfds/out")
  same_as_local(gcs, "bkt/tfds/out", out, shards=3)
  verify = run("", env=gcs, args=["-m", "pipeline.convert", "verify", "gs://bkt/tfds/out"])
  assert verify.returncode == 0 and verify.stdout.endswith("; OK\n"), verify.stdout


@needs_emulator
def test_a_workers_files_are_read_from_a_bucket_at_once_and_a_missing_one_is_skipped(gcs):
  code = textwrap.dedent(
    """
    import gcsfs
    from pipeline.catalog import records
    from pipeline.convert import bucket, images

    fs = gcsfs.GCSFileSystem(token="anon")
    fs.pipe_file("bkt/many/a/1.jpg", b"not a JPEG")
    got = bucket.read_many(["gs://bkt/many/a/1.jpg", "gs://bkt/many/a/2.jpg"])
    print(got[0], type(got[1]).__name__)
    outcomes = images.process((("a/1.jpg", 0), ("a/2.jpg", 0)), src="gs://bkt/many",
                              keys=records.DEFAULT_KEYS, max_size=None, max_pixels=10**8)
    print([(r, s["path"], n) for r, s, n in outcomes])
    print(outcomes[1][1]["reason"])
    """
  )
  p = run(code, env=gcs)
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout.splitlines() == [
    "b'not a JPEG' FileNotFoundError",
    "[(None, 'a/1.jpg', None), (None, 'a/2.jpg', None)]",
    "[Errno 2] No such object: 'gs://bkt/many/a/2.jpg'",
  ]


@pytest.mark.slow
@needs_emulator
def test_a_second_conversion_into_a_bucket_is_refused_by_the_lock_object(gcs, digits_raw):
  lock = json.dumps({"host": socket.gethostname(), "pid": os.getpid()})  # alive: this test
  code = (
    "import gcsfs, sys\n"
    "gcsfs.GCSFileSystem(token='anon').pipe_file(sys.argv[1], sys.argv[2].encode())"
  )
  assert run(code, env=gcs, args=["bkt/locked/out/.convert.lock", lock]).returncode == 0
  p = convert(str(digits_raw), "gs://bkt/locked/out", *BUCKET_CONVERT, env=gcs)
  assert (p.returncode, p.stderr) == (
    2,
    f"error: gs://bkt/locked/out is being converted by another process (pid {os.getpid()} on "
    f"{socket.gethostname()}); wait for it to finish or stop it (if it is gone: remove "
    "gs://bkt/locked/out/.convert.lock)\n",
  )
  # Its process gone (pid 2**22 + 1 is above Linux's pid_max): taken over, and released.
  gone = json.dumps({"host": socket.gethostname(), "pid": 2**22 + 1})
  assert run(code, env=gcs, args=["bkt/locked/out/.convert.lock", gone]).returncode == 0
  p = convert(str(digits_raw), "gs://bkt/locked/out", *BUCKET_CONVERT, env=gcs)
  assert p.returncode == 0, p.stderr[-2000:]
  listed = "import gcsfs; print(sorted(gcsfs.GCSFileSystem(token='anon').ls('bkt/locked/out')))"
  assert ".convert.lock" not in run(listed, env=gcs).stdout


def docs_commands(heading: str) -> list[str]:
  """The command lines of the first code block under `## heading` in docs/DATA.md (lines
  ending in a backslash joined)."""
  with open(os.path.join(REPO, "docs", "DATA.md")) as f:
    section = f.read().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
  block = re.search(r"```\n(.*?)```", section, re.S)[1]
  return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


@pytest.mark.slow
@needs_emulator
def test_the_tpu_vm_commands_of_docs_data_md_run_as_written(gcs, photos_raw, tmp_path):
  """docs/DATA.md's ImageNet commands, BUCKET replaced, from gs:// into gs:// (64 photos in
  class folders for train/, 16 in one folder and a labels CSV for val/): the local
  conversion's shards, one GET per source file, and `verify` passes."""
  import shlex

  from pipeline.convert import __main__ as cli

  commands = docs_commands("Converting ImageNet from a bucket into a bucket on one TPU VM")
  assert [c.split()[:4] for c in commands] == [
    ["python", "-m", "pipeline.convert", "images"]
  ] * 2 + [["python", "-m", "pipeline.convert", "verify"]]
  val, rows = tmp_path / "val", ["ImageId,PredictionString"]
  val.mkdir()
  for i, f in enumerate(sorted(photos_raw.rglob("*.jpg"))[::4], 1):
    (val / f"ILSVRC2012_val_{i:08d}.JPEG").write_bytes(f.read_bytes())
    rows.append(f"ILSVRC2012_val_{i:08d},{f.parent.name} 10 20 30 40")
  (tmp_path / "LOC_val_solution.csv").write_text("\n".join(rows) + "\n")
  put = "import gcsfs, sys; fs = gcsfs.GCSFileSystem(token='anon')\n"
  put += "fs.put(sys.argv[1], 'bkt/imagenet/train', recursive=True)\n"
  put += "fs.put(sys.argv[2], 'bkt/imagenet/val', recursive=True)"
  assert run(put, env=gcs, args=[str(photos_raw), str(val)]).returncode == 0
  local = {
    "gs://BUCKET/imagenet/train": str(photos_raw),
    "gs://BUCKET/imagenet/val": str(val),
    "gs://BUCKET/imagenet_ar": str(tmp_path / "local"),
  }
  cwd = os.getcwd()
  os.chdir(tmp_path)  # where the labels CSV is
  try:
    for command in commands[:2]:
      for url, path in local.items():
        command = command.replace(url, path)
      assert cli.main([*shlex.split(command)[3:], "--no-progress"]) == 0
  finally:
    os.chdir(cwd)

  def gets() -> int:
    try:
      with open(gcs["GCS_EMULATOR_COUNT"]) as f:
        return int(f.read())
    except FileNotFoundError:  # none yet
      return 0

  for command, files in zip(commands, (64, 16, None)):
    before = gets()
    argv = shlex.split(command.replace("BUCKET", "bkt"))
    p = run("", env=gcs, cwd=str(tmp_path), args=argv[1:])
    assert p.returncode == 0, p.stderr[-2000:]
    if files:
      assert files <= gets() - before <= files + 4  # one per source file, a few of OUT's
  assert p.stdout == "gs://bkt/imagenet_ar: train: 64, validation: 16 records; OK\n"
  same_as_local(gcs, "bkt/imagenet_ar", tmp_path / "local")


@needs_emulator
@pytest.mark.slow
def test_convert_builtin_into_a_bucket_writes_the_local_builds_shards(gcs, tmp_path):
  """`convert builtin gs://...` makes the raw images in a local cache folder and converts
  them into the bucket: the shards of `convert builtin LOCAL`, byte for byte; run again, its
  work is found done."""
  builtin = ["-m", "pipeline.convert", "builtin", "--no-progress"]
  local = run("", env=gcs, args=[*builtin, str(tmp_path / "local")])
  assert local.returncode == 0, local.stderr[-2000:]
  env = {**gcs, "XDG_CACHE_HOME": str(tmp_path / "cache")}
  p = run("", env=env, args=[*builtin, "gs://bkt/builtin"])
  assert p.returncode == 0, p.stderr[-2000:]
  assert p.stdout == local.stdout.replace(str(tmp_path / "local"), "gs://bkt/builtin")
  raw = tmp_path / "cache" / "pipeline" / "builtin-raw"
  assert sorted(os.listdir(raw)) == [".builtin.lock", "digits", "photos"]
  for name in ("digits", "photos"):
    same_as_local(gcs, f"bkt/builtin/{name}", tmp_path / "local" / name)
  source = (
    "import json, gcsfs, sys; fs = gcsfs.GCSFileSystem(token='anon'); "
    "print(json.loads(fs.cat_file(sys.argv[1] + '/manifest.json'))['created_by']['source'])"
  )
  for name in ("digits", "photos"):
    made = run(source, env=gcs, args=[f"bkt/builtin/{name}"])
    assert made.stdout == f"{raw}/{name}\n", made.stderr[-2000:]
  again = run("", env=env, args=[*builtin, "gs://bkt/builtin"])
  assert (again.returncode, again.stdout) == (0, p.stdout)
