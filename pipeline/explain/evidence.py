"""What `pipeline.explain` reads: stage costs, a whole run, storage, as a host measured them.

The doctor (`python -m bench.doctor`) times each stage alone and checks storage; a running
stream's own stats (`iterator.stats()`) give the same figures less finely (`from_stats`).
"""

from __future__ import annotations

import dataclasses
import statistics

from pipeline.spec import Spec
from pipeline.stages.stats import Stats

STAGES = ("read", "parse", "decode", "augment")  # a train image's stages, each timed alone


@dataclasses.dataclass
class Cost:
  """Milliseconds per image of one stage run alone on one thread.

  `queued_ms` is time spent runnable but waiting for a CPU (other work on the machine);
  `active_ms` leaves it out, so a busy machine does not pass for a stage waiting on I/O.
  """

  wall_ms: float
  cpu_ms: float
  queued_ms: float = 0.0

  @property
  def active_ms(self) -> float:
    return max(self.cpu_ms, self.wall_ms - self.queued_ms)


@dataclasses.dataclass
class Requests:
  """The read stage's storage requests over a run's timed part (`stages.read.ReadStats`)."""

  made: int
  per_s: float
  kb_per_request: float
  images_per_request: float
  order: str  # "global": one request per image; "blocks": one per block of block_records
  block_records: int | None
  max_per_s: float | None  # performance.max_requests_per_s
  latency_open_ms: float  # one read at open
  latency_ms: float  # a read task at the end (moving average)


@dataclasses.dataclass
class Run:
  """The whole pipeline, steady state (after the first batch)."""

  images_per_sec: float
  first_batch_s: float
  images: int
  seconds: float
  cpu_ms_per_image: float  # this process and its worker processes
  wait_share: float | None = None  # with a simulated step: time blocked in next() / total
  requests: Requests | None = None  # every process's, worker processes' too


@dataclasses.dataclass(frozen=True)
class Storage:
  """A storage check's verdict: the requests/s storage answers however many are in flight
  (None: no such ceiling), and a read's latency alone and at the most reads in flight."""

  ceiling_per_s: float | None
  alone_ms: float
  loaded_ms: float
  loaded_in_flight: int


@dataclasses.dataclass
class Measured:
  """What was measured on a host of `cores` cores: each stage alone (`STAGES`, plus
  "decode_dct", "cache_fill", "augment_cached" where timed), the whole pipeline, storage.
  `cache_mb` and `dct_share` are None where not measured: no cache or DCT advice then."""

  cores: int
  costs: dict[str, Cost]
  run: Run
  cache_mb: float | None  # every decoded image of the split, cached
  dct_share: float | None  # share of crops decoded with DCT scaling
  load_average: float = 0.0
  python_us: float | None = None  # GIL-held time per image, where measured (native path)
  storage: Storage | None = None


def from_stats(spec: Spec, stats: Stats, cores: int) -> Measured:
  """What a running stream of `spec` measured over the interval of `stats` (its
  `iterator.stats()`, in steady state) on a host of `cores` cores: per image, each stage's
  busy and CPU time over every process (the decode threads' task, parse, decode and augment
  together, as "decode"; plan and finish as the run's rest), its rate and storage requests.
  No stage is timed alone here, so neither the cache nor DCT scaling is weighed, nor the time
  each image holds the GIL alone ("python")."""
  rate = sum(r.images_per_s for r in stats.rows if r.stage == "finish")
  if rate <= 0:
    raise ValueError("the stats hold no finished batch: take them after some batches")

  def per_image(stage: str, field: str) -> float:
    return sum(getattr(r, field) for r in stats.rows if r.stage == stage) / rate * 1e3

  costs = {s: Cost(0.0, 0.0) for s in STAGES}
  read, decode = ((per_image(s, "busy"), per_image(s, "cpu")) for s in ("read", "decode"))
  costs["read"] = Cost(round(read[0], 4), round(read[1], 4))  # off a CPU: waiting on storage
  # The decode threads do no I/O: their time off a CPU waited for one (or the GIL).
  costs["decode"] = Cost(*(round(x, 4) for x in (decode[0], decode[1], decode[0] - decode[1])))
  s, requests = stats.storage, None
  if s.requests:
    reads = [r.p50_ms for r in stats.rows if r.stage == "read" and r.p50_ms > 0]
    latency = statistics.median(reads) if reads else 0.0
    perf = spec.performance
    requests = Requests(
      s.requests,
      round(s.requests_per_s, 1),
      round(s.kb_per_request, 1),
      round(s.images_per_request, 2),
      "blocks" if spec.order == "blocks" else "global",
      spec.block_records,
      perf.max_requests_per_s,
      latency,
      latency,
    )
  cpu = sum(per_image(stage, "cpu") for stage in {r.stage for r in stats.rows})
  images = round(rate * stats.seconds)
  run = Run(round(rate, 1), 0.0, images, stats.seconds, round(cpu, 4), requests=requests)
  return Measured(cores, costs, run, cache_mb=None, dct_share=None)
