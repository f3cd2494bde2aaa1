#!/usr/bin/env bash
# The GPU checks and benchmarks, as run on a lent H100/H200 (see bench/README.md). Usage, from the repo root:
#   bash bench/gpu_run.sh STAGE...     STAGE: env | tests | attention | sweep | sp | kvp | engine | engine1b
# Results go to $OUT when set (the device tool's folder), else bench/results/. Each stage has its own time limit.
set -u
export PYTHONPATH=libs/attention:libs/model:libs/engine${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
out=${OUT:-bench/results}
mkdir -p "$out"
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    env) nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
         python3 -c "import sys,torch,triton;print(sys.version.split()[0],torch.__version__,triton.__version__)" ;;
    tests) timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 libs/attention/tests/test_triton_kernels.py \
             libs/attention/tests/test_triton_compile.py 2>&1 | tail -25 ;;
    attention) timeout 300 python3 bench/bench_attention_gpu.py --out "$out/attention_gpu.json" ;;
    sweep) timeout 400 python3 bench/bench_attention_gpu.py --sweep --dtypes bf16 --seqlens 8192 32768 \
             --contexts 32768 131072 --batches 1 32 --out "$out/attention_gpu_sweep.json" ;;
    sp) timeout 300 python3 bench/bench_sp_attention_gpu.py --out "$out/sp_attention_gpu.json" ;;
    kvp) timeout 300 python3 bench/bench_kvp_attention_gpu.py --out "$out/kvp_attention_gpu.json" ;;
    engine) timeout 300 python3 bench/bench_engine_gpu.py --out "$out/engine_gpu.json" ;;
    engine1b) timeout 300 python3 bench/bench_engine_gpu.py --shape llama-1b --out "$out/engine_gpu_llama1b.json" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
