#!/usr/bin/env bash
# The device check on a fresh GPU host (docs/PERFORMANCE.md, "On a GPU host"): installs the wheels
# that bench/device_wheels.sh put in .whl/, builds the C decoder against the headers there, and
# writes $OUT/device_check.json (default runs/device_check) with `python -m bench.device_check`.
#   bench/device_check.sh [--images 4000 --seconds 30 --train-seconds 60 --batch 256]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-runs/device_check}
SITE=${SITE:-/tmp/device-check-site}
ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl/: run bench/device_wheels.sh first"; exit 2; }
install=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade)
"${install[@]}" --target "$SITE" $(ls .whl/*.whl | grep -v '/nvidia_')
# nvImageCodec and nvJPEG beside the interpreter's other nvidia/ packages: a second nvidia/cu13
# folder earlier on the path could hide the CUDA libraries JAX loads from the first
"${install[@]}" .whl/nvidia_*.whl
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1
# the C decoder, compiled as setup.py does but without setuptools (whose version there is unknown)
ext=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
${CC:-cc} -O3 -Wall -Wextra -ffp-contract=off -shared -fPIC -I"$inc" -I.whl/include \
  pipeline/image/_jpeg.c -o "pipeline/image/_jpeg$ext"
"$PY" -c "from pipeline.image import decode; assert decode.native(), 'C decoder not built'"
mkdir -p "$OUT"
"$PY" -m bench.device_check --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
