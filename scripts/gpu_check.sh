#!/usr/bin/env bash
# The reference engine's GPU checks in one run, each step's output in OUT_DIR (default ./gpu-check):
#   tests  - steps replayed from CUDA graphs give plain greedy's tokens (tests/engines/reference, CUDA-only tests)
#   steps  - where a step's time goes per tree size, bfloat16 and float32 (drafter bench steps)
#   e2e    - end to end on two workloads: the engine plain and with drafts, fixed budgets, transformers (bfloat16)
#   exact  - drafter's outputs against greedy's in float32
# Needs a CUDA GPU and the project importable with its C kernels built (pip install -e ".[service,bench,engine]",
# or the packages on PYTHONPATH and `python3 setup.py build_ext --inplace`). STEP_TIMEOUT bounds each step (s).
set -uo pipefail
out=${1:-gpu-check}
py=${PYTHON:-python3}
limit=${STEP_TIMEOUT:-900}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
drafter=("$py" -m drafter_service.cli.entry)

step() {
    local name=$1
    shift
    echo "== $name: $*" | tee -a "$out/summary.txt"
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    tail -n 40 "$out/$name.txt"
    echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
}

"$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" \
    | tee "$out/summary.txt" || exit 1
step tests "$py" -m pytest -q -p no:cacheprovider tests/engines/reference/test_engine.py -k "cuda or padded"
step steps "${drafter[@]}" bench steps --device cuda --sizes 0,4,8,16,32,64 --context 512 --repeats 30
step e2e "${drafter[@]}" bench e2e --device cuda --dtype bfloat16 --dataset gsm8k --dataset humaneval --warm 16 --requests 8 \
    --max-new-tokens 128 --methods greedy,drafter,drafter-pre,hf,hf-static,hf-pld --fixed-budgets 8,32,64 --json "$out/e2e.json"
step exact "${drafter[@]}" bench e2e --device cuda --dtype float32 --dataset gsm8k --warm 8 --requests 3 \
    --max-new-tokens 96 --methods greedy,drafter,drafter-pre
