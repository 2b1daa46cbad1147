"""Which `pip install` extra provides a module, so a missing one is named in one line.

`pip install .` installs only the library; the trainer, the built-in datasets, the tools
and the peers come with extras (pyproject.toml's optional-dependencies). Apache Beam's
extra caps versions the main environment exceeds, so its line names `.venv-beam` instead.
"""

from __future__ import annotations

# Top-level module -> (extra, pip distribution) for the extras' packages.
MODULES = {
  "flax": ("train", "flax"),
  "optax": ("train", "optax"),
  "orbax": ("train", "orbax-checkpoint"),
  "ml_collections": ("train", "ml-collections"),
  "tensorboardX": ("train", "tensorboardX"),
  "sklearn": ("data", "scikit-learn"),
  "skimage": ("data", "scikit-image"),
  "matplotlib": ("bench", "matplotlib"),
  "psutil": ("bench", "psutil"),
  "apache_beam": ("beam", "apache-beam"),
  "distributed": ("beam", "apache-beam[dask]"),
  "dask": ("beam", "apache-beam[dask]"),
  "gcsfs": ("gcs", "gcsfs"),
  "tensorflow": ("peers", "tensorflow-cpu"),
  "torch": ("peers", "torch"),
  "torchvision": ("peers", "torchvision"),
}


def hint(module: str | None, what: str) -> str | None:
  """One line naming the extra that brings `module` (a ModuleNotFoundError's `name`), or
  None when no extra of this project provides it."""
  top = (module or "").split(".")[0]
  if top not in MODULES:
    return None
  extra, dist = MODULES[top]
  if extra == "beam":  # not installable beside the others: its own environment
    return (
      f"{what} needs {dist} (No module named {top!r}), which caps pillow, protobuf and pyarrow "
      "below this environment's versions, so it has its own: `make test-beam` creates "
      ".venv-beam (and runs the Beam tests); then run .venv-beam/bin/python -m pipeline.convert"
    )
  return (
    f"{what} needs {dist} (No module named {top!r}), from the {extra!r} extra: "
    f"pip install -e '.[{extra}]' in the checkout (or pip install {dist})"
  )
