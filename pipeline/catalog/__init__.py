"""What a dataset is: the record schema (`records.py`), `manifest.json` (`schema.py`,
`manifest.py`) and a TFDS build read in place (`tfds_folder.py`)."""
