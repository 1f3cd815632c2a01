#!/usr/bin/env bash
# Everything a session with a lent NVIDIA GPU runs, in one go: the GPU tests, the kernel and
# engine benchmark (with a decode-batch sweep) and KV transfer between two processes with
# both caches in GPU memory. For a CUDA image without this project's virtualenv (python3
# with torch, triton, transformers, grpcio, protobuf, prometheus-client): the packages it
# lacks travel as wheels in ./.gpu-wheels (docs/gpu.md says which and how to fetch them).
#
#   bench/gpu_session.sh OUT_DIR [tests] [bench] [kv]     (no stage named: all three)
#
# Each stage has its own time limit (TESTS_S, BENCH_S, KV_S seconds), so one that hangs
# cannot eat the others' time; every stage's output goes to OUT_DIR/session.log and each
# result file to OUT_DIR. BATCH_SWEEP: the benchmark's further decode batches (default
# 1,16,64; empty: none).
set -u
out=${1:?usage: bench/gpu_session.sh OUT_DIR [tests] [bench] [kv]}
shift
stages=${*:-tests bench kv}
mkdir -p "$out"
log=$out/session.log
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

stage() {  # stage SECONDS NAME COMMAND...: run it under a time limit, log and time it
    local limit=$1 name=$2
    shift 2
    echo "== $name (limit ${limit}s) $(date -u +%T)" >>"$log"
    local started=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - started))s" >>"$log"
}

if compgen -G ".gpu-wheels/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/gpu-site .gpu-wheels/*.whl >>"$log" 2>&1 || echo "wheel install failed" >>"$log"
    export PYTHONPATH=/tmp/gpu-site
fi
{ nvidia-smi; python3 -c "import torch, triton, transformers; print('torch', torch.__version__,
'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"; } >>"$log" 2>&1

case " $stages " in *" tests "*)
    stage "${TESTS_S:-150}" "GPU tests" python3 -m pytest -q -p no:cacheprovider -n 4 \
        --junitxml="$out/gpu_tests.xml" tests/test_triton_attention.py \
        tests/test_decode_graphs.py tests/test_gpu_engine.py tests/test_triton_compile.py ;;
esac
case " $stages " in *" bench "*)
    stage "${BENCH_S:-200}" "kernels and engine vs HF" python3 bench/gpu_benchmark.py \
        --synthetic-shape smollm2-135m --batch-sweep "${BATCH_SWEEP-1,16,64}" \
        --out "$out/gpu_benchmark.json" ;;
esac
case " $stages " in *" kv "*)
    stage "${KV_S:-45}" "KV transfer, GPU memory" python3 -m bench.kv_transfer_bandwidth \
        --device cuda --iters 3 --warmup 1 --output "$out/kv_transfer_cuda.json" ;;
esac
echo "== done $(date -u +%T)" >>"$log"
