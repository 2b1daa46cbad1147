"""Which `pip install` extra provides a module, so a missing one is named in one line.

`pip install .` installs only the library; the trainer, the built-in datasets, the tools
and the peers come with extras (pyproject.toml's optional-dependencies).
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
  return (
    f"{what} needs {dist} (No module named {top!r}), from the {extra!r} extra: "
    f"pip install -e '.[{extra}]' in the checkout (or pip install {dist})"
  )
