#!/usr/bin/env bash
# Measure calibration/gpu-sweep.yaml on one CUDA GPU and write the records to $OUT.
#
#   OUT=/some/dir bash calibration/gpu_sweep.sh [BUDGET]          (from anywhere; BUDGET default 7m)
#   OUT=/tmp/rehearsal REHEARSE=cpu bash calibration/gpu_sweep.sh  (the same steps on this CPU machine)
#
# For a machine whose python3 has torch (CUDA), transformers, accelerate and peft, but maybe not
# bitsandbytes, deepspeed, nvidia-ml-py or DeepSpeed's small dependencies, and no network: what
# is missing of calibration/wheels.txt is installed from the wheels carried in
# calibration/wheels/ (git-ignored; `bash calibration/build_wheels.sh` makes them here).
# docs/commands/measure.md ("Running the GPU sweep") has the device call that runs this.
#
# Writes to $OUT (what a device call brings back: few files, at most two folders down):
#   measurements/<gpu>.jsonl  one record per run          sweep.json        the sweep's summary
#   coefficients.json         the fit (vramplan calibrate) environment.txt   nvidia-smi, versions, pip freeze
#   plan.txt                  the runs in order with their predicted seconds (sweep --dry-run)
# Exit status: the sweep's (0 when it ran; failed runs are records, not errors).
#
# REHEARSE=cpu: a CPU rehearsal of every step above. A fresh venv ($REHEARSE_VENV, default
# /tmp/vramplan-rehearse-venv, made once from this machine's package index) holds only what the
# H200 image has (torch 2.13.0 CPU, transformers 5.17.0, accelerate 1.15.0, peft 0.21.0, click,
# rich, pyyaml, numpy, setuptools, wheel); everything the previous rehearsal installed from the
# wheels is uninstalled again, then the same install, the same editable install of vramplan, the
# same dry run of the real matrix, and a sweep of a CPU-sized slice of it (runs scaled down to 2
# layers and 128 tokens, the emulated-card runs left out: CPU cannot cap CUDA's allocator;
# REHEARSE_RUNS=all or a comma-separated list of names chooses the slice) and calibrate.
set -euo pipefail

# The whole script is one function, read completely before it starts: editing this file while it
# runs cannot change what runs.
main() {
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the directory the records are written to}"
BUDGET="${1:-7m}"
WHEELS=calibration/wheels
MATRIX=calibration/gpu-sweep.yaml
REHEARSE="${REHEARSE:-}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# PYTORCH_CUDA_ALLOC_CONF is left as the caller set it; every record notes its value.
# One GPU, one process group of one rank: NCCL's bootstrap needs no network interface but lo.
export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-lo}"
# The tree a device call sends has no .git: the records take the commit from here if given.
export VRAMPLAN_COMMIT="${VRAMPLAN_COMMIT:-}"
started=$SECONDS
log() { echo "[gpu_sweep +$((SECONDS - started))s] $*" >&2; }
mkdir -p "$OUT/measurements"

# distributions named in calibration/wheels.txt
mapfile -t WANTED < <(awk '!/^[[:space:]]*(#|$)/ {print $1}' calibration/wheels.txt)

