#!/usr/bin/env bash
# Every GPU check in one run, for a machine with an NVIDIA GPU (CI has none): the GPU tests
# (tests/test_gpu.py, tests/test_cuda_graphs.py), the CUDA-graph and GPU benchmarks, and the commands a
# user runs first. Each step has a time limit, writes LOG_DIR/STEP.log and prints its tail, so one that
# fails or hangs costs only its own time. mamba_ssm / causal_conv1d are checked when importable, in the
# last step, with the CUDA-graph step again on top of them (`STEPS=kernels` to run it alone, with the
# packages importable, after the others have run on the torch path). A step cut by its limit loses
# pytest's failure report, which comes at the end.
#
#   bash benchmarks/gpu_check.sh [LOG_DIR]        (python3 with CUDA torch; this repo installed or on PYTHONPATH)
#   STEPS="tests cli" bash benchmarks/gpu_check.sh  (only those steps)
set -u
out=${1:-gpu_check_logs}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...
    local name=$1 secs=$2 start=$SECONDS rc
    shift 2
    [[ -z ${STEPS:-} || " $STEPS " == *" $name "* ]] || return 0
    echo "=== $name (limit ${secs} s)"
    timeout "$secs" "$@" >"$out/$name.log" 2>&1
    rc=$?
    tail -n "${TAIL:-30}" "$out/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
}

step env 30 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv;
  $py -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
          torch.cuda.get_device_name(), torch.cuda.get_device_capability())'"
step tests 120 "$py" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_cuda_graphs.py \
    tests/test_kernel_seam.py -k "not mamba_ssm"
step graphs_f32 60 "$py" benchmarks/bench_cuda_graphs.py --configs 30m,100m --new-tokens 64 --reps 3
step graphs_bf16 60 "$py" benchmarks/bench_cuda_graphs.py --configs 30m,100m --new-tokens 64 --reps 3 \
    --dtype bfloat16
step bench_gpu 160 "$py" benchmarks/bench_gpu.py
step cli 80 bash -c "$py -m elastic_local.cli info && $py -m elastic_local.cli fit &&
  $py -m elastic_local.cli fit --context 131072 &&
  $py -m elastic_local.cli generate --device cuda --prompt 'What is 17 + 25?' --max-think-tokens 64 --max-tokens 32 &&
  $py -m elastic_local.cli generate --device cuda --precision fp8 --prompt 'What is 17 + 25?' --max-think-tokens 64 \
    --max-tokens 32 && $py -m elastic_local.cli generate --device cuda --no-cuda-graphs --prompt 'What is 17 + 25?' \
    --max-think-tokens 64 --max-tokens 32"
step kernels 100 "$py" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_cuda_graphs.py \
    -k "mamba_ssm or cuda_graph"
