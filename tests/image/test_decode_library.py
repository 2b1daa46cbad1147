"""The C decoder runs on a libjpeg of the API version it was compiled against.

Ubuntu's headers (TPU VMs, most GPU images) are API 80 while Pillow bundles an API 62
libjpeg-turbo: paired, every image was refused ("Wrong JPEG library version").
"""

import io

import numpy as np
from PIL import Image

from pipeline.image import decode


def test_libraries_of_another_api_are_never_tried():
  ubuntu = decode.libraries(80)
  assert "libjpeg.so.8" in ubuntu
  assert not [lib for lib in ubuntu if ".so.62" in lib or ".so.9" in lib]
  debian = decode.libraries(62)
  assert "libjpeg.so.62" in debian and "libjpeg.so.8" not in debian
  assert debian[0].endswith(".so.62.4.0") or "pillow.libs" not in debian[0]


def test_the_built_decoder_knows_its_api_and_decodes(native):
  assert decode._compiled_abi() in (62, 70, 80, 90)
  image = np.random.default_rng(0).integers(0, 256, (24, 32, 3), np.uint8)
  data = io.BytesIO()
  Image.fromarray(image).save(data, "JPEG", quality=95)
  rgb, height, width = native.decode_crop(data.getvalue(), 0, 0, 24, 32, 1)
  np.testing.assert_array_equal(
    np.frombuffer(rgb, np.uint8).reshape(height, width, 3), np.asarray(Image.open(data))
  )
