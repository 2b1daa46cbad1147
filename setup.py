"""Builds the optional crop-aware JPEG decoder against the libjpeg API headers.

It is not linked to a libjpeg: `pipeline.image.decode` loads one at import time (Pillow's bundled
libjpeg-turbo 3, else the system's), so the build needs only a compiler and jpeglib.h. The
pipeline falls back to simplejpeg when it cannot be built."""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
  def run(self):
    try:
      super().run()
    except Exception as e:  # noqa: BLE001 - any build failure means "use the fallback"
      print(f"WARNING: crop-aware JPEG decoder not built ({e}); using simplejpeg")

  def build_extension(self, ext):
    try:
      super().build_extension(ext)
    except Exception as e:  # noqa: BLE001
      print(f"WARNING: {ext.name} not built ({e}); using simplejpeg")


setup(
  ext_modules=[
    Extension(
      "pipeline.image._jpeg",
      ["pipeline/image/_jpeg.c"],
      # no fused multiply-add: crop windows must match pipeline/image/augment.py's to the bit
      extra_compile_args=["-O3", "-Wall", "-Wextra", "-ffp-contract=off"],
      optional=True,
    )
  ],
  cmdclass={"build_ext": OptionalBuildExt},
)
