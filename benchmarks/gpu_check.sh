#!/usr/bin/env bash
# The GPU checklist (issue 32) in two calls, for a lent GPU machine that has no network and takes at
# most 64 MiB per call (working tree and carried paths together). The SmolLM2 GGUF (98 MB) travels
# in two parts, kept in /root/parts between the calls while the machine stays warm (30 s idle);
# the wheels the image lacks travel with the first and stay installed in /root/site.
#
#   stage 1: the GPU tests (tests/test_gpu.py, the sampled-distribution test on CUDA), plain decode
#            and verification against the bandwidth limit at 1B/3B/8B with random weights
#            (benchmarks/gpu_decode.py, HF generate() as the peer), then the 1B step compiled whole
#   stage 2: the GGUF joined and checked; eaglespec bench on SmolLM2 + the shipped head on CUDA,
#            the server at 1 and 16 streams, then a head-training stage on the GPU for the time left
#
# Run from the repository root on the device: bash benchmarks/gpu_check.sh STAGE
# stage 1 carries .whl .gpu/pa; stage 2 carries .gpu/pb .gpu/eval .gpu/train. Only the SmolLM2
# head may travel (the tree's limit): stage 1 leaves every head out, stage 2 only the Qwen and
# Gemma heads (git rm --cached them and list them in .git/info/exclude for the call, then
# `git reset`). Prepared here, .whl/ and .gpu/ listed in .git/info/exclude:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .whl gguf platformdirs fastapi starlette pydantic \
#     pydantic_core annotated_types annotated-doc typing_inspection uvicorn opentelemetry-api
#   G=$(eaglespec pull smollm2-135m | tail -1); mkdir -p .gpu/pa .gpu/pb .gpu/eval .gpu/train
#   dd if=$G of=.gpu/pa/part bs=1M count=56; dd if=$G of=.gpu/pb/part bs=1M skip=56
#   cp ../shared/data/eval/*.jsonl .gpu/eval
#   cp ../shared/data/train/{alpaca_seed_tasks.jsonl,sharegpt_format_dummy_conversation.json} .gpu/train
set -uo pipefail
stage=$1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /root/parts
export PYTHONPATH=/root/site:$PWD/src:$PWD/tests PYTHONUNBUFFERED=1
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }  # seconds of a stage's budget $1 still left

if [ "$stage" = 1 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /root/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
    cp .gpu/pa/part /root/parts/pa
    nvidia-smi -L
    python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
    timeout 100 python3 -m pytest tests/test_gpu.py tests/test_spec_distribution.py -q \
        -p no:cacheprovider -n 8 -m "not slow and not compile" 2>&1 \
        | tee "$OUT/gpu_tests.log" | tail -25
    timeout 170 python3 benchmarks/gpu_decode.py --peer --repeats 3 2>&1 \
        | tee "$OUT/gpu_decode.log"
    t=$(left 285)
    [ "$t" -gt 30 ] && timeout "$t" python3 benchmarks/gpu_decode.py --sizes 1b --compile full \
        --repeats 3 --verify 1 4 16 64 2>&1 | tee "$OUT/gpu_decode_compiled.log"
fi

if [ "$stage" = 2 ]; then
    ls -la /root/parts /root/site >/dev/null || { echo "stage 1's machine is gone"; exit 3; }
    M=/root/.cache/eaglespec/models/smollm2-135m
    mkdir -p $M
    cat /root/parts/pa .gpu/pb/part >$M/SmolLM2-135M-Instruct.Q4_1.gguf
    sha256sum $M/SmolLM2-135M-Instruct.Q4_1.gguf
    export EAGLESPEC_TEST_GGUF=$M/SmolLM2-135M-Instruct.Q4_1.gguf
    timeout 110 python3 -m eaglespec bench --questions .gpu/eval/*.jsonl --limit 4 \
        --max-tokens 128 --methods plain eagle3-chain eagle3-tree --group-by file \
        --num-draft 3 --device cuda --dtype bfloat16 --quant none --out /root/bench --quiet 2>&1 \
        | tail -30
    cp /root/bench/report.md /root/bench/results.json "$OUT/" 2>/dev/null
    timeout 80 python3 benchmarks/serve_load.py --dtype bfloat16 --quant none --device cuda \
        --clients 1,16 --requests 2 --max-tokens 64 --modes off,on 2>&1 | tail -20
    t=$(left ${STAGE2_SECONDS:-420})
    [ "$t" -gt 60 ] && timeout "$t" python3 -m eaglespec train --target smollm2-135m \
        --device cuda --target-dtype bfloat16 --target-quant none \
        --data .gpu/train/alpaca_seed_tasks.jsonl .gpu/train/sharegpt_format_dummy_conversation.json \
        --variants code=0.3 --synth-prompts ${SYNTH:-1500} --seed 11 \
        --init-from src/eaglespec/heads/smollm2-135m --draft-vocab 8192 --ttt-steps 4 \
        --epochs 1 --batch-tokens 8192 --lr 2e-4 --warmup-steps 20 --heldout 0.02 \
        --eval-prompts 8 --eval-max-tokens 128 --out /root/head7 2>&1 | tail -40
    if [ -f /root/head7/model.safetensors ]; then
        mkdir -p "$OUT/head7"
        split -b 12M /root/head7/model.safetensors "$OUT/head7/model.safetensors.part"
        cp /root/head7/config.json /root/head7/train_report.json "$OUT/head7/" 2>/dev/null
    fi
fi
