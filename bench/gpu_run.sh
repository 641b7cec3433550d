#!/usr/bin/env bash
# One unattended GPU run: every `gpu` test, then the quantizer and refit benchmarks, as JSON.
#
#   bash bench/gpu_run.sh                 # on a bare Hopper machine (torch + Triton; no vLLM, TE or Megatron)
#   RESULTS=/tmp/r bash bench/gpu_run.sh; tar czf $OUT/gpu_run.tgz -C /tmp/r .   # through the device tool
#                                         (it returns at most 8 files from $OUT; this writes 16)
#
# Writes to ${RESULTS:-bench/results}: gpu_tests.xml/.log, quant_cuda.json/.log, refit_cuda.json/.log,
# refit_profile_cuda.json/.log (where one refit's GPU and host time goes), refit_host_cuda.json/.log (the refit with
# the receiver's host staging, as GRPO's into vLLM), refit_link_{gloo,nccl}.json/.log (the
# bandwidth-bound refit over a 2-process link, with the link's own bandwidth; NCCL needs two GPUs) and
# sass_sm90.json/.log (the kernels' static SASS from this machine's Triton) and summary.json (each step's exit
# code and seconds). Every step runs even when an earlier one fails; the exit
# code is the first failure's. Wheels found in .whl/ (docs/gpu.md lists them) are installed to /tmp/site first.
# GPU_RUN_SMOKE=1 runs the same steps with seconds-long sizes, on a CPU too (what the CI test of this script does).
# GPU_RUN_STEP_TIMEOUT=S stops a step after S seconds (exit 124 in summary.json) so that the later steps still run
# inside a lease: `step_name:S` pairs override it per step, e.g. "150 refit_cuda:240".
# GPU_RUN_SKIP="name ..." leaves those steps out (summary.json: rc "skipped"), e.g. the CPU-only refit_link_gloo.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
results=${RESULTS:-bench/results}
mkdir -p "$results"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu_run: installing .whl/*.whl failed" >&2; exit 2; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
smoke=${GPU_RUN_SMOKE:-0}
if [ "$smoke" != 1 ] && ! "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_run: no CUDA device here (GPU_RUN_SMOKE=1 runs the smoke sizes on a CPU)" >&2
    exit 2
fi
"$python" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")' | tee "$results/machine.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv >>"$results/machine.txt" 2>/dev/null || true

first_fail=0
steps=()
step_timeout() {  # step_timeout NAME: the seconds GPU_RUN_STEP_TIMEOUT gives this step (empty: none)
    local word limit=""
    for word in ${GPU_RUN_STEP_TIMEOUT:-}; do
        case $word in
            "$1":*) limit=${word#*:} ;;
            *:*) ;;
            *) [ -z "$limit" ] && limit=$word ;;
        esac
    done
    echo "$limit"
}
step() {  # step NAME CMD...: run, log, time, remember the exit code
    local name=$1 start rc limit
    shift
    limit=$(step_timeout "$name")
    if [[ " ${GPU_RUN_SKIP:-} " == *" $name "* ]]; then
        echo "== $name: skipped (GPU_RUN_SKIP)"
        steps+=("\"$name\": {\"rc\": \"skipped\", \"seconds\": 0}")
        return 0
    fi
    echo "== $name: $*${limit:+ (at most ${limit}s)}"
    start=$(date +%s)
    if [ -n "$limit" ]; then set -- timeout -k 10 "$limit" "$@"; fi
    "$@" 2>&1 | tee "$results/$name.log"
    rc=${PIPESTATUS[0]}
    steps+=("\"$name\": {\"rc\": $rc, \"seconds\": $(($(date +%s) - start))}")
    [ "$rc" -ne 0 ] && [ "$first_fail" -eq 0 ] && first_fail=$rc
    return 0
}

mapfile -t gpu_tests < <(grep -rl --include='test_*.py' 'mark.gpu' tests | sort)
if [ "$smoke" = 1 ]; then
    step gpu_tests "$python" -m pytest -q -p no:cacheprovider -m gpu --junitxml "$results/gpu_tests.xml" "${gpu_tests[@]}"
    step quant_cuda "$python" bench/quant.py --smoke --out "$results/quant_cuda.json"
    step refit_cuda "$python" bench/refit.py --smoke --no-tiny --out "$results/refit_cuda.json"
    step refit_profile_cuda "$python" bench/profile_refit.py --device cpu --smoke --out "$results/refit_profile_cuda.json"
    step refit_host_cuda "$python" bench/refit.py --smoke --no-tiny --transports inproc --appliers noop,host,device \
        --out "$results/refit_host_cuda.json"
    step refit_link_gloo "$python" bench/refit.py --link gloo --smoke --out "$results/refit_link_gloo.json"
    step refit_link_nccl "$python" bench/refit.py --link nccl --smoke --out "$results/refit_link_nccl.json"
    step sass_sm90 "$python" bench/sass.py --smoke --out "$results/sass_sm90.json"
else
    step gpu_tests "$python" -m pytest -q -p no:cacheprovider -m gpu -rs --junitxml "$results/gpu_tests.xml" "${gpu_tests[@]}"
    step quant_cuda "$python" bench/quant.py --device cuda --out "$results/quant_cuda.json"
    step refit_cuda "$python" bench/refit.py --device cuda --repeats 3 --out "$results/refit_cuda.json"
    step refit_profile_cuda "$python" bench/profile_refit.py --out "$results/refit_profile_cuda.json"
    # GRPO's refit into vLLM: kept on the device (device: the buckets are the staged version, loaded, compared there,
    # the rollback source copied to the host meanwhile) next to the receiver's host staging (host: the version crosses
    # to pinned host memory bucket by bucket)
    step refit_host_cuda "$python" bench/refit.py --device cuda --repeats 3 --no-tiny --transports inproc \
        --appliers noop,host,device --out "$results/refit_host_cuda.json"
    # bandwidth-bound: the 32-layer set / 8 over gloo (CPU, 1 thread), and the full-width 8B set over NCCL between
    # two GPUs (its JSON says "skipped" on a one-GPU machine)
    step refit_link_gloo env OMP_NUM_THREADS=1 "$python" bench/refit.py --link gloo --threads 1 \
        --out "$results/refit_link_gloo.json"
    step refit_link_nccl "$python" bench/refit.py --link nccl --shrink 1 --bucket-mb 1024 \
        --out "$results/refit_link_nccl.json"
    # static SASS of the same kernels by this machine's Triton (no GPU used): registers, occupancy, instructions
    step sass_sm90 "$python" bench/sass.py --out "$results/sass_sm90.json"
fi
(IFS=,; echo "{${steps[*]}, \"smoke\": $([ "$smoke" = 1 ] && echo true || echo false)}") >"$results/summary.json"
cat "$results/summary.json"
exit "$first_fail"
