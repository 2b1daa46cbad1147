"""The default chain serves the same bytes as it did at 803190b (before the house was cleaned).

tests/reference/batches.json holds the sha256 of each batch that 803190b's `make_dataset`
served with its default settings (224 px, batch 8), train and eval, with decode threads and
with a worker process, from the JPEGs in tests/reference/batches; tests/batches_reference.py
recorded them there and computes them here.
"""

from __future__ import annotations

import json

from tests import batches_reference as reference


def test_default_batches_are_bitwise_those_of_803190b(tmp_path):
  expected = json.loads((reference.JPEGS.parent / "batches.json").read_text())
  got = reference.digests(reference.convert(tmp_path / "data"))
  assert set(got) == {"threads/train", "threads/validation", "workers/train", "workers/validation"}
  for stream, digests in expected.items():
    assert got[stream] == digests, stream
  assert len(got["threads/train"]) == 6 and got["threads/train"] == got["workers/train"]
