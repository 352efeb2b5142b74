#!/usr/bin/env bash
# The GPU proof (issue 17; issue 51's thread scaling: nvme_threads) in one run on a CUDA machine, per ../shared/GPU.md: install
# tierkv beside the machine's torch, then the CUDA tests, exact-size pinning, the
# one-block load's parts, DMA by copies per driver call, the GPU bench, the demo at its
# CUDA defaults and the core suite with CUDA present (STEPS="cuda_tests one_block" runs
# those only; one_block_pairs, not run by default, interleaves .old/ and this tree). Each step has its own time limit, so one hang leaves the others' output;
# logs go to $OUT (default: ./gpu-proof-out).
# Run from the project root with .whl/ fetched (bash ../shared/gpu/fetch-wheels.sh).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu-proof-out}
mkdir -p "$OUT"
start=$SECONDS
STEPS=${STEPS:-cuda_tests nvme_threads pinning one_block dma_calls bench_gpu demo_cuda core_tests_with_cuda}
# .old/: an earlier tree's tierkv package (git archive REV tierkv | tar -x -C .old), for
# the before/after steps (one_block_before, dma64_before_after, submit_host)
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
python3 -c 'import triton; print("triton", triton.__version__)' || echo "no triton: the bounded backend is skipped"
TAIL=40 step cuda_tests 150 python3 -m pytest -q -p no:cacheprovider -m cuda -rf tests
# issue 51: the nvme tier on 1 and 8 threads (and plain C on as many), tmpfs, 64 KiB blocks;
# the bar: loads on 8 threads >= 5x loads on 1. The first line says whether the core is built.
TAIL=30 step nvme_threads 150 bash -c "
  python3 -c 'from tierkv_nvme import native; print(native.reason); c = native._core; print(\"blake3 lanes:\", c.BLAKE3_LANES if c else 0, \"xxh3 bits:\", c.XXH3_VECTOR_BITS if c else 0)'
  nproc; for r in 1 2; do for t in 1 8; do
    python3 benchmarks/nvme_engines.py --block-kib 64 --rounds 1 --engines native-slab,native-slab-mac --threads \$t | tail -3 | sed \"s/^/threads \$t: /\"
  done; done"
step pinning 100 python3 benchmarks/gpu_pinning.py
step one_block 90 python3 benchmarks/gpu_one_block.py
step one_block_16k 60 python3 benchmarks/gpu_one_block.py --page 16KiB --no-large
[ -d .old/tierkv ] && step one_block_before 45 env PYTHONPATH="$PWD/.old:$PYTHONPATH" python3 benchmarks/gpu_one_block.py
# interleaved before/after of a one-block load at 64 and 16 KiB pages (.old: before)
[ -d .old/tierkv ] && TAIL=60 step one_block_pairs ${PAIRS_LIMIT:-240} bash -c "
  for i in \$(seq ${PAIRS:-2}); do for page in 64KiB 16KiB; do
    env PYTHONPATH=$PWD/.old:\$PYTHONPATH python3 benchmarks/gpu_one_block.py --no-large --page \$page | sed \"s/^/before \$page: /\"
    python3 benchmarks/gpu_one_block.py --no-large --page \$page | sed \"s/^/after  \$page: /\"
  done; done"
step dma_calls 90 python3 benchmarks/gpu_dma_calls.py
(cd /tmp && TAIL=30 step bench_gpu ${BENCH_LIMIT:-150} tierkv bench --gpu ${BENCH_ARGS:-})
(cd /tmp && TAIL=30 step demo_cuda 180 tierkv demo --device cuda)
(cd /tmp && TAIL=12 step demo_window 90 tierkv demo --device cuda --hybrid window)
(cd /tmp && TAIL=12 step demo_state 90 tierkv demo --device cuda --hybrid state)
if [ -d .old/tierkv ]; then
  cat >/tmp/dma64.py <<'PY'
from tierkv.gpu.bench import benchmark
r = benchmark(256 << 20, page_bytes=64 << 10, device="cuda", copy_backend="dma")
print(f"dma 64KiB: store {r['store_ratio']:.3f}, load {r['load_ratio']:.3f} of a contiguous copy")
PY
  old="env PYTHONPATH=$PWD/.old:$PYTHONPATH"
  step dma64_before_after 60 bash -c "for i in 1 2; do $old python3 /tmp/dma64.py | sed 's/^/before: /'; python3 /tmp/dma64.py | sed 's/^/after:  /'; done"
  step submit_host 40 bash -c "for i in 1 2; do $old python3 benchmarks/gpu_submit_host.py | sed 's/^/before: /'; python3 benchmarks/gpu_submit_host.py | sed 's/^/after:  /'; done"
fi
step one_block_again 45 python3 benchmarks/gpu_one_block.py
TAIL=20 step bounded_sweep 150 python3 benchmarks/gpu_bounded_sweep.py
TAIL=60 step one_block_profile 60 python3 benchmarks/gpu_one_block.py --profile
left=$((${GPU_PROOF_BUDGET:-540} - (SECONDS - start)))
if [ "$left" -gt 30 ]; then
  TAIL=8 step core_tests_with_cuda "$left" python3 -m pytest -q -p no:cacheprovider -n 8 --continue-on-collection-errors tests
fi
echo "done in $((SECONDS - start))s"
