#!/usr/bin/env bash
# The GPU checks in one run, for a machine with CUDA (no package registry needed beyond what the
# image has: torch, transformers, safetensors, pytest). Writes logs and JSON into ${OUT:-gpu-out}.
#   bash benchmarks/gpu_checks.sh
# Each step has its own time bound, so one slow step cannot take the others' time.
set -u
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - start)) s"
  tail -n 25 "$out/$name.log"
}
nvidia-smi -L
python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"nccl", torch.cuda.nccl.version(), "transformers", transformers.__version__,
"gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))'
step gpu-tests 200 python3 -m pytest -q -rs -p no:cacheprovider -m gpu \
  tests/engine/test_cuda.py tests/engine/test_tp_nccl.py tests/kv_transfer/test_nccl_transfer.py \
  tests/deploy/test_cuda_serving.py
# The disaggregated layout served through the router: on one GPU over the same-node transport
# (CUDA IPC), over NCCL too when there are two or more; 32 concurrent streams whose prefills
# finish out of order, tokens equal to transformers in float64, every block back. Skips cleanly
# without CUDA.
step gpu-disaggregated 240 python3 -m pytest -q -rs -p no:cacheprovider -m gpu \
  tests/kv_transfer/test_same_node_cuda.py tests/workers/test_gpu_disaggregated.py
step engine-31m-bf16 90 python3 -m benchmarks.engine_speed --device cuda --dtype bfloat16 \
  --out "$out/engine-31m-bf16.json"
step engine-1b-bf16 150 python3 -m benchmarks.engine_speed --device cuda --dtype bfloat16 --preset 1b \
  --kv-cache-gb 16 --max-num-seqs 64 --out "$out/engine-1b-bf16.json"
