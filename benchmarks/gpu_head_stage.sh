#!/usr/bin/env bash
# A stage of the SmolLM2 head trained on a lent GPU machine (no network, at most 64 MiB a call:
# working tree and carried paths together), in two calls on the same warm machine (30 s idle):
#
#   stage 1 (carries .whl .gpu/pa .gpu/head): the wheels the image lacks installed in /root/site,
#            the GGUF's first part and the head to continue kept under /root
#   stage 2 (carries .gpu/pb .gpu/train): the GGUF joined and checked; `eaglespec train` writes
#            prompts for SYNTH_S seconds and answers them for REGEN_S (features taken while
#            answering, dense bf16 on the GPU), then, in a second run over the same folder,
#            trains for at most TRAIN_S seconds from the shipped head; the head, the data made
#            (prompts, answers) and both reports come back under $OUT as one tarball in 15 MiB
#            parts (a fetched file is at most 16 MiB), with the two logs beside it
#
# Run from the repository root on the device: bash benchmarks/gpu_head_stage.sh STAGE
# Prepared here, with /.whl/ and /.gpu/ in .git/info/exclude, and every head's model.safetensors
# out of the index for the two calls (`git rm --cached` and listed in .git/info/exclude; `git
# reset` after), so that the tree is 3.4 MB:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .whl gguf==0.19.0 platformdirs
#   G=$(eaglespec pull smollm2-135m | tail -1); mkdir -p .gpu/pa .gpu/pb .gpu/head .gpu/train
#   dd if=$G of=.gpu/pa/part bs=1M count=40; dd if=$G of=.gpu/pb/part bs=1M skip=40
#   cp src/eaglespec/heads/smollm2-135m/{config.json,model.safetensors} .gpu/head
#   cp ../shared/data/train/* .gpu/train
# Back here: cat parts > stage.tgz; tar xzf stage.tgz (head/, data/, report_regen.json).
# Stage 2 reads DATA (the prompt files' names), LR2 (a second head trained at that rate at the
# same time), SEED, SKIP and LIMIT (the questions taken: --skip-per-file, --limit-per-file),
# SYNTH_S, REGEN_S, TRAIN_S and TOTAL_S (seconds), and the sizes below from the environment.
set -uo pipefail
stage=$1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=/root/site:$PWD/src PYTHONUNBUFFERED=1
T0=$(date +%s)
left() { echo $(($1 - ($(date +%s) - T0))); } # seconds of a budget $1 still left

if [ "$stage" = 1 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /root/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
    mkdir -p /root/parts && cp .gpu/pa/part /root/parts/pa && rm -rf /root/head_init \
        && cp -r .gpu/head /root/head_init
    nvidia-smi -L
    python3 -c "import torch, gguf; print(torch.__version__, torch.cuda.get_device_name())"
    ls -la /root/parts /root/head_init
fi

if [ "$stage" = 2 ]; then
    [ -f /root/parts/pa ] || { echo "stage 1's machine is gone"; exit 3; }
    G=/root/SmolLM2-135M-Instruct.Q4_1.gguf
    cat /root/parts/pa .gpu/pb/part >$G
    echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" \
        | sha256sum -c || exit 4
    W=/root/stage
    D=.gpu/train
    # DATA: the prompt files in .gpu/train (GSM8K's training questions, the Alpaca seed tasks and
    # the ShareGPT-format conversations unless named)
    read -ra FILES <<<"${DATA:-gsm8k_train.jsonl alpaca_seed_tasks.jsonl sharegpt_format_dummy_conversation.json}"
    ARGS=(--target "$G" --device cuda --target-dtype bfloat16 --target-quant none
        --data "${FILES[@]/#/$D/}"
        --variants code=0.3 --skip-per-file "${SKIP:-0}" --limit-per-file "${LIMIT:-3000}"
        --synth-prompts "${SYNTH:-12000}" --synth-steer tasks
        --summaries "${SUMMARIES:-1500}" --completions "${COMPLETIONS:-800}"
        --answer-rows "${ROWS:-512}" --answer-tokens "${ROW_TOKENS:-400000}"
        --regen-max-samples "${MAX_SAMPLES:-9000}"
        --init-from /root/head_init --draft-vocab 8192 --ttt-steps 4 --epochs 1
        --batch-tokens 8192 --lr "${LR:-6e-4}" --warmup-steps 30 --heldout 0.02
        --seed "${SEED:-11}" --out $W)
    SYNTH_S=${SYNTH_S:-70} REGEN_S=${REGEN_S:-190} TRAIN_S=${TRAIN_S:-140}
    timeout "$(left $((SYNTH_S + REGEN_S + 60)))" python3 -m eaglespec train "${ARGS[@]}" \
        --synth-seconds "$SYNTH_S" --regen-seconds "$REGEN_S" --stop-after regen \
        >"$OUT/log_regen" 2>&1
    echo "regen exit $? after $(($(date +%s) - T0)) s"
    tail -5 "$OUT/log_regen"
    mkdir -p /root/ret/data
    cp $W/train_report.json /root/ret/report_regen.json
    cp $W/work/responses.jsonl $W/work/synth_prompts.jsonl /root/ret/data/
    # the second run answers nothing (its deadlines have passed) and trains on what is there
    # LR2: a second head trained at that rate at the same time, over a linked copy of the folder
    t=$(left ${TOTAL_S:-530})
    ts=$((t - 60 < TRAIN_S ? t - 60 : TRAIN_S))
    if [ -n "${LR2:-}" ]; then
        mkdir -p /root/stage2 && cp -al $W/work /root/stage2/ && rm -f /root/stage2/work/checkpoint.pt
        timeout "$t" python3 -m eaglespec train "${ARGS[@]}" --synth-seconds 0 --regen-seconds 0 \
            --train-seconds "$ts" --stop-after train --lr "$LR2" --out /root/stage2 \
            >"$OUT/log_train2" 2>&1 &
        pid2=$!
    fi
    timeout "$t" python3 -m eaglespec train "${ARGS[@]}" --synth-seconds 0 --regen-seconds 0 \
        --train-seconds "$ts" --stop-after train >"$OUT/log_train" 2>&1
    echo "train exit $? after $(($(date +%s) - T0)) s"
    if [ -n "${LR2:-}" ]; then
        wait "$pid2"
        echo "train (LR2) exit $? after $(($(date +%s) - T0)) s"
    fi
    tail -12 "$OUT/log_train"
    [ -n "${LR2:-}" ] && tail -4 "$OUT/log_train2"
    [ -f $W/model.safetensors ] && mkdir -p /root/ret/head \
        && cp $W/config.json $W/model.safetensors $W/train_report.json /root/ret/head/
    [ -f /root/stage2/model.safetensors ] && mkdir -p /root/ret/head2 \
        && cp /root/stage2/{config.json,model.safetensors,train_report.json} /root/ret/head2/
    tar -C /root/ret -cf - . | gzip -1 >/root/stage.tgz
    split -b 15M -d /root/stage.tgz "$OUT/stage.tgz.part"
    ls -la "$OUT"
fi
