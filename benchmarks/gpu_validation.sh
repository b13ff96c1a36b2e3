#!/usr/bin/env bash
# The GPU validation recorded in docs/benchmarks.md: environment, the benchmark (bench_logprob.py, with
# BENCH_ARGS), a waiting call's tail (bench_wait.py), the whole test suite, the checked-in GPU sweep, the peaked
# workload, and the design card's command with tp up to 8.
# Usage (from the repo root, on a CUDA machine): bash benchmarks/gpu_validation.sh [OUT_DIR]
# STEPS="bench pytest" runs only the named steps (default: all of bench wait pytest gpu_tp peaked design_card report).
set -uo pipefail
out="${1:-${OUT:-gpu-validation}}"
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"

step() {  # step NAME COMMAND...: run, keep the log, record the exit code and the seconds it took
    local name=$1; shift
    case " ${STEPS:-bench wait pytest gpu_tp peaked design_card report} " in *" $name "*) ;; *) return 0 ;; esac
    local start=$SECONDS
    "$@" >"$out/$name.log" 2>&1
    local rc=$?
    printf '%-14s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - start))" "$(tail -n 1 "$out/$name.log")" | tee -a "$summary"
}

python3 - <<'PY' | tee "$out/environment.txt"
import platform, torch, triton
print("python", platform.python_version(), "| torch", torch.__version__, "| triton", triton.__version__,
      "| cuda", torch.version.cuda, "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")
PY
python3 -m pip list 2>/dev/null | grep -iE "^(numpy|pandas|pyarrow|hydra-core) " | tee -a "$out/environment.txt"

step bench python3 benchmarks/bench_logprob.py --out "$out" ${BENCH_ARGS:-}
step wait python3 benchmarks/bench_wait.py --out "$out"
step pytest python3 -m pytest -q -p no:cacheprovider -rs
step gpu_tp python3 -m rlsweep sweep=gpu_tp hydra.sweep.dir="$out/gpu_tp"
step peaked python3 -m rlsweep profile=triton_cuda_bf16,cuda_bf16 model=qwen3_8b workload=peaked \
    hydra.sweep.dir="$out/peaked" --multirun
# The design card's command exactly as written: its sweep lands under outputs/multirun/<date>/<time>.
step design_card python3 -m rlsweep profile=triton_cuda_bf16 tp=1,2,4,8 --multirun
card=$(ls -d outputs/multirun/*/* 2>/dev/null | tail -n 1)
if [ -n "$card" ]; then
    step report python3 -m rlsweep.report "$card"
    echo "design card sweep: $card" | tee -a "$summary"
    cp -r "$card" "$out/design_card"
fi
cat "$summary"
[ -f "$out/pytest.log" ] && grep -E "^(FAILED|ERROR|SKIPPED)" "$out/pytest.log" | cut -c1-220 | head -40
[ -f "$out/bench.log" ] && tail -n 25 "$out/bench.log"
[ -f "$out/wait.log" ] && cat "$out/wait.log"
