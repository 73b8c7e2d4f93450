#!/usr/bin/env bash
# Measure calibration/gpu-sweep.yaml on one CUDA GPU and write the records to $OUT.
#
#   OUT=/some/dir bash calibration/gpu_sweep.sh [BUDGET]      (from anywhere; BUDGET default 7m)
#
# For a machine whose Python has torch (CUDA), transformers, accelerate and peft, but not
# bitsandbytes, deepspeed or nvidia-ml-py, and no network: those are installed from wheels
# carried in calibration/wheels/ (git-ignored). Build them on a machine with the same Python
# version and platform (see docs/commands/measure.md):
#   pip wheel --no-deps --no-build-isolation deepspeed -w calibration/wheels
#   pip download --only-binary :all: --no-deps --python-version 3.11 --platform manylinux_2_24_x86_64 \
#       bitsandbytes nvidia-ml-py hjson msgpack ninja py-cpuinfo -d calibration/wheels
#
# Writes to $OUT: measurements/*.jsonl (one record per run), coefficients.json (the fit),
# sweep.json (the sweep's summary), environment.txt (nvidia-smi, pip freeze).
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the directory the records are written to}"
BUDGET="${1:-7m}"
WHEELS=calibration/wheels
PY="${PYTHON:-python}"
mkdir -p "$OUT/measurements"

"$PY" -c "import torch, transformers, accelerate, peft; assert torch.cuda.is_available(), 'no CUDA device'"

missing=()
for spec in bitsandbytes:bitsandbytes deepspeed:deepspeed nvidia-ml-py:pynvml hjson:hjson msgpack:msgpack \
            ninja:ninja py-cpuinfo:cpuinfo; do
  if ! "$PY" -c "import ${spec#*:}" 2>/dev/null; then missing+=("${spec%%:*}"); fi
done
if ((${#missing[@]})); then
  echo "installing from $WHEELS: ${missing[*]}" >&2
  "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" "${missing[@]}"
fi
"$PY" -m pip install --quiet --no-deps --no-build-isolation -e .

{ nvidia-smi || true; "$PY" -m pip freeze; } > "$OUT/environment.txt" 2>&1

# PYTORCH_CUDA_ALLOC_CONF is left as the caller set it; every record notes its value.
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

"$PY" -m vramplan sweep calibration/gpu-sweep.yaml --budget "$BUDGET" --records "$OUT/measurements" --json \
  > "$OUT/sweep.json"
"$PY" -m vramplan calibrate --records "$OUT/measurements" --out "$OUT/coefficients.json"
echo "records: $OUT/measurements  coefficients: $OUT/coefficients.json" >&2
