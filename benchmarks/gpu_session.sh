#!/usr/bin/env bash
# The GPU checks of a session that draws a device machine, prepared: one part per device call, each well inside
# the 10-minute limit of a call (the device time is short: ~15 minutes in all, the machine's start included).
# Run from the repository root on the device; results go to $OUT (the device tool's output folder).
#
#   bash benchmarks/gpu_session.sh bench     # gpu.py (ResNet-50 / ResNet-110 tables, host time per step) and a
#                                            # profile of the GPU-recommended setting, the statistics and fold
#                                            # probes (the library's fold with and without batched eigh) (~9 min)
#   bash benchmarks/gpu_session.sh tests     # the test suite on CUDA, pytest -n 8             (~4 minutes)
#   bash benchmarks/gpu_session.sh short     # one call when little device time is left (~6 minutes): the
#                                            # statistics probe, the CUDA test,
#                                            # gpu.py's tables (50 rounds; the deferred weight-gradient
#                                            # transform's rows among them) and kernel counts, the host
#                                            # attribution (gpu_host.py) with two step timelines
#   bash benchmarks/gpu_session.sh compile   # torch.compile: ResNet-20, plain and recursive, both modes
#                                            #                                                  (~5 minutes)
#   bash benchmarks/gpu_session.sh compile50 # the same for ResNet-50 bf16 batch 128: do CUDA graphs
#                                            # (reduce-overhead) take back its host-bound step? (~9 minutes;
#                                            # never run yet: the next device session's first call)
#   bash benchmarks/gpu_session.sh graphs    # one call (~9 minutes): CUDA graphs on a converted model (train like
#                                            # eager? recordings?), the ResNet-50 step table (eager; the deferred
#                                            # transform's rows among them), ResNet-50 reduce-overhead, plain and grad
#   bash benchmarks/gpu_session.sh async     # one call (~6 minutes): fold_async's CUDA tests, the ResNet-50 step
#                                            # table (grad, recursive, grad every5/block50), ResNet-50
#                                            # reduce-overhead (plain, grad; a model class of its own: the
#                                            # coordinator's hook outside the graph), CUDA graphs on a converted model
#   bash benchmarks/gpu_session.sh async2    # the second call (~8 minutes): the CUDA tests again, fold_async.py
#                                            # (each variant alone for whole blocks: no other model's steps run
#                                            # while a fold is in flight) for grad and recursive at block 10,
#                                            # grad at block 50, then ResNet-50 grad under reduce-overhead alone
#   bash benchmarks/gpu_session.sh graphs2   # the next session's first call (~9 minutes): CUDA graphs on a converted
#                                            # model (one recording per graph now?), then ResNet-50 reduce-overhead,
#                                            # plain and grad, with the converted model's long compilation (>250 s)
#                                            # given room; then `tests` as the second call
#   bash benchmarks/gpu_session.sh grouped   # one call (~8 minutes): the CUDA tests of the statistics added by groups
#                                            # at the forward's end, the fused direct wrapper and the shared
#                                            # weight-gradient node, then the ResNet-50 step table (plain, grad,
#                                            # recursive, direct; host time per step) and the kernel counts after them
#
# Muon and SOAP need pytorch-optimizer, which the device image lacks and cannot download: carry its wheel in
# .whl/ (git-ignored; `pip download --no-deps pytorch_optimizer==4.1.0 -d .whl`); without it those rows are left
# out. Each step has its own timeout, so a slow step costs its own output only.
set -u
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; git log -1 --format='%H %s';
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; nproc; uptime; } \
  > "$OUT/machine.txt" 2>&1

