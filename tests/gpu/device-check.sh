#!/usr/bin/env bash
# The GPU check, as one run on a lent NVIDIA machine (the `device` tool), inside its 15 minutes (each part has its own
# time limit, about 8 minutes in all, and leaves what it measured in $OUT even when a later part runs out):
#   1. `pacer-bench device` at the Qwen2.5 0.5B / 1.5B / 7B shapes (random weights, bf16): for the model as loaded,
#      the exact fixed-row target, and both with their steps captured (CUDA graphs over a static cache, torch's
#      "cudagraphs" backend: compiled in seconds), whether a call of 1..16 tokens and a prefill give bitwise the rows
#      of single steps, the synchronized cost curve of 1..16 tokens, and the kernels' own time of a step (profiler);
#   2. tests/gpu (every method against the exact target alone in bf16 and float32, with steps eager and captured,
#      sampling, the exact probe at the 0.5B / 1.5B shapes, the cost model on CUDA, streaming, a left-padded batch
#      each row its own output alone);
#   3. end to end at the 1.5B shape: PACER against the exact target alone, eager and captured (a draft of the
#      target's first 4 layers), and the other two exact ways' curves at the 1.5B shape (rows alone, eager attention);
#   4. the 0.5B shape captured by inductor (capture's default, mode="reduce-overhead"): its compile time and curve.
# Results land in $OUT (device/, e2e/, inductor/, rest/: device.json and .md; the logs; nvidia-smi) and are
# committed under benchmarks/results/<date>-gpu/.
#
# The GPU machine has transformers 5.17, older than pacer's range: the oldest release pacer supports travels as a
# wheel. Here, once, from the repository's root:
#   bash tests/gpu/device-check.sh --fetch-wheels      # transformers 5.23.0 into .whl/ (ignored by git)
# then the device tool's run: command "bash tests/gpu/device-check.sh", carry [".whl"], timeout_s 540.
# `bash tests/gpu/device-check.sh --cpu-dry-run` runs the same parts here on the CPU (tiny shape), a few minutes.
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
# --cpu-dry-run: every part here on the CPU, at the tiny shape, with the installed packages: the script's plumbing
# checked before a GPU's minutes are spent on it
if [ "${1:-}" = "--cpu-dry-run" ]; then
    DEVICE=cpu SHAPES=tiny BIG=tiny SMALL=tiny LAYERS=1 TESTS="captured_steps and cudagraphs and dtype0"
    export PACER_GPU_TESTS_DEVICE=cpu PYTHONPATH=$PWD PYTHONUNBUFFERED=1
else
    DEVICE=cuda SHAPES="0.5b 1.5b 7b" BIG=1.5b SMALL=0.5b LAYERS=4 TESTS=""
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "device-check: no wheels in .whl/ (run with --fetch-wheels here, carry .whl)"; exit 2; }
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
fi
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")' \
    | tee "$OUT/versions.txt"

status=0
part() {  # part NAME SECONDS COMMAND...: run one part under its own limit, its log in $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc in $((SECONDS - start)) s (limit $limit)" | tee -a "$OUT/parts.txt"
    tail -25 "$OUT/$name.log"
    if [ $rc -ne 0 ] && [ $status -eq 0 ]; then status=$rc; fi  # the first part that failed decides the exit
}
bench="python3 -m modeling_pacer.benchmarks.cli device --device $DEVICE --rows 16 --prefixes 37 256 --repeats 5"
part device 170 $bench --shapes $SHAPES --settings plain fixed-rows captured fixed-rows-captured \
    --capture-backend cudagraphs --out "$OUT/device"
part gpu-tests 150 python3 -m pytest -q -p no:cacheprovider tests/gpu ${TESTS:+-k "$TESTS"}
part e2e 90 $bench --shapes $BIG --settings fixed-rows-eager rows-alone --e2e $BIG --draft-layers $LAYERS \
    --capture-backend cudagraphs --out "$OUT/e2e"
part inductor 60 $bench --shapes $SMALL --settings captured --capture-backend inductor --out "$OUT/inductor"
exit $status
