#!/usr/bin/env bash
# The GPU proof (issue 17) in one run on a CUDA machine, per ../shared/GPU.md: install
# tierkv beside the machine's torch, then the CUDA tests, exact-size pinning, the
# one-block load's parts, DMA by copies per driver call, the GPU bench, the demo at its
# CUDA defaults and the core suite with CUDA present (STEPS="cuda_tests one_block" runs
# those only). Each step has its own time limit, so one hang leaves the others' output;
# logs go to $OUT (default: ./gpu-proof-out).
# Run from the project root with .whl/ fetched (bash ../shared/gpu/fetch-wheels.sh).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu-proof-out}
mkdir -p "$OUT"
start=$SECONDS
STEPS=${STEPS:-cuda_tests pinning one_block dma_calls bench_gpu demo_cuda core_tests_with_cuda}
step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.txt
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  echo "=== $name (limit ${limit}s, at $((SECONDS - start))s)"
  timeout -k 5 "$limit" "$@" >"$OUT/$name.txt" 2>&1
  echo "=== $name: exit $? after $((SECONDS - start))s"
  tail -n "${TAIL:-25}" "$OUT/$name.txt"
}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . tiers/nvme || exit 1
nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current,driver_version --format=csv
python3 -c 'import torch, cuda.bindings as b; print("torch", torch.__version__, "cuda", torch.version.cuda, "cuda-bindings", b.__version__)'
TAIL=40 step cuda_tests 150 python3 -m pytest -q -p no:cacheprovider -m cuda -rf tests
step pinning 100 python3 benchmarks/gpu_pinning.py
step one_block 60 python3 benchmarks/gpu_one_block.py
step dma_calls 90 python3 benchmarks/gpu_dma_calls.py
(cd /tmp && TAIL=20 step bench_gpu 150 tierkv bench --gpu)
(cd /tmp && TAIL=30 step demo_cuda 180 tierkv demo --device cuda)
left=$((${GPU_PROOF_BUDGET:-540} - (SECONDS - start)))
if [ "$left" -gt 30 ]; then
  TAIL=8 step core_tests_with_cuda "$left" python3 -m pytest -q -p no:cacheprovider -n 8 --continue-on-collection-errors tests
fi
echo "done in $((SECONDS - start))s"
