#!/usr/bin/env bash
# One GPU session on the H200 (device tool): every `gpu` test and every benchmark, logs under $OUT.
# Call 1 (carry .device-wheels/ray):   bash benchmarks/gpu_session.sh ray
# Call 2 (carry .device-wheels/nixl):  bash benchmarks/gpu_session.sh run [pytest paths...]
#   or, for the actor system only:     bash benchmarks/gpu_session.sh actors [pytest paths...]
#   or, host landing at DeepSeek-V3.2 KV size:  bash benchmarks/gpu_session.sh landing
#   or, landings of 64K / 128K tokens:           bash benchmarks/gpu_session.sh landing-big
#   or, control plane (codec, channel, actors):  bash benchmarks/gpu_session.sh control
#   or, on the two-GPU kind: TP 2 with a GPU per rank, tests:  bash benchmarks/gpu_session.sh two-gpu
#                            step time TP 1 / TP 2 one GPU / TP 2 two GPUs:  ... tp-bench
#   or, ranks profiled per TP layout (carry .device-wheels/nixl and .device-wheels/pyspy):  ... profile
#       (fill it once here: pip download -q py-spy --no-deps -d .device-wheels/pyspy)
#   or, 8K / 16K-token landings (synthetic prefill) with their phases:  ... landing-phases
#   or, 16K landings under the default push-with-prefill "auto":  ... landing-auto
#   or, 16K landings with push-with-prefill never / always / auto:  ... landing-pwp
#   or, every gpu test and the control plane once more:  ... final
#   or, the actor-system gpu tests, the channel tests and the control plane (~4 min):  ... check
#   or, issue #18 on the H200 (~9.5 min; call 2 carries .device-wheels/nixl AND .device-wheels/serve):
#       the Serve tests, then client-side TTFT / ITL through the OpenAI endpoint vs the replica:
#       bash benchmarks/gpu_session.sh serve
#   or, issue #16 B2 + B3 (~3 min; call 2 carries .device-wheels/nixl AND .device-wheels/wire,
#       msgspec's cp312 wheel): the host-ordering gpu tests, the wire bench, the control plane
#       and the TP 2 step time:  bash benchmarks/gpu_session.sh b23
#       (fill it once here: pip download -q 'msgspec>=0.19' --no-deps --only-binary :all:
#        --python-version 3.12 --platform manylinux2014_x86_64 -d .device-wheels/wire; msgspec is
#        a main dependency since #16 B3: every actor run on the H200 needs it, fast_gpu.sh actors too)
#   or, decode steps of running requests while 128K prompts land (~4 min; call 2 carries
#       .device-wheels/nixl AND .device-wheels/wire):  bash benchmarks/gpu_session.sh landing-decode
#   or, IPC events by step (~3 min; call 2 carries .device-wheels/nixl AND .device-wheels/wire): the
#       host pool's gpu tests (events, IPC between actors) and the TP 2 e2e tests on one GPU:
#       bash benchmarks/gpu_session.sh stepevents
# (each of these fits one device call of <= 600 s; the machine stays warm 30 s between calls)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
source "$(dirname "$0")/_bundle.sh"  # $OUT comes back as one archive
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
case "${1:-run}" in
  ray)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device-wheels/ray/*.whl
    python3 -c "import sys; sys.path.insert(0,'/tmp/site'); import ray; print('ray', ray.__version__)"
    ;;
  run|actors|landing|landing-big|control|two-gpu|tp-bench|profile|landing-phases|b23|stepevents|landing-decode|landing-auto|landing-pwp|final|check|serve)
    mode=$1
    shift
    if [ -d .device-wheels/nixl ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device-wheels/nixl/*.whl
    fi
    if [ -d .device-wheels/wire ]; then  # msgspec (the step codec): not on the image
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device-wheels/wire/*.whl
    fi
    if [ -d .device-wheels/serve ]; then  # Ray Serve's HTTP stack, openai, msgspec
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .device-wheels/serve/*.whl
    fi
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || \
      python3 -m pip install --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -5
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    python3 -c "import torch, cupy, ray, nixl, transformers, msgspec; print('torch', torch.__version__, 'cupy', cupy.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__, 'msgspec', msgspec.__version__)" 2>&1 | tee -a "$OUT/gpu.txt"
    # full logs under $OUT; the reply shows progress lines and tables only
    keep='^ +\[|phases|replica up|^landing|^path|^direct|^staged|^control|^measure|^shm|^ray|^Ray|^[a-z_ ]+[0-9.]+ +[0-9.]+|Error|error'
    land() {  # land NAME TIMEOUT ARGS...: one bench_control_plane landing run
      local name=$1 t=$2; shift 2
      timeout "$t" python3 benchmarks/bench_control_plane.py --only landing --model landing \
        --paths staged --page-size 64 --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
      grep -E "$keep" "$OUT/$name.log" | tail -12
    }
    case "$mode" in
      landing)  # ~5 min: real prefill, 8K and 16K tokens, 1 vs 4 layer groups (session 5: 1 wins)
        df -h /dev/shm | tail -1
        land landing_g1 260 --tokens 8192 16384 --staging-blocks 256 --repeats 2
        land landing_g4 150 --tokens 16384 --staging-blocks 256 --repeats 2 --layer-groups 4
        exit 0 ;;
      landing-big)  # ~5 min: 64K and 128K tokens (4.6 / 9.2 GB of KV), synthetic prefill
        for g in 1 4; do
          land "landing_big_g$g" 150 --tokens 65536 131072 --staging-blocks 2048 --repeats 2 \
            --synthetic-prefill --layer-groups "$g"
        done
        exit 0 ;;
      landing-decode)  # ~4 min: step interval of 2 decoding requests during / outside landings
        land landing_decode 300 --tokens 131072 --staging-blocks 2048 --repeats 2 \
          --synthetic-prefill --decode-during 2 --decode-during-tokens 4096
        grep -A5 "^decode during" "$OUT/landing_decode.log"
        exit 0 ;;
      two-gpu)  # ~6 min: every two_gpus test and its one-GPU twin, then the demo across 2 GPUs
        nvidia-smi topo -m | head -4
        timeout 520 python3 -m pytest -q -s -p no:cacheprovider -m "gpu or two_gpus" \
          tests/host/test_ray.py "tests/e2e/test_gpu.py::test_tp2_landings_spills_restores_backups_match_full_resident" \
          "tests/e2e/test_gpu.py::test_demo_tp2[gpu-each]" 2>&1 | tee "$OUT/two_gpu_tests.log" \
          | grep -E "passed|failed|PASSED|FAILED|Error|error|ranks on|^tp2" | tail -30
        exit 0 ;;
      profile)  # ~2 min: py-spy on every rank of each TP layout
        if [ -d .device-wheels/pyspy ]; then
          # its own target: pip --target skips a bin/ that already exists (ray's), so py-spy would not land
          python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/pyspy .device-wheels/pyspy/*.whl
        fi
        timeout 260 python3 benchmarks/bench_tp.py --model tiny --requests 8 --context 2048 \
          --new-tokens 64 --profile-s 4 --py-spy /tmp/pyspy/bin/py-spy --out "$OUT/tp_profile.json" \
          > "$OUT/tp_profile.log" 2>&1
        grep -E "^ +[0-9. ]+%|rank [01]:|^tp|^layout|up in|py-spy|Error" "$OUT/tp_profile.log" | cut -c1-120 | tail -75
        exit 0 ;;
      check)  # ~4 min: the actor-system gpu tests, the channel tests, the control plane
        timeout 200 python3 -m pytest -q -p no:cacheprovider tests/e2e/test_gpu.py \
          tests/channel/test_codec.py tests/channel/test_channel.py 2>&1 \
          | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -12
        timeout 100 python3 benchmarks/bench_control_plane.py --only control --probes 500 \
          --out "$OUT/control_plane_check.json" > "$OUT/control_plane_check.log" 2>&1
        grep -E "$keep|hot path|^stages" "$OUT/control_plane_check.log" | tail -9
        exit 0 ;;
      final)  # ~8 min: every gpu test, then the control plane once more
        timeout 380 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" \
          | grep -E "passed|failed|FAILED|Error" | tail -12
        timeout 150 python3 benchmarks/bench_control_plane.py --only control --probes 1000 \
          --out "$OUT/control_plane_final.json" > "$OUT/control_plane_final.log" 2>&1
        grep -E "$keep|hot path|^stages" "$OUT/control_plane_final.log" | tail -9
        exit 0 ;;
      landing-pwp)  # ~2.5 min: 16K landings without / with the push in the prefill call, and "auto"
        land landing_never 150 --tokens 16384 --staging-blocks 256 --repeats 4 --synthetic-prefill
        land landing_always 150 --tokens 16384 --staging-blocks 256 --repeats 4 --synthetic-prefill \
          --push-with-prefill always
        land landing_auto 150 --tokens 16384 --staging-blocks 512 --repeats 4 --synthetic-prefill \
          --push-with-prefill auto
        grep -h -E "pushed inside" "$OUT"/landing_*.log
        exit 0 ;;
      landing-auto)  # ~1.5 min: 16K landings, the default push_with_prefill "auto", a pool of 2 prompts
        land landing_auto 200 --tokens 16384 --staging-blocks 512 --repeats 4 --synthetic-prefill \
          --push-with-prefill auto
        grep -E "pushed inside" "$OUT/landing_auto.log"
        exit 0 ;;
      landing-phases)  # ~3 min: the usual landing, then with the push inside the prefill call
        land landing_s6 200 --tokens 8192 16384 --staging-blocks 256 --repeats 3 --synthetic-prefill
        land landing_pwp 200 --tokens 8192 16384 --staging-blocks 256 --repeats 3 --synthetic-prefill \
          --push-with-prefill
        exit 0 ;;
      tp-bench)  # ~5 min: decode step time per TP layout, tiny and landing-shaped models
        timeout 250 python3 benchmarks/bench_tp.py --model tiny --requests 8 --context 2048 \
          --new-tokens 32 --out "$OUT/tp_tiny.json" > "$OUT/tp_tiny.log" 2>&1
        grep -E "$keep|^tp|^layout|up in|^decode" "$OUT/tp_tiny.log" | tail -10
        timeout 300 python3 benchmarks/bench_tp.py --model landing --requests 8 --context 8192 \
          --new-tokens 32 --out "$OUT/tp_landing.json" > "$OUT/tp_landing.log" 2>&1
        grep -E "$keep|^tp|^layout|up in|^decode" "$OUT/tp_landing.log" | tail -10
        exit 0 ;;
      serve)  # ~8 min: issue #18's Serve tests on the H200, then TTFT / ITL (OpenAI client vs replica)
        # -v: each outcome as it happens; a hang dumps every thread's stack after 150 s
        # the two tests that failed on the H200 before (2026-12-01 evening) run first, alone, so
        # their outcome and traceback come back even when the whole set runs out of time
        timeout 170 python3 -m pytest -v -p no:cacheprovider -rA --tb=long \
          -o faulthandler_timeout=120 \
          "tests/e2e/test_serve.py::test_random_mix_of_served_cancelled_and_timed_out_requests" \
          "tests/e2e/test_serve_cli.py::test_serve_answers_the_openai_api_and_sigint_answers_every_client_then_exits" \
          > "$OUT/serve_flaky.log" 2>&1
        echo "serve flaky-two pytest rc=$?"
        grep -E "(PASSED|FAILED|ERROR)( |$)|passed|failed|Error" "$OUT/serve_flaky.log" | tail -12
        timeout 300 python3 -m pytest -v -p no:cacheprovider -rA --tb=short --durations=12 \
          -o faulthandler_timeout=150 tests/serve tests/e2e/test_serve.py \
          tests/e2e/test_serve_replicas.py tests/e2e/test_serve_cli.py > "$OUT/serve_tests.log" 2>&1
        echo "serve pytest rc=$?"
        grep -E "(PASSED|FAILED|ERROR)( |$)|passed|failed|[0-9.]+s (call|setup)" "$OUT/serve_tests.log" \
          | grep -v "^tests/serve" | cut -c1-160 | tail -40
        cp -r /tmp/ray/session_latest/logs/serve "$OUT/serve_logs" 2>/dev/null
        timeout 90 python3 benchmarks/bench_serve.py --device gpu --requests 8 --context 120 \
          --new-tokens 32 --rounds 2 --out "$OUT/serve_gpu.json" > "$OUT/serve_bench.log" 2>&1
        echo "bench_serve rc=$?"
        grep -v -E "NIXL INFO|WARNING|INFO " "$OUT/serve_bench.log" | tail -14
        exit 0 ;;
      b23)  # ~3 min: issue #16 B2 (rank 0's events order the peers) and B3 (one wire)
        timeout 85 python3 -m pytest -q -p no:cacheprovider -m "gpu and not two_gpus" \
          tests/host/test_ray.py "tests/e2e/test_gpu.py::test_tp2_landings_spills_restores_backups_match_full_resident" \
          2>&1 | tee "$OUT/b23_tests.log" | grep -E "passed|failed|FAILED|Error|^tp2" | tail -12
        timeout 15 python3 benchmarks/bench_wire.py --tp 2 --steps 200 --out "$OUT/wire_b23.json" 2>&1 | tail -11
        timeout 50 python3 benchmarks/bench_control_plane.py --only control --probes 200 \
          --out "$OUT/control_plane_b23.json" > "$OUT/control_plane_b23.log" 2>&1
        grep -E "$keep|^stages" "$OUT/control_plane_b23.log" | tail -7
        exit 0 ;;
      stepevents)  # ~3 min: IPC events indexed by step (host pool, actors, TP 2 on one GPU)
        timeout 280 python3 -m pytest -q -p no:cacheprovider -rA -m "gpu and not two_gpus" \
          tests/host/test_gpu_pool.py tests/host/test_ray.py tests/host/test_step_events.py \
          tests/landing/test_landing_lock.py tests/e2e/test_gpu.py 2>&1 | tee "$OUT/stepevents_tests.log" \
          | grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Error" | tail -20
        exit 0 ;;
      control)  # ~3 min: the wire bench and the actor system's control plane
        timeout 60 python3 benchmarks/bench_wire.py --out "$OUT/wire.json" 2>&1 | tail -9
        timeout 120 python3 benchmarks/bench_control_plane.py --only control --probes 1000 \
          --out "$OUT/control_plane.json" > "$OUT/control_plane.log" 2>&1
        grep -E "$keep" "$OUT/control_plane.log" | tail -10
        exit 0 ;;
    esac
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
             "bench_wire.py --out $OUT/wire.json" "bench_hot_counts.py --out $OUT/hot_counts.json"; do
      echo "== $b"
      timeout 60 python3 benchmarks/$b 2>&1 | tail -25 | tee -a "$OUT/benches.log"
    done
    ;;
esac
