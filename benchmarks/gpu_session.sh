#!/usr/bin/env bash
# One GPU session on the H200 (device tool): every `gpu` test and every benchmark, logs under $OUT.
# Call 1 (carry .device-wheels/ray):   bash benchmarks/gpu_session.sh ray
# Call 2 (carry .device-wheels/nixl):  bash benchmarks/gpu_session.sh run [pytest paths...]
#   or, for the actor system only:     bash benchmarks/gpu_session.sh actors [pytest paths...]
#   or, host landing at DeepSeek-V3.2 KV size: bash benchmarks/gpu_session.sh landing
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
case "${1:-run}" in
  ray)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device-wheels/ray/*.whl
    python3 -c "import sys; sys.path.insert(0,'/tmp/site'); import ray; print('ray', ray.__version__)"
    ;;
  run|actors|landing)
    mode=$1
    shift
    if [ -d .device-wheels/nixl ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device-wheels/nixl/*.whl
    fi
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || \
      python3 -m pip install --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -5
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    python3 -c "import torch, cupy, ray, nixl, transformers; print('torch', torch.__version__, 'cupy', cupy.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$OUT/gpu.txt"
    if [ "$mode" = landing ]; then
      df -h /dev/shm | tee "$OUT/shm.txt"; free -g | tee -a "$OUT/shm.txt"
      timeout 200 python3 benchmarks/bench_control_plane.py --only landing --model landing --tokens 4096 16384 \
        --page-size 64 --staging-blocks 256 --repeats 3 --out "$OUT/landing_one_chunk.json" 2>&1 \
        | grep -v -E "NIXL INFO|WARNING|INFO worker" | tail -20 | tee "$OUT/landing.log"
      timeout 100 python3 benchmarks/bench_control_plane.py --only landing --model landing --tokens 16384 \
        --page-size 64 --staging-blocks 64 --repeats 3 --paths staged --out "$OUT/landing_chunks.json" 2>&1 \
        | grep -v -E "NIXL INFO|WARNING|INFO worker" | tail -10 | tee -a "$OUT/landing.log"
      timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/e2e/test_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
      exit 0
    fi
    paths=("$@")
    [ ${#paths[@]} -gt 0 ] || paths=(tests)
    timeout 330 python3 -m pytest -q -m gpu -s -p no:cacheprovider "${paths[@]}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
    if [ "$mode" = actors ]; then
      timeout 200 python3 benchmarks/bench_control_plane.py --probes 1000 --out "$OUT/control_plane.json" 2>&1 \
        | grep -v -E "NIXL INFO|WARNING|INFO worker" | tail -40 | tee "$OUT/control_plane.log"
      exit 0
    fi
    for b in "bench_decode.py --out $OUT/decode.json" "bench_copies.py" \
             "bench_landing.py --src cuda --dst cpu" "bench_landing.py --src cuda --dst cuda" \
             "bench_channel.py"; do
      echo "== $b"
      timeout 60 python3 benchmarks/$b 2>&1 | tail -25 | tee -a "$OUT/benches.log"
    done
    ;;
esac
