"""Conversion of image datasets to verified ArrayRecord shards (`python -m pipeline.convert`).

`images` (SRC/CLASS/IMAGE folders), `tfrecord` and `tfds` write shards and manifest.json;
`verify` re-checks them; `beam` runs the same conversions on Apache Beam; `builtin` makes
the built-in digits and photos datasets. Modules load on demand to keep workers light.

Each source module has a `Request` (what to convert, into where, how), `plan(request)` (a
`shards.Job`) and `convert(request, workers)`; `shards.run` writes a job into a
`shards.Target`: a local folder, a bucket (`bucket.BucketTarget`) or Beam's workers.
"""
