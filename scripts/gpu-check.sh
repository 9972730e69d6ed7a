#!/usr/bin/env bash
# The gpu lane and the GPU bench on a machine with an NVIDIA GPU, from the
# bundle scripts/gpu-bundle.sh made on a CPU machine (nothing is compiled
# here: the kernels are compiled at load by NVRTC). Packages are built here
# from their specs by the carried xtask. Prints a summary table last; logs
# go to $OUT (or target/gpu-check) when set.
#   scripts/gpu-check.sh [bundle.tar.xz]
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=${1:-target/gpu-bundle/bundle.tar.xz}
logs=${OUT:-target/gpu-check}
mkdir -p "$logs" target/release target/onnxruntime
python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$bundle" target/gpu-run || exit 2
mv target/gpu-run/libonnxruntime.so.1.31.1 target/onnxruntime/
x=target/gpu-run/xtask
chmod +x "$x"
export ONNX_GENAI_REQUIRE_GPU=1
# NVRTC and cuBLAS from the toolkit or the Python wheels, whichever is here.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    $(python3 -c "import nvidia, os; b=os.path.dirname(nvidia.__file__); print(' '.join(os.path.join(b,p,'lib') for p in os.listdir(b)))" 2>/dev/null); do
    [ -d "$d" ] && LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
done
export LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$logs/gpu.txt"
declare -A status
run() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    echo "==> $name"
    timeout "$limit" "$@" 2>&1 | tee "$logs/$name.log"
    local rc=${PIPESTATUS[0]}
    status[$name]="rc=$rc $((SECONDS - t0))s"
}
run trace 60 "$x" gpu-trace
run conformance 120 "$x" conformance --backend native-cuda --no-real --threads 8
run bench 300 "$x" bench --backend native-cuda --rounds 3 --steps 64 --threads 16
cp target/conformance/report.md "$logs/conformance-report.md" 2>/dev/null
cp target/bench/cuda.md "$logs/bench-cuda.md" 2>/dev/null
echo
echo "== summary ($(date -u +%F))"
for k in trace conformance bench; do echo "$k: ${status[$k]:-not run}"; done
grep -E "^(passed|failed|[0-9]+ (passed|failed))|checks" target/conformance/report.md 2>/dev/null | head -5
tail -n 4 "$logs/bench.log" 2>/dev/null
for k in trace conformance; do case "${status[$k]}" in rc=0*) ;; *) exit 1;; esac; done
