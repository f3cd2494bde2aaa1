#!/usr/bin/env bash
# The GPU checks and benchmarks, as run on a lent H100/H200 (see bench/README.md). Usage, from the repo root:
#   bash bench/gpu_run.sh STAGE...     STAGE: env | tests | attention | sweep | sweep32 | fp32 | sp | kvp | engine
#                                             | engine1b | setup | staging | verify | stack | checks | backends | pack
# Results go to $OUT when set (the device tool's folder), else bench/results/. Each stage has its own time limit.
# The stack's stages need `setup` first (it installs once per machine, then only sets the paths) and .gpu/
# (bench/gpu_kit.sh) carried. One device call of under 10 minutes runs them all:
#   DEADLINE=$(($(date +%s)+570)) bash bench/gpu_run.sh env setup checks backends pack     (carry: [".gpu"])
# `checks` runs $CHECKS (default: stack verify staging) side by side (logs in $LOGS; each cut at $CHECKS_S, default
# 440 s; the stack on $LAYOUTS, default pd,sp-tp,kvp); `backends` runs alone after them, its budget cut to end by
# $DEADLINE (epoch seconds); `pack` puts the logs and verify summaries in $OUT/logs.tgz.
# DEV=cpu rehearses the stack's stages on a machine without a GPU.
set -u
export PYTHONPATH=libs/attention:libs/model:libs/engine${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
out=${OUT:-bench/results}
DEV=${DEV:-cuda}
LOGS=${LOGS:-/tmp/gpu-logs}
LAYOUTS=${LAYOUTS:-pd,sp-tp,kvp}   # the stack stage's layouts
CHECKS=${CHECKS:-stack verify staging}   # what `checks` runs side by side
mkdir -p "$out" "$LOGS"
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    env) nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
         python3 -c "import sys,torch,triton;print(sys.version.split()[0],torch.__version__,triton.__version__)"
         python3 -c "import torch;print('nccl', torch.cuda.nccl.version())"
         python3 -m pip list 2>/dev/null | grep -i -E "^(flash|vllm|nvidia-nccl|cupy)" || true
         command -v nvcc || echo "no nvcc" ;;
    tests) timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 libs/attention/tests/test_triton_kernels.py \
             libs/attention/tests/test_triton_compile.py 2>&1 | tail -25 ;;
    attention) timeout 300 python3 bench/bench_attention_gpu.py --out "$out/attention_gpu.json" ;;
    sweep) timeout 400 python3 bench/bench_attention_gpu.py --sweep --dtypes bf16 --seqlens 8192 32768 \
             --contexts 32768 131072 --batches 1 32 --out "$out/attention_gpu_sweep.json" ;;
    sweep32) timeout 300 python3 bench/bench_attention_gpu.py --sweep --dtypes fp32 --head-dims 64 128 \
               --seqlens 4096 16384 --skip-decode --out "$out/attention_gpu_sweep_fp32.json" ;;
    fp32) timeout 100 python3 bench/bench_attention_gpu.py --dtypes fp32 --head-dims 64 128 --seqlens 4096 16384 \
            --skip-decode --out "$out/attention_gpu_fp32.json" 2>&1 | grep "prefill fp32"
          timeout 200 python3 bench/bench_backends.py --device "$DEV" --dtypes fp32 --backends triton --budget-s 150 \
            --out "$out/backends_${DEV}_fp32.json" 2>&1 | grep -v "it/s\]" | tail -40 ;;
    sp) timeout 300 python3 bench/bench_sp_attention_gpu.py --out "$out/sp_attention_gpu.json" ;;
    kvp) timeout 300 python3 bench/bench_kvp_attention_gpu.py --out "$out/kvp_attention_gpu.json" ;;
    engine) timeout 300 python3 bench/bench_engine_gpu.py --out "$out/engine_gpu.json" ;;
    engine1b) timeout 300 python3 bench/bench_engine_gpu.py --shape llama-1b --out "$out/engine_gpu_llama1b.json" ;;
    setup) [ -d .gpu/wheels ] || { echo "no .gpu/wheels: run bench/gpu_kit.sh here and carry .gpu"; exit 2; }
           if [ ! -f /tmp/site/.spindle-kit ]; then
             python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
               .gpu/wheels/*.whl && touch /tmp/site/.spindle-kit || exit 2
           fi
           paths=/tmp/site; for d in libs/* services/*; do paths=$paths:$d; done
           export PYTHONPATH=$paths PATH=/tmp/site/bin:$PATH
           [ -f /tmp/gpu-model/model.safetensors ] || python3 bench/gpu_stack_check.py --kit .gpu/model-kit \
             --make-model /tmp/gpu-model ;;
    staging) timeout 300 python3 -m pytest -q -rs -p no:cacheprovider libs/attention/tests/test_distributed_staging.py \
               libs/attention/tests/test_distributed_comm_staging.py libs/transfer/tests/test_staging.py \
               libs/worker/tests/test_heartbeat.py libs/engine/tests/test_sp_verify.py libs/engine/tests/test_kvp_verify.py \
               libs/engine/tests/test_decode_graphs_cuda.py libs/engine/tests/test_engine_device.py \
               services/kvstore/tests/test_service.py \
               -k "cuda or staging or device" -rfE \
               2>&1 | tee "$LOGS/staging_pytest.log" | tail -30 ;;
    verify) python3 -c "import json,random;r=random.Random(0);print(json.dumps([r.randrange(1000,40000) for _ in range(1537)]))" \
              > /tmp/gpu-prompt.json
            for run in "0:700@0;700:@0,1 --decode-tp 2" "0:500@0,1;500:@0,1,2 --decode-tp 2" "0:700@0;700:@0,1 --kvp 2"; do
              plan=${run%% *}; name=$(echo "$run" | tr -c '0-9a-z' _)
              timeout 140 python3 -m spindle_engine.sp.verify --model /tmp/gpu-model --prompt-file /tmp/gpu-prompt.json \
                --plan "$plan" ${run#* } --device "$DEV" --dump-kv --max-new-tokens 8 --json "$LOGS/verify_$name.json" \
                2>&1 | tail -4
            done ;;
    stack) timeout 420 python3 bench/gpu_stack_check.py --device "$DEV" --model /tmp/gpu-model --layouts "$LAYOUTS" \
             --log-dir "$LOGS/stack" --out "$out/stack_$DEV.json" 2>&1 | grep -v "it/s\]\|req/s\]" | tail -40 ;;
    checks) for s in $CHECKS; do timeout "${CHECKS_S:-440}" bash "$0" setup $s > "$LOGS/$s.log" 2>&1 & done; wait
            for s in $CHECKS; do echo "--- $s"; grep -v "^=== " "$LOGS/$s.log" | tail -40; done ;;
    backends) budget=200; [ -n "${DEADLINE:-}" ] && budget=$((DEADLINE - $(date +%s) - 45))
              [ "$budget" -gt 200 ] && budget=200
              [ "$budget" -lt 20 ] && { echo "backends: no time left before DEADLINE"; continue; }
              timeout $((budget + 40)) python3 bench/bench_backends.py --device "$DEV" --budget-s $budget \
                --out "$out/backends_$DEV.json" 2>&1 | grep -v "it/s\\]" | tail -60 ;;
    pack) tar czf "$out/logs.tgz" -C "$LOGS" . 2>/dev/null; ls -la "$out" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