case "$REHEARSE" in
  "")
    PY="${PYTHON:-python3}"
    DEVICE=cuda ;;
  cpu)
    VENV="${REHEARSE_VENV:-/tmp/vramplan-rehearse-venv}"
    BASE=(torch==2.13.0 transformers==5.17.0 accelerate==1.15.0 peft==0.21.0 click rich pyyaml numpy setuptools wheel)
    if [[ ! -f "$VENV/.vramplan-base" ]]; then
      log "rehearsal: making $VENV (${BASE[*]})"
      rm -rf "$VENV"
      "${REHEARSE_PYTHON:-python3}" -m venv "$VENV"
      "$VENV/bin/python" -m pip install --quiet "${BASE[@]}"
      # what the base pulled in of the carried list (typer pulls pydantic here, not on the H200) goes,
      # so that every carried wheel is installed by the rehearsal; torch needs typing-extensions
      mapfile -t pulled < <(printf '%s\n' "${WANTED[@]}" | grep -vx typing-extensions)
      "$VENV/bin/python" -m pip uninstall --quiet --yes "${pulled[@]}" 2>/dev/null || true
      "$VENV/bin/python" -m pip list --format=freeze | sed 's/==.*//' | sort > "$VENV/.vramplan-base"
    fi
    mapfile -t extra < <(comm -13 "$VENV/.vramplan-base" <("$VENV/bin/python" -m pip list --format=freeze | sed 's/==.*//' | sort))
    if ((${#extra[@]})); then
      log "rehearsal: uninstalling what the last rehearsal added: ${extra[*]}"
      "$VENV/bin/python" -m pip uninstall --quiet --yes "${extra[@]}"
    fi
    PY="$VENV/bin/python"
    # its own torch extension builds (CPU Adam): a shared cache is rebuilt by every other venv
    export TORCH_EXTENSIONS_DIR="$VENV/torch_extensions"
    # one compiler at a time: two cores and little memory (cc1plus was OOM-killed with four)
    export MAX_JOBS="${MAX_JOBS:-1}"
    DEVICE=cpu ;;
  *)
    echo "error: REHEARSE must be cpu or unset; got '$REHEARSE'" >&2
    exit 2 ;;
esac

log "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
"$PY" - "$DEVICE" <<'EOF'
import sys
import accelerate, peft, torch, transformers
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
      f"accelerate {accelerate.__version__}, peft {peft.__version__}", file=sys.stderr)
if sys.argv[1] == "cuda":
    assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device"
    print(f"GPU: {torch.cuda.get_device_name(0)}", file=sys.stderr)
EOF

# --- what is missing, from the carried wheels (never from a network: there is none) ----------
missing=()
for name in "${WANTED[@]}"; do
  "$PY" -c "import sys; from importlib import metadata; metadata.version(sys.argv[1])" "$name" 2>/dev/null \
    || missing+=("$name")
done
if ((${#missing[@]})); then
  if [[ ! -d "$WHEELS" ]]; then
    log "warning: $WHEELS is not here (carry it); not installed: ${missing[*]}"
  else
    log "installing from $WHEELS: ${missing[*]}"
    if ! "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" "${missing[@]}"; then
      log "warning: installing them together failed; one by one"
      for name in "${missing[@]}"; do
        "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" "$name" || log "warning: $name not installed"
      done
    fi
  fi
fi
"$PY" -m pip install --quiet --no-index --no-deps --no-build-isolation -e .
for mod in bitsandbytes deepspeed pynvml; do  # report, don't stop: runs needing a broken one fail as records
  if ! err=$("$PY" -c "import $mod" 2>&1); then log "warning: import $mod failed: $(tail -n 1 <<<"$err")"; fi
done

{
  echo "# date: $(date -u +%FT%TZ)  rehearse: ${REHEARSE:-no}  budget: $BUDGET"
  nvidia-smi 2>&1 || echo "(no nvidia-smi)"
  "$PY" --version
  "$PY" -c "import os, sysconfig; i = sysconfig.get_paths()['include']; print('Python.h:', os.path.exists(os.path.join(i, 'Python.h')), i)"
  for tool in nvcc g++ ninja; do echo "$tool: $(command -v "$tool" || echo missing)"; done
  "$PY" -m pip freeze
} > "$OUT/environment.txt" 2>&1

# DeepSpeed compiles its CPU Adam (ZeRO-Offload runs) on first use: build it now, in the
# background, so that the offload runs find it built (they wait on torch's build lock if not).
# A build killed earlier (a run stopped at its timeout while compiling) leaves torch's lock file,
# and every later build of that op waits on it forever: nothing builds yet, so remove them.
find "${TORCH_EXTENSIONS_DIR:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/torch_extensions}" -name lock -type f -delete 2>/dev/null || true
cpu_adam=""
if "$PY" -c "import deepspeed" 2>/dev/null; then
  # no timeout: torch's build lock stays behind a killed build, and every offload run would wait on it
  # (on the CPU rehearsal also the shared-memory collectives DeepSpeed's CPU accelerator builds)
  "$PY" -c "from deepspeed.accelerator import get_accelerator
for name in ('CPUAdamBuilder', 'ShareMemCommBuilder'):
    builder = get_accelerator().create_op_builder(name)
    if builder is not None and (name == 'CPUAdamBuilder' or get_accelerator().device_name() == 'cpu'):
        builder.load()
        print(name, 'built', flush=True)" > /tmp/vramplan-cpu-adam.log 2>&1 &
  cpu_adam=$!
fi

# --- the sweep ---------------------------------------------------------------------------------
if [[ "$DEVICE" == cpu ]]; then
  matrix="$(mktemp -d)/rehearse-sweep.yaml"
  "$PY" - "$MATRIX" "$matrix" "${REHEARSE_RUNS:-}" <<'EOF'
"""The CPU slice of the GPU matrix: same setups, scaled down, no emulated cards."""
import sys
import yaml

src, dst, names = sys.argv[1], sys.argv[2], sys.argv[3]
data = yaml.safe_load(open(src))
default = ["smollm2-135m-full", "smollm2-360m-full-s4096-ckpt", "qwen2-0.5b-lora", "gemma3-1b-lora-b4s1024",
           "smollm2-360m-qlora", "qwen2-0.5b-adamw8bit", "qwen2-0.5b-paged-adamw8bit", "qwen2-0.5b-zero2-offload",
           "qwen2-0.5b-zero3-offload-all"]
chosen = None if names == "all" else set(names.split(",") if names else default)
runs = []
for run in data["runs"]:
    if run.get("emulate_gpu") or (chosen is not None and run["name"] not in chosen):
        continue
    setup = dict(run.get("setup") or {})
    setup.update(seq=128, batch=min(int(setup.get("batch", data["defaults"].get("batch", 1))), 2))
    runs.append({**run, "scale_down": True, "setup": setup})
missing = (chosen or set()) - {r["name"] for r in runs}
if missing:
    sys.exit(f"error: REHEARSE_RUNS names no CPU run of {src}: {', '.join(sorted(missing))}")
yaml.safe_dump({"device": "cpu", "steps": data.get("steps", 3), "timeout": 480, "defaults": data["defaults"],
                "runs": runs}, open(dst, "w"), sort_keys=False)
print(f"rehearsal matrix: {len(runs)} runs of {src}", file=sys.stderr)
EOF
else
  matrix="$MATRIX"
fi
"$PY" -m vramplan sweep "$MATRIX" --device cuda --dry-run --budget "$BUDGET" > "$OUT/plan.txt" \
  || log "warning: the dry run of $MATRIX failed"
cat "$OUT/plan.txt" >&2
log "sweep of $matrix, budget $BUDGET"
set +e
"$PY" -m vramplan sweep "$matrix" --budget "$BUDGET" --records "$OUT/measurements" --skip-unavailable --json \
  > "$OUT/sweep.json"
status=$?
set -e
log "sweep exit status $status: $(head -c 300 "$OUT/sweep.json" | tr -d '\n')"
"$PY" -m vramplan calibrate --records "$OUT/measurements" --out "$OUT/coefficients.json" >&2 \
  || log "warning: calibrate failed"
if [[ "$DEVICE" == cuda ]] && "$PY" -c "import pytest" 2>/dev/null; then  # NVML and the emulated card, ~10 s
  timeout 120 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rA tests/test_gpu_sweep.py >&2 \
    || log "warning: the GPU checks of tests/test_gpu_sweep.py failed"
fi
if [[ -n "$cpu_adam" ]]; then
  kill "$cpu_adam" 2>/dev/null || true  # done by now, or of no use any more
  log "CPU Adam build: $(tail -n 2 /tmp/vramplan-cpu-adam.log | tr '\n' ' ')"
fi
log "done: records in $OUT/measurements, coefficients in $OUT/coefficients.json"
exit "$status"
}

main "$@"
