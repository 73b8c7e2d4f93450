#!/usr/bin/env bash
# Build/download into calibration/wheels/ every wheel calibration/gpu_sweep.sh installs on a GPU
# machine without network (the list: calibration/wheels.txt), and check they fit the 64 MiB a
# device call carries.
#
#   bash calibration/build_wheels.sh [PYVER ...]      e.g. bash calibration/build_wheels.sh 3.12 3.13
#
# PYVER: the Python version(s) of the GPU machine, for the wheels that are built per version
# (pydantic-core, msgpack); default 3.12 (the H200 image's python3 was 3.12.3 in 2026-11; its
# `python3 --version` tells). This Python's own version is always added, so that
# `REHEARSE=cpu bash calibration/gpu_sweep.sh` can install the same directory here. Every other
# wheel is one for all Python 3 versions (deepspeed is built as a pure wheel from its sdist,
# bitsandbytes is py3-none-manylinux). Versions: calibration/wheels.txt, blank meaning the
# version installed in $PYTHON (default: python, i.e. the activated venv).
# Needs pip and a package index (the network, or a local mirror); writes nothing else.
# bitsandbytes is slimmed to its CPU and CUDA 12.6-13.x libraries (BNB_CUDA, default
# "126 128 130 132"; the H200's torch was built for CUDA 13.0): 19 MiB instead of 41.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
DEST=calibration/wheels
LIMIT_MIB="${LIMIT_MIB:-48}"   # a device call carries 64 MiB with the working tree: keep room
BNB_CUDA="${BNB_CUDA:-126 128 130 132}"
here="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
versions=("${@:-3.12}")
[[ " ${versions[*]} " == *" $here "* ]] || versions+=("$here")
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

installed() { "$PY" -c "import sys; from importlib import metadata; print(metadata.version(sys.argv[1]))" "$1" 2>/dev/null; }

rm -rf "$DEST.tmp"
mkdir -p "$DEST.tmp"
while read -r name kind version _; do
  [[ -z "$name" || "$name" == \#* ]] && continue
  version="${version:-$(installed "$name" || true)}"
  if [[ -z "$version" ]]; then
    echo "error: $name has no version in calibration/wheels.txt and is not installed in $PY" >&2
    exit 2
  fi
  echo "== $name==$version ($kind)" >&2
  case "$kind" in
    build)
      "$PY" -m pip wheel --quiet --no-deps --no-build-isolation "$name==$version" -w "$DEST.tmp" ;;
    py3)
      "$PY" -m pip download --quiet --no-deps --only-binary=:all: "$name==$version" -d "$DEST.tmp" ;;
    cp)
      for v in "${versions[@]}"; do
        "$PY" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version "$v" \
          "${PLATFORMS[@]}" "$name==$version" -d "$DEST.tmp"
      done ;;
    bnb)
      "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "${versions[0]}" \
        "${PLATFORMS[@]}" "$name==$version" -d "$DEST.tmp"
      "$PY" - "$DEST.tmp" "$BNB_CUDA" <<'PYEOF'
"""Rewrite the bitsandbytes wheel without the CUDA/ROCm/XPU libraries we do not keep (and RECORD to match)."""
import base64, hashlib, re, sys, zipfile
from pathlib import Path

dest, keep = Path(sys.argv[1]), set(sys.argv[2].split())
(wheel,) = dest.glob("bitsandbytes-*.whl")
lib = re.compile(r"libbitsandbytes_(\w+?)\.(so|dll|dylib)$")

def kept(name: str) -> bool:
    m = lib.search(name)
    return m is None or m.group(1) == "cpu" or (m.group(1).startswith("cuda") and m.group(1)[4:] in keep)

tmp = wheel.with_suffix(".slim")
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
    names = [n for n in src.namelist() if kept(n)]
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    lines = []
    for n in names:
        if n == record:
            continue
        data = src.read(n)
        out.writestr(src.getinfo(n), data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{n},sha256={digest},{len(data)}")
    lines.append(f"{record},,")
    out.writestr(record, "\n".join(lines) + "\n")
    dropped = sorted(set(src.namelist()) - set(names))
tmp.replace(wheel)
print(f"bitsandbytes: dropped {len(dropped)} libraries, kept cuda {' '.join(sorted(keep))} and cpu", file=sys.stderr)
PYEOF
      ;;
    *) echo "error: calibration/wheels.txt: unknown kind $kind for $name" >&2; exit 2 ;;
  esac
done < calibration/wheels.txt

rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
ls -l "$DEST" | awk 'NR > 1 {printf "%10.1f KiB  %s\n", $5 / 1024, $9}'
bytes=$(cat "$DEST"/*.whl | wc -c)
mib=$(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}')
echo "total: $mib MiB in $(ls "$DEST" | wc -l) wheels for Python ${versions[*]} (limit $LIMIT_MIB MiB; a device call carries 64 MiB)"
if awk -v b="$bytes" -v l="$LIMIT_MIB" 'BEGIN {exit !(b > l * 1048576)}'; then
  echo "error: the wheels take $mib MiB, more than $LIMIT_MIB MiB" >&2
  exit 1
fi