case "${1:-bench}" in
  bench)
    timeout 300 python3 benchmarks/gpu.py --threads 8 --rounds 50 --skip compile,kernels --json "$OUT/gpu.json" \
      > "$OUT/gpu.txt" 2>&1
    echo "gpu.py exit $?" >> "$OUT/machine.txt"
    timeout 100 python3 benchmarks/gpu_profile.py --method recursive --stats-every 5 --block-size 50 --steps 10 \
      > "$OUT/profile_recursive_every5.txt" 2>&1
    echo "gpu_profile.py exit $?" >> "$OUT/machine.txt"
    timeout 240 python3 benchmarks/gpu_probe.py --only stats,split,libfold,fold > "$OUT/probe_stats.txt" 2>&1
    echo "gpu_probe.py exit $?" >> "$OUT/machine.txt"
    ;;
  short)
    timeout 40 python3 benchmarks/gpu_probe.py --only stats > "$OUT/probe_stats.txt" 2>&1
    echo "gpu_probe.py stats exit $?" >> "$OUT/machine.txt"
    timeout 120 python3 benchmarks/gpu_probe.py --only split > "$OUT/probe_split.txt" 2>&1  # a compiled layer's stats
    echo "gpu_probe.py split exit $?" >> "$OUT/machine.txt"
    timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_functional.py -k cuda > "$OUT/pytest.txt" 2>&1
    echo "pytest exit $?" >> "$OUT/machine.txt"
    timeout 330 python3 benchmarks/gpu.py --threads 8 --rounds 50 --skip compile --json "$OUT/gpu.json" \
      > "$OUT/gpu.txt" 2>&1
    echo "gpu.py exit $?" >> "$OUT/machine.txt"
    timeout 90 python3 benchmarks/gpu_host.py --rounds 30 --trace "$OUT" > "$OUT/host.txt" 2>&1
    echo "gpu_host.py exit $?" >> "$OUT/machine.txt"
    ;;
  tests)
    timeout 480 python3 -m pytest -n 8 -q -p no:cacheprovider tests > "$OUT/pytest.txt" 2>&1
    echo "pytest exit $?" >> "$OUT/machine.txt"
    ;;
  compile)
    timeout 540 python3 benchmarks/gpu.py --threads 8 --rounds 12 --skip resnet50,resnet110,kernels \
      --compile-variants plain,recursive --compile-modes default,reduce-overhead --json "$OUT/compile.json" > "$OUT/compile.txt" 2>&1
    echo "gpu.py (compile) exit $?" >> "$OUT/machine.txt"
    ;;
  compile50)
    # CUDA graphs first (the open question), the default mode after; each row is printed as it is measured
    timeout 560 python3 benchmarks/gpu.py --threads 8 --rounds 4 --skip resnet50,resnet110,kernels \
      --compile-model resnet50 --compile-variants plain,recursive,grad --compile-modes reduce-overhead,default \
      --json "$OUT/compile50.json" > "$OUT/compile50.txt" 2>&1
    echo "gpu.py (compile, ResNet-50) exit $?" >> "$OUT/machine.txt"
    ;;
  graphs)
    timeout 150 python3 benchmarks/cuda_graphs.py --methods grad,direct --json "$OUT/cuda_graphs.json" \
      > "$OUT/cuda_graphs.txt" 2>&1
    echo "cuda_graphs.py exit $?" >> "$OUT/machine.txt"
    timeout 200 python3 benchmarks/gpu.py --threads 8 --rounds 50 --skip compile,kernels,resnet110 \
      --json "$OUT/gpu.json" > "$OUT/gpu.txt" 2>&1
    echo "gpu.py exit $?" >> "$OUT/machine.txt"
    timeout 190 python3 benchmarks/gpu.py --threads 8 --rounds 4 --skip resnet50,resnet110,kernels \
      --compile-model resnet50 --compile-variants plain,grad --compile-modes reduce-overhead \
      --json "$OUT/compile50.json" > "$OUT/compile50.txt" 2>&1
    echo "gpu.py (compile, ResNet-50) exit $?" >> "$OUT/machine.txt"
    ;;
  async)
    timeout 70 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_fold_async.py -k cuda > "$OUT/pytest_async.txt" 2>&1
    echo "pytest (fold_async, cuda) exit $?" >> "$OUT/machine.txt"
    timeout 200 python3 benchmarks/gpu.py --threads 8 --rounds 50 --skip compile,kernels,resnet110 \
      --variants "grad;grad:every5,block50;recursive" \
      --json "$OUT/gpu_async.json" > "$OUT/gpu_async.txt" 2>&1
    echo "gpu.py (step table) exit $?" >> "$OUT/machine.txt"
    TORCH_LOGS=recompiles,graph_breaks timeout 190 python3 benchmarks/gpu.py --threads 8 --rounds 4 \
      --skip resnet50,resnet110,kernels --compile-model resnet50 --compile-variants plain,grad \
      --compile-modes reduce-overhead --json "$OUT/compile50.json" > "$OUT/compile50.txt" 2>&1
    echo "gpu.py (compile, ResNet-50) exit $?" >> "$OUT/machine.txt"
    timeout 80 python3 benchmarks/cuda_graphs.py --methods grad --json "$OUT/cuda_graphs.json" \
      > "$OUT/cuda_graphs.txt" 2>&1
    echo "cuda_graphs.py exit $?" >> "$OUT/machine.txt"
    ;;
  async2)
    timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_fold_async.py -k cuda > "$OUT/pytest_async.txt" 2>&1
    echo "pytest (fold_async, cuda) exit $?" >> "$OUT/machine.txt"
    fold_async() {  # method block timed-blocks rounds
      (cd benchmarks && timeout 100 python3 fold_async.py --device cuda --width 64 --batch 128 --method "$1" \
        --block "$2" --blocks "$3" --rounds "$4" --plain --json "$OUT/fold_async_$1_$2.json") \
        > "$OUT/fold_async_$1_$2.txt" 2>&1
      echo "fold_async.py $1 block $2 exit $?" >> "$OUT/machine.txt"
    }
    fold_async grad 10 2 3
    TORCH_LOGS=recompiles,graph_breaks timeout 250 python3 benchmarks/gpu.py --threads 8 --rounds 4 \
      --skip resnet50,resnet110,kernels --compile-model resnet50 --compile-variants grad \
      --compile-modes reduce-overhead --json "$OUT/compile50_grad.json" > "$OUT/compile50_grad.txt" 2>&1
    echo "gpu.py (compile, ResNet-50 grad) exit $?" >> "$OUT/machine.txt"
    fold_async recursive 10 2 3
    fold_async grad 50 1 2
    ;;
  graphs2)
    timeout 80 python3 benchmarks/cuda_graphs.py --methods grad --json "$OUT/cuda_graphs.json" \
      > "$OUT/cuda_graphs.txt" 2>&1
    echo "cuda_graphs.py exit $?" >> "$OUT/machine.txt"
    TORCH_LOGS=recompiles,graph_breaks timeout 470 python3 benchmarks/gpu.py --threads 8 --rounds 8 \
      --skip resnet50,resnet110,kernels --compile-model resnet50 --compile-variants plain,grad \
      --compile-modes reduce-overhead --json "$OUT/compile50.json" > "$OUT/compile50.txt" 2>&1
    echo "gpu.py (compile, ResNet-50) exit $?" >> "$OUT/machine.txt"
    ;;
  grouped)
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_handed_stats.py tests/test_direct_fused.py \
      tests/test_shared_transform.py tests/test_step_plan.py > "$OUT/pytest_grouped.txt" 2>&1
    echo "pytest (grouped statistics, fused direct) exit $?" >> "$OUT/machine.txt"
    timeout 330 python3 benchmarks/gpu.py --threads 8 --rounds 50 --skip compile,resnet110 \
      --variants "grad;recursive;direct" --json "$OUT/gpu_grouped.json" > "$OUT/gpu_grouped.txt" 2>&1
    echo "gpu.py (step table, kernels) exit $?" >> "$OUT/machine.txt"
    ;;
  *)
    echo "usage: bash benchmarks/gpu_session.sh bench|short|tests|compile|compile50|graphs|async|async2|graphs2|grouped" >&2
    exit 2
    ;;
esac
tail -n 40 "$OUT"/*.txt
