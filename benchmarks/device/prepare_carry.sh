#!/usr/bin/env bash
# Fetch what the GPU device machine lacks (Ray 2.58 and jsonschema's stack) as wheels into .whl/, run HERE.
#
# The device machine (Python 3.12, torch with CUDA, pytorch-lightning; no network, no Ray) takes at most
# 64 MiB of working tree per call. Ray's cp312 wheel is about 78 MB, 32 MB of which is ray/jars/ (Java
# workers, unused by raysgd), so it is repacked without them, its RECORD rewritten to match.
#
# Usage, from the repository root (any Python with pip and network to PyPI):
#     bash benchmarks/device/prepare_carry.sh          # writes .whl/ (git-ignored) and prints the sizes
# then pass carry=[".whl"] to the device tool and run benchmarks/device/run_gpu_checks.sh there.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="$ROOT/.whl"
PY="${PYTHON:-python3}"
RAY_VERSION="${RAY_VERSION:-2.58.0}"
LIMIT_MIB="${LIMIT_MIB:-55}"
# Ray's Requires-Dist (no extras): click, filelock, jsonschema, msgpack, packaging, protobuf, pyyaml,
# requests. The device image has all but jsonschema; jsonschema needs attrs (there), referencing,
# jsonschema-specifications and rpds-py (a compiled wheel). `import ray.tune` also needs pydantic (ray.train
# v2), which the image lacks: pydantic, pydantic-core (compiled), annotated-types and typing-inspection
# (typing-extensions is there). The versions are the ones the project's venv uses. Checked on this machine
# with Python 3.12 (pyenv) and only the image's packages: `import ray, ray.tune`, ray.init and fractional-GPU
# placement groups work from the installed wheels.
EXTRA=(
  "jsonschema==4.26.0"
  "jsonschema-specifications==2025.9.1"
  "referencing==0.37.0"
  "rpds-py==2026.9.1"
  "pydantic==2.14.3"
  "pydantic-core==2.50.4"
  "annotated-types==0.8.0"
  "typing-inspection==0.4.5"
)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

git -C "$ROOT" check-ignore -q "$DEST/x.whl" || { echo "$DEST is not git-ignored: add /.whl/ to .gitignore" >&2; exit 1; }
mkdir -p "$DEST"

download() {
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$1" "${@:2}"
}

# The original Ray wheel is kept in a cache outside the repository, so a second run needs no download.
CACHE="${RAYSGD_CARRY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/raysgd-carry}"
mkdir -p "$CACHE"
rm -f "$DEST"/ray-*.whl
ls "$CACHE"/ray-"$RAY_VERSION"-cp312-*.whl >/dev/null 2>&1 || download "$CACHE" "ray==$RAY_VERSION"
for spec in "${EXTRA[@]}"; do
  name="${spec%%==*}"
  rm -f "$DEST/${name//-/_}"-*.whl
  download "$DEST" "$spec"
done

# Repack Ray without ray/jars/, dropping those rows from RECORD (pip installs exactly what RECORD lists).
"$PY" - "$CACHE"/ray-"$RAY_VERSION"-cp312-*.whl "$DEST" <<'PYEOF'
import os
import sys
import zipfile

source, dest = sys.argv[1], sys.argv[2]
target = os.path.join(dest, os.path.basename(source))
dropped = 0
with zipfile.ZipFile(source) as src, zipfile.ZipFile(target + ".part", "w", zipfile.ZIP_DEFLATED) as out:
    for info in src.infolist():
        if info.filename.startswith("ray/jars/"):
            dropped += info.file_size
            continue
        data = src.read(info)
        if info.filename.count("/") == 1 and info.filename.endswith(".dist-info/RECORD"):
            rows = data.decode().splitlines(keepends=True)
            data = "".join(row for row in rows if not row.startswith("ray/jars/")).encode()
        info.compress_type = zipfile.ZIP_DEFLATED  # keeps the name, date and permission bits (executables)
        out.writestr(info, data, compresslevel=9)
os.replace(target + ".part", target)
print(f"repacked {os.path.basename(source)} without ray/jars/ ({dropped / 2**20:.1f} MiB uncompressed left out)")
PYEOF

# Check every wheel: RECORD lists each file once with its hash, and nothing else.
"$PY" - "$DEST"/*.whl <<'PYEOF'
import base64
import csv
import hashlib
import io
import sys
import zipfile

for path in sys.argv[1:]:
    with zipfile.ZipFile(path) as wheel:
        names = {n for n in wheel.namelist() if not n.endswith("/")}
        record = next(n for n in names if n.count("/") == 1 and n.endswith(".dist-info/RECORD"))  # not a vendored one
        rows = list(csv.reader(io.StringIO(wheel.read(record).decode())))
        listed = {row[0] for row in rows if row}
        assert listed == names, f"{path}: RECORD and contents differ: {sorted(listed ^ names)[:5]}"
        for name, digest, _ in (row for row in rows if row and row[1]):
            algo, value = digest.split("=", 1)
            actual = base64.urlsafe_b64encode(hashlib.new(algo, wheel.read(name)).digest()).rstrip(b"=").decode()
            assert actual == value, f"{path}: hash of {name} differs from RECORD"
print(f"checked {len(sys.argv) - 1} wheels: RECORD matches")
PYEOF

ls -l "$DEST"
WHEELS=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
TRACKED=$(git -C "$ROOT" ls-files -z | (cd "$ROOT" && xargs -0 du -cb 2>/dev/null) | awk '/\ttotal$/ {s += $1} END {print s + 0}')
TOTAL=$((WHEELS + TRACKED))
echo "wheels $((WHEELS / 1024)) KiB + tracked files $((TRACKED / 1024)) KiB = $((TOTAL / 1048576)) MiB (limit ${LIMIT_MIB} MiB of the 64 MiB a call carries)"
if [ "$TOTAL" -gt $((LIMIT_MIB * 1048576)) ]; then
  echo "too large to carry" >&2
  exit 1
fi
