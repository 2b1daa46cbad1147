"""Pixels: the crop-aware C decoder (`_jpeg.c`), its Python fallback (`fallback.py`), the
decode functions around them (`decode.py`) and the crop geometry (`augment.py`). Imports
only the record schema from the rest of the library."""
