#!/usr/bin/env bash
# The GPU checklist (issue 32) in stages, for a lent GPU machine that has no network and takes at
# most 64 MiB per call: the SmolLM2 GGUF (98 MB) travels in three parts, one per stage, kept in
# /root/parts between calls while the machine stays warm.
#
#   stage 1: GPU tests (tests/test_gpu.py), plain decode and verification against the bandwidth
#            limit at 1B/3B/8B with random weights (benchmarks/gpu_decode.py, HF generate() peer)
#   stage 2: the whole default suite with CUDA visible (real-model tests skip: no GGUF yet)
#   stage 3: the GGUF joined and checked; eaglespec bench on SmolLM2 + the shipped head on CUDA,
#            the server at 1 and 16 streams, then head training at scale on the GPU
#
# Run from the repository root on the device: bash benchmarks/gpu_check.sh STAGE
# with .whl/ (the wheels the image lacks), .gpu/pN/part, .gpu/eval and .gpu/train carried
# (stage 1: .whl .gpu/p1; stage 2: .whl .gpu/p2; stage 3: .whl .gpu/p3 .gpu/eval .gpu/train).
# Prepared here, both folders listed in .git/info/exclude:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .whl gguf platformdirs fastapi starlette pydantic \
#     pydantic_core annotated_types annotated-doc typing_inspection uvicorn opentelemetry-api
#   G=$(eaglespec pull smollm2-135m | tail -1); mkdir -p .gpu/p1 .gpu/p2 .gpu/p3 .gpu/eval .gpu/train
#   dd if=$G of=.gpu/p1/part bs=1M count=36; dd if=$G of=.gpu/p2/part bs=1M skip=36 count=36
#   dd if=$G of=.gpu/p3/part bs=1M skip=72; cp ../shared/data/eval/*.jsonl .gpu/eval
#   cp ../shared/data/train/* .gpu/train
# Each stage must start within the machine's 30 s idle window of the last, or the parts are lost.
set -uo pipefail
stage=$1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /root/parts
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
cp .gpu/p$stage/part /root/parts/p$stage 2>/dev/null
ls -la /root/parts

eaglespec() { python3 -m eaglespec "$@"; }

if [ "$stage" = 1 ]; then
    nvidia-smi -L
    python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
    timeout 150 python3 -m pytest tests/test_gpu.py -m gpu -q -p no:cacheprovider 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -30
    timeout 240 python3 benchmarks/gpu_decode.py --peer 2>&1 | tee "$OUT/gpu_decode.log"
fi

if [ "$stage" = 2 ]; then
    export EAGLESPEC_TEST_GGUF=/nonexistent.gguf
    timeout 280 python3 -m pytest -q -n 14 -p no:cacheprovider --timeout 200 2>&1 \
        | tee "$OUT/suite.log" | tail -40
fi

if [ "$stage" = 3 ]; then
    M=/root/.cache/eaglespec/models/smollm2-135m
    mkdir -p $M
    cat /root/parts/p1 /root/parts/p2 /root/parts/p3 >$M/SmolLM2-135M-Instruct.Q4_1.gguf
    sha256sum $M/SmolLM2-135M-Instruct.Q4_1.gguf
    export EAGLESPEC_TEST_GGUF=$M/SmolLM2-135M-Instruct.Q4_1.gguf
    timeout 100 python3 -m eaglespec bench --questions .gpu/eval/*.jsonl --limit 4 --max-tokens 128 \
        --methods plain eagle3-chain eagle3-tree --group-by file --num-draft 3 \
        --device cuda --dtype bfloat16 --quant none --out /root/bench --quiet 2>&1 | tail -30
    cp /root/bench/report.md /root/bench/results.json "$OUT/" 2>/dev/null
    [ -z "${SKIP_SERVE:-}" ] && timeout 90 python3 benchmarks/serve_load.py --dtype bfloat16 --device cuda --clients 1,16 \
        --requests 2 --max-tokens 64 --modes off,on 2>&1 | tail -20
    timeout ${TRAIN_SECONDS:-240} python3 -m eaglespec train --target smollm2-135m --device cuda \
        --target-dtype bfloat16 --target-quant none \
        --data .gpu/train/gsm8k_train.jsonl .gpu/train/alpaca_seed_tasks.jsonl \
        .gpu/train/sharegpt_format_dummy_conversation.json --variants code=0.3 \
        --synth-prompts 3000 --summaries 500 --seed 7 --init-from src/eaglespec/heads/smollm2-135m \
        --draft-vocab 8192 --ttt-steps 4 --epochs 1 --batch-tokens 8192 --lr 4e-4 \
        --warmup-steps 20 --heldout 0.02 --eval-prompts 8 --eval-max-tokens 128 \
        --out /root/head6 2>&1 | tail -40
    ls -la /root/head6 /root/head6/work 2>/dev/null
    if [ -f /root/head6/model.safetensors ]; then
        mkdir -p "$OUT/head6"
        split -b 12M /root/head6/model.safetensors "$OUT/head6/model.safetensors.part"
        cp /root/head6/config.json /root/head6/train_report.json "$OUT/head6/" 2>/dev/null
    fi
fi
