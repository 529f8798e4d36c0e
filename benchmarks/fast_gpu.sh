#!/usr/bin/env bash
# The fast decode path on the H200 (device tool), one call each (logs under $OUT):
#   bash benchmarks/fast_gpu.sh check      # gpu tests of the fast path + a 32K capacity smoke (~6 min)
#   bash benchmarks/fast_gpu.sh capacity   # bench_capacity.py at 32K / 64K / 128K (< 9 min)
#   bash benchmarks/fast_gpu.sh actors     # (after gpu_session.sh's ray + nixl calls; carry
#                                          # .device-wheels/kernels and .device-wheels/wire)
#                                          # the actor system on the fast step, MoE graphs,
#                                          # select_topk_fast on CUDA + bench_topk (~6-9 min)
#   bash benchmarks/fast_gpu.sh big        # < 9 min: where the batch-1 step's time goes
#                                          # (profile_step.py), 64K capacity, 16K/64K/128K prefill
#   bash benchmarks/fast_gpu.sh triton     # < 8 min: the Triton kernels' gpu tests (top-k, RMSNorm)
#                                          # + the fast path's exactness tests, bench_topk, and the
#                                          # batch-1 32K step profiled with the kernels off, then on
#                                          # (HISPARSE_TRITON_TOPK / _NORM), same call
#   bash benchmarks/fast_gpu.sh split      # < 7 min: the split-row Triton top-k's gpu tests + the fast
#                                          # path's, the chunks-per-row sweep (bench_topk_splits.py),
#                                          # and the whole capacity benchmark
#   bash benchmarks/fast_gpu.sh glue       # < 9 min: the compiled glue's gpu exactness test, then the
#                                          # same step profiled with the Triton kernels on, glue
#                                          # eager vs compiled (HISPARSE_COMPILE_GLUE=1:
#                                          # FastPathConfig.compile_glue in the benchmark stack)
#   bash benchmarks/fast_gpu.sh overlap    # < 9.5 min: the fast path's gpu tests (the resolver on a
#                                          # side stream under random delays among them), TPOT with
#                                          # overlap_resolve off / on (bench_overlap.py, 32K + 128K),
#                                          # and the batch-1 32K step profiled with everything on
#   bash benchmarks/fast_gpu.sh lookahead  # < 9 min: the step pipeline's gpu test (bit-identical with
#                                          # the GPU lagging), then bench_lookahead.py: the engine's
#                                          # ms/step with EngineConfig.lookahead off / on, 61 layers
#   bash benchmarks/fast_gpu.sh resolver   # < 7 min: the resolver's parity tests (the fused phase A
#                                          # too), default vs fused phase A (bench_resolver.py
#                                          # --phase-a), the fused kernel by stage, the fast path's
#                                          # bit-exact tests with it (TPOT with it: the overlap mode
#                                          # under HISPARSE_RESOLVER_PHASE_A=fused)
#   bash benchmarks/fast_gpu.sh final      # < 6.5 min: fast-path + exactness gpu tests, 32K + 128K
#                                          # capacity (few steps) and a 16K prefill, time-boxed each
# Carry .device-wheels/kernels (sglang-kernel 0.4.6, sgl-deep-gemm, apache-tvm-ffi).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source "$(dirname "$0")/_bundle.sh"  # $OUT comes back as one archive
WHEELS=${WHEELS:-.device-wheels/kernels}
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 CUDA_HOME=/usr/local/cuda OMP_NUM_THREADS=8
if [ -d "$WHEELS" ]; then  # a later call on a warm machine may carry nothing: /tmp/site has it
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/*.whl
fi
if [ -d .device-wheels/wire ]; then  # msgspec (the step codec, a main dependency): not on the image
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device-wheels/wire/*.whl
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || \
  python3 -m pip install --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -5
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, sgl_kernel.flash_mla, deep_gemm; print('torch', torch.__version__, 'flash_mla ok, deep_gemm ok')" 2>&1 | tail -2 | tee -a "$OUT/gpu.txt"
free -g | head -2 | tee -a "$OUT/gpu.txt"
profile() {  # profile() TOPK NORM GLUE: the batch-1 32K HiSparse step, Triton kernels / compiled glue
  local d="$OUT/profile_topk$1_norm$2_glue$3"
  mkdir -p "$d"
  HISPARSE_TRITON_TOPK=$1 HISPARSE_TRITON_NORM=$2 HISPARSE_COMPILE_GLUE=$3 timeout 170 \
    python3 benchmarks/profile_step.py --context 32768 --modes hisparse --out "$d" > "$d/profile_step.log" 2>&1
  echo "profile (HISPARSE_TRITON_TOPK=$1 HISPARSE_TRITON_NORM=$2 HISPARSE_COMPILE_GLUE=$3) rc=$?"
  grep -v -E "^USDT|profiler_st" "$d/profile_step.log" | tail -14
}
case "${1:-check}" in
  check)
    timeout 330 python3 -m pytest -q -p no:cacheprovider -s -rA tests/fastpath/test_fast_gpu.py \
      tests/kernels/test_kvfp8.py tests/engine/test_engine_gpu.py > "$OUT/tests.log" 2>&1
    echo "pytest rc=$?"
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|max \||hits |passed|failed|Error" "$OUT/tests.log" | tail -40
    timeout 200 python3 benchmarks/bench_capacity.py --contexts 32768 --steps 3 --warm 2 \
      --out "$OUT" > "$OUT/capacity_smoke.log" 2>&1
    echo "bench rc=$?"
    tail -25 "$OUT/capacity_smoke.log"
    ;;
  lookahead)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -s -rA tests/fastpath/test_fast_gpu.py \
      tests/rank/test_sampler.py -k "lookahead or one_bucket or cuda_draws" > "$OUT/lookahead_tests.log" 2>&1
    echo "pytest rc=$?"
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|Error" "$OUT/lookahead_tests.log" | tail -12
    timeout 380 python3 benchmarks/bench_lookahead.py --layers 61 --context 4096 --batches 1 4 16 \
      --repeats 1 --out "$OUT" > "$OUT/bench_lookahead.log" 2>&1
    echo "bench rc=$?"
    tail -12 "$OUT/bench_lookahead.log"
    ;;
  actors)
    timeout 380 python3 -m pytest -q -p no:cacheprovider -s -rA --durations=0 \
      tests/e2e/test_fast_actors_gpu.py > "$OUT/actors.log" 2>&1
    echo "actor pytest rc=$?"
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|fast_steps|passed|failed|Error" "$OUT/actors.log" | tail -30
    timeout 120 python3 -m pytest -q -p no:cacheprovider -s -rA -m gpu --durations=0 \
      tests/fastpath/test_topk.py tests/fastpath/test_moe_fast.py > "$OUT/moe_topk.log" 2>&1
    echo "moe/topk pytest rc=$?"
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|MoE|passed|failed|Error" "$OUT/moe_topk.log" | tail -20
    timeout 50 python3 benchmarks/bench_topk.py --repeats 5 --out "$OUT/topk.json" 2>&1 | tee "$OUT/topk.log"
    ;;
  triton)
    # (the compiled glue's test, ~70 s, is the glue mode's)
    timeout 150 python3 -m pytest -v -p no:cacheprovider -rA -m gpu tests/kernels/test_topk_triton.py \
      tests/kernels/test_norm_triton.py tests/fastpath/test_topk.py tests/fastpath/test_fast_gpu.py \
      -k "not compiled_glue" > "$OUT/triton_tests.log" 2>&1
    echo "pytest rc=$?"
    grep -E "(PASSED|FAILED|ERROR)|passed|failed" "$OUT/triton_tests.log" | tail -30
    timeout 50 python3 benchmarks/bench_topk.py --repeats 5 --out "$OUT/topk.json" 2>&1 | tee "$OUT/topk.log"
    for flags in "0 0 0" "1 1 0"; do profile $flags; done
    ;;
  split)  # < 7 min: the split-row top-k on the H200: its gpu tests and the fast path's exactness
    # tests, the chunks-per-row sweep from CUDA graphs, then the whole capacity benchmark
    timeout 120 python3 -m pytest -v -p no:cacheprovider -rA -m gpu tests/kernels/test_topk_triton.py \
      tests/fastpath/test_topk.py tests/fastpath/test_fast_gpu.py -k "not compiled_glue and not flashmla_matches and not deepgemm" \
      > "$OUT/split_tests.log" 2>&1
    echo "pytest rc=$?"
    grep -E "(PASSED|FAILED|ERROR)|passed|failed" "$OUT/split_tests.log" | tail -16
    timeout 80 python3 benchmarks/bench_topk_splits.py --out "$OUT/topk_splits.json" 2>&1 | tee "$OUT/topk_splits.log"
    timeout 200 python3 benchmarks/bench_capacity.py --out "$OUT" > "$OUT/capacity.log" 2>&1
    echo "capacity rc=$?"
    grep -E "^ *[0-9]+ +(full|hisparse) +bf16( +[0-9]+){3} +random" "$OUT/capacity.log" | tail -18
    sed -n '/^context  cap_full/,$p' "$OUT/capacity.log" | tail -5
    ;;
  glue)
    timeout 150 python3 -m pytest -v -p no:cacheprovider -rA -s \
      "tests/fastpath/test_fast_gpu.py::test_compiled_glue_equals_full_resident_and_matches_reference" \
      > "$OUT/glue_tests.log" 2>&1
    echo "pytest rc=$?"
    grep -E "(PASSED|FAILED|ERROR)|compiled glue|passed|failed" "$OUT/glue_tests.log" | tail -10
    for flags in "1 1 0" "1 1 1"; do profile $flags; done
    ;;
  overlap)
    timeout 170 python3 -m pytest -v -p no:cacheprovider -rA -s tests/fastpath/test_fast_gpu.py \
      tests/fastpath/test_topk.py -m gpu -k "not real_dims" > "$OUT/overlap_tests.log" 2>&1
    echo "pytest rc=$?"
    grep -E "(PASSED|FAILED|ERROR)|passed|failed" "$OUT/overlap_tests.log" | tail -20
    timeout 230 python3 benchmarks/bench_overlap.py --out "$OUT" > "$OUT/bench_overlap.log" 2>&1
    echo "bench_overlap rc=$?"
    grep -v -E "^\[" "$OUT/bench_overlap.log" | tail -24
    timeout 150 python3 benchmarks/profile_step.py --context 32768 --modes hisparse full \
      --out "$OUT/profile" > "$OUT/profile_step.log" 2>&1
    echo "profile rc=$?"
    grep -v -E "^USDT|profiler_st" "$OUT/profile_step.log" | tail -40
    ;;
  resolver)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rA tests/kernels/test_cuda_parity.py \
      tests/kernels/test_cluster_config.py > "$OUT/parity.log" 2>&1
    echo "parity rc=$?"
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/parity.log" | tail -12
    timeout 120 python3 benchmarks/bench_resolver.py --phase-a --out "$OUT/phase_a.parquet" \
      > "$OUT/phase_a.log" 2>&1
    echo "phase-a bench rc=$?"
    tail -20 "$OUT/phase_a.log"
    HISPARSE_RESOLVER_PHASE_A=fused timeout 60 python3 benchmarks/bench_resolver.py --profile \
      > "$OUT/profile_fused.log" 2>&1
    grep -E "returns after|K=" "$OUT/profile_fused.log" | tail -12
    HISPARSE_RESOLVER_PHASE_A=fused timeout 50 python3 -m pytest -q -p no:cacheprovider \
      tests/fastpath/test_fast_gpu.py -k "one_bucket or overlap_is_bit" > "$OUT/fused_fast.log" 2>&1
    echo "fast path with the fused phase A rc=$?"; tail -1 "$OUT/fused_fast.log"
    ;;
  final)
    timeout 110 python3 -m pytest -v -p no:cacheprovider -rA tests/fastpath/test_fast_gpu.py \
      tests/kernels/test_kvfp8.py tests/model/test_indexer.py tests/engine/test_prefix_exact.py \
      -m gpu > "$OUT/tests.log" 2>&1
    echo "pytest rc=$?"
    grep -E "(PASSED|FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -30
    timeout 200 python3 benchmarks/bench_capacity.py --contexts 32768 131072 --steps 3 --warm 2 \
      --out "$OUT" > "$OUT/capacity.log" 2>&1
    echo "capacity rc=$?"
    tail -30 "$OUT/capacity.log"
    timeout 45 python3 benchmarks/bench_prefill.py --lengths 16384 --out "$OUT/prefill.json" \
      > "$OUT/prefill.log" 2>&1
    echo "prefill rc=$?"
    tail -8 "$OUT/prefill.log"
    ;;
  big)
    timeout 150 python3 benchmarks/profile_step.py --context 32768 --out "$OUT" > "$OUT/profile_step.log" 2>&1
    echo "profile rc=$?"
    grep -v -E "^USDT|profiler_st" "$OUT/profile_step.log" | tail -50
    timeout 150 python3 benchmarks/bench_capacity.py --contexts 65536 --steps 3 --warm 2 \
      --out "$OUT" > "$OUT/capacity_64k.log" 2>&1
    echo "capacity rc=$?"
    grep -E "^\[|^ *[0-9]+ " "$OUT/capacity_64k.log" | tail -22
    timeout 200 python3 benchmarks/bench_prefill.py --lengths 16384 65536 131072 \
      --out "$OUT/prefill_long.json" > "$OUT/prefill_long.log" 2>&1
    echo "prefill rc=$?"
    tail -8 "$OUT/prefill_long.log"
    ;;
  capacity)
    timeout 520 python3 benchmarks/bench_capacity.py --out "$OUT" "${@:2}" 2>&1 | tee "$OUT/capacity.log" | \
      grep -E "^\[|^ *[0-9]+ |context|done|Error|error"
    ;;
esac
