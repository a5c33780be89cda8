#!/usr/bin/env bash
# The GPU check, as one run on a lent NVIDIA machine (the `device` tool), well inside its 15 minutes:
#   1. `pacer-bench device` at the Qwen2.5 0.5B / 1.5B / 7B shapes (random weights, bf16): for the model as loaded and
#      each way to exact verification, whether a call of 1..16 tokens and a prefill give bitwise the rows of single
#      steps, and the cost curve of 1..16 tokens (synchronized);
#   2. tests/gpu (every method against the exact target alone in bf16 and float32, sampling, the exact probe at the
#      0.5B / 1.5B shapes, the cost model on CUDA, streaming).
# Results land in $OUT (device/device.json and .md, the logs, nvidia-smi) and are committed under
# benchmarks/results/<date>-gpu-exact/.
#
# The GPU machine has transformers 5.17, older than pacer's range: the oldest release pacer supports travels as a
# wheel. Here, once, from the repository's root:
#   bash tests/gpu/device-check.sh --fetch-wheels      # transformers 5.23.0 into .whl/ (ignored by git)
# then the device tool's run: command "bash tests/gpu/device-check.sh", carry [".whl"], timeout_s 480.
set -uo pipefail
cd "$(dirname "$0")/../.."

if [ "${1:-}" = "--fetch-wheels" ]; then
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")" && { grep -qx "/.whl/" "$exclude" 2>/dev/null || echo "/.whl/" >> "$exclude"; }
    exec python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl transformers==5.23.0
fi

OUT=${OUT:-device-out}
mkdir -p "$OUT/device"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "device-check: no wheels in .whl/ (run with --fetch-wheels here, carry .whl)"; exit 2; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())' \
    | tee "$OUT/versions.txt"

status=0
timeout 200 python3 -m modeling_pacer.benchmarks.cli device --shapes 0.5b 1.5b 7b --rows 16 --prefixes 37 256 \
    --repeats 5 --out "$OUT/device" > "$OUT/device.log" 2>&1 || status=$?
tail -30 "$OUT/device.log"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/gpu-tests.log" 2>&1 || status=$((status ? status : $?))
tail -30 "$OUT/gpu-tests.log"
exit $status
