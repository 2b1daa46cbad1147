"""What bounds a pipeline's images/s, and which settings would raise it, from measured costs.

`explain(spec, measured, cores, step_ms)` names the binding resource and its stage and
proposes settings in turn, each with its expected gain (`advise`), on the host model of
`model` (`pipeline.host.parallelism`'s, plus the loader's reads, prefetch and storage
requests); `evidence` is what it reads: the doctor's measurements (`python -m bench.doctor`)
or a running stream's own stats (`from_stats`); `words` what it says (`advice`, `brief`).
"""

from pipeline.explain.advise import explain
from pipeline.explain.evidence import STAGES, Cost, Measured, Requests, Run, Storage, from_stats
from pipeline.explain.model import (
  REQUEST_BUDGET,
  Explanation,
  Recommendation,
  binding,
  host_plan,
  request_budget,
)
from pipeline.explain.words import advice, brief

__all__ = [
  "REQUEST_BUDGET",
  "STAGES",
  "Cost",
  "Explanation",
  "Measured",
  "Recommendation",
  "Requests",
  "Run",
  "Storage",
  "advice",
  "binding",
  "brief",
  "explain",
  "from_stats",
  "host_plan",
  "request_budget",
]
