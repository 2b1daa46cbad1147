"""Conversion of image datasets to verified ArrayRecord shards (`python -m pipeline.convert`).

`images` (SRC/CLASS/IMAGE folders), `tfrecord` and `tfds` write shards and manifest.json;
`verify` re-checks them; `beam` runs the same conversions on Apache Beam; `builtin` makes
the built-in digits and photos datasets. Modules load on demand to keep workers light.
"""
