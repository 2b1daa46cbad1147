#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) the wheels that bench/device_check.sh installs on a GPU host
# that cannot reach a package index: this project's dependencies for CPython $PYVER on x86-64 Linux,
# less the packages the host already has (one name a line in $PRESENT; default: the H200 image's
# list, bench/device_host_packages.txt), plus the libjpeg API 62 headers the C decoder builds with.
#   bench/device_wheels.sh            # or: make device-wheels; PYVER=3.11 PRESENT=my_list.txt ...
set -euo pipefail
export PIP_NO_WARN_SCRIPT_LOCATION=1
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
PRESENT=${PRESENT:-bench/device_host_packages.txt}
OUT=.whl
NEEDED=(
  "grain==0.2.18" "array-record==0.8.6" "tensorflow-datasets==4.9.10" "simplejpeg==1.9.0"
  "google-crc32c==1.9.0" "ml-collections==1.1.0" "tensorboardX==2.6.5"
  "nvidia-nvimgcodec-cu13==0.9.0.20" "nvidia-nvjpeg"
)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
  manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64; do
  platforms+=(--platform "$p")
done
all=$(mktemp -d)
trap 'rm -rf "$all"' EXIT
# promise (tensorflow-datasets imports it) is published as source only: a wheel of it, made here
python3 -m pip wheel --quiet --no-deps -w "$all" "promise==2.3"
python3 -m pip download --quiet --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${platforms[@]}" --find-links "$all" -d "$all" "${NEEDED[@]}"
norm() { tr 'A-Z_.' 'a-z--' <<<"$1"; }
declare -A have=()
while read -r name; do [ -n "$name" ] && have[$(norm "$name")]=1; done <"$PRESENT"
mkdir -p "$OUT/include"
rm -f "$OUT"/*.whl
for wheel in "$all"/*.whl; do
  name=$(norm "$(basename "$wheel" | cut -d- -f1)")
  if [ -z "${have[$name]:-}" ]; then cp "$wheel" "$OUT/"; fi
done
# jpeglib.h and friends (libjpeg-turbo, API 62: the ABI of Pillow's bundled libjpeg)
for h in jpeglib.h jmorecfg.h jerror.h; do cp "/usr/include/$h" "$OUT/include/"; done
cp "$(find /usr/include -name jconfig.h | head -1)" "$OUT/include/"
grep -q "JPEG_LIB_VERSION *62" "$OUT/include/jconfig.h" ||
  echo "warning: these libjpeg headers are not API 62; the C decoder will need a matching libjpeg"
ls -1 "$OUT"/*.whl
du -sh "$OUT"
