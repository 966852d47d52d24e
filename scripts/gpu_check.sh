#!/usr/bin/env bash
# The GPU check: one prepared run for a lent GPU machine (docs/gpu.md). Installs the carried
# wheels (.whl/, from scripts/gpu_wheels.sh), builds the native libraries, then runs, each step
# under a timeout and whatever the previous ones did:
#   tests_gpu       tests/gpu: Triton kernels on CUDA vs their references, MX modules CUDA vs CPU,
#                   ring attention on the GPU vs torch's SDPA
#   tests_existing  the CUDA cases of the existing tests (tests/dist, tests/multicore, tests/mx)
#   bench           benchmarks/mx_gpu.py: MX GEMM per path vs bf16, the seed MoE experts
#   train_bf16      a few steps of the trainer on configs/qwen3_moe.yaml, MXFP8 off ...
#   train_mxfp8     ... and on
# and writes everything into $OUT/gpu_check.json (scripts/gpu_check_summary.py) beside a few logs.
#
#   bash scripts/gpu_check.sh                                   # there: python3, OUT set by the tool
#   PYTHON=.venv/bin/python OUT=/tmp/gco bash scripts/gpu_check.sh   # a dry run here (CUDA steps skip)
#
# Environment: PYTHON (python3), OUT (/tmp/gpu_check_out), BUDGET_S (450: the whole run's seconds;
# each step gets at most what is left), TRAIN_STEPS (30), SKIP (space-separated step names).
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check_out}
BUDGET_S=${BUDGET_S:-450}
TRAIN_STEPS=${TRAIN_STEPS:-30}
SKIP=${SKIP:-}
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
SITE=/tmp/site
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
: >"$LOG"
: >"$WORK/steps.tsv"
export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
export TRITON_CACHE_DIR=$WORK/triton-cache
export HYPERPARALLEL_CACHE=$WORK/data-cache
START=$SECONDS

say() { echo "[gpu_check +$((SECONDS - START))s] $*" | tee -a "$LOG"; }

# step NAME BUDGET_SECONDS LOGFILE COMMAND...: runs COMMAND under `timeout`, its output into
# LOGFILE (and the main log), and records name, exit status, seconds and log in steps.tsv.
step() {
    local name=$1 budget=$2 logfile=$3
    shift 3
    local left=$((BUDGET_S - (SECONDS - START)))
    if [[ " $SKIP " == *" $name "* ]]; then
        say "step $name: skipped (SKIP)"
        printf '%s\t%s\t%s\t%s\n' "$name" skipped 0 "$logfile" >>"$WORK/steps.tsv"
        return 0
    fi
    if ((left < 20)); then
        say "step $name: skipped, ${left}s of the ${BUDGET_S}s budget left"
        printf '%s\t%s\t%s\t%s\n' "$name" no_time 0 "$logfile" >>"$WORK/steps.tsv"
        return 0
    fi
    ((budget > left)) && budget=$left
    say "step $name (timeout ${budget}s): $*"
    local t0=$SECONDS rc
    if declare -F "$1" >/dev/null; then  # a function of this script: `timeout` runs programs only
        timeout -s INT -k 10 "$budget" bash -c '"$@"' _ "$@" >"$logfile" 2>&1
    else
        timeout -s INT -k 10 "$budget" "$@" >"$logfile" 2>&1
    fi
    rc=$?
    local took=$((SECONDS - t0))
    tail -n 40 "$logfile" >>"$LOG"
    say "step $name: exit $rc after ${took}s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$took" "$logfile" >>"$WORK/steps.tsv"
    return 0
}

install_wheels() {
    shopt -s nullglob
    local wheels=("$ROOT"/.whl/*.whl)
    shopt -u nullglob
    if ((${#wheels[@]} == 0)); then
        echo "no wheels in .whl/ (scripts/gpu_wheels.sh makes them; the run carries them with carry: [\".whl\"])"
        "$PY" -c "import pydantic" && echo "pydantic is importable anyway" && return 0
        return 1
    fi
    rm -rf "$SITE"
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "${wheels[@]}"; then
        rm -rf "$SITE"  # the wheels are CPython 3.12's: a dry run under another Python may have pydantic
        "$PY" -c "import pydantic" 2>/dev/null && echo "the wheels did not install; this Python has pydantic" && return 0
        return 1
    fi
    "$PY" -c "import pydantic, pydantic_core; print('pydantic', pydantic.VERSION, 'from', pydantic.__file__)"
}

# setup.py's libraries in place; if setuptools cannot run setup.py (an older one than
# pyproject.toml's metadata needs), the same Extensions compiled by hand with setup.py's flags.
build_native() {
    "$PY" setup.py -q build_ext --inplace -j "$(nproc)" && return 0
    echo "setup.py build_ext failed; compiling setup.py's Extensions directly"
    "$PY" - <<'EOF'
import runpy, subprocess, sys, sysconfig
import setuptools

captured = {}
setuptools.setup = lambda **kw: captured.update(kw)
runpy.run_path("setup.py", run_name="__main__")
suffix = sysconfig.get_config_var("EXT_SUFFIX")
for ext in captured["ext_modules"]:
    target = ext.name.replace(".", "/") + suffix
    cmd = (["gcc", "-shared", "-fPIC", *ext.extra_compile_args, *[f"-I{d}" for d in ext.include_dirs],
            *ext.sources, "-o", target, *ext.extra_link_args, *[f"-l{lib}" for lib in ext.libraries]])
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
EOF
}

versions() {
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    "$PY" - "$WORK/versions.json" <<'EOF'
import importlib.metadata as md, json, platform, sys
import torch
info = {"python": sys.version.split()[0], "executable": sys.executable, "machine": platform.machine(),
        "torch": torch.__version__, "cuda_runtime": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
for name in ("triton", "transformers", "safetensors", "tokenizers", "numpy", "pydantic", "pydantic-core", "pytest",
             "setuptools", "pyarrow"):
    try:
        info[name] = md.version(name)
    except md.PackageNotFoundError:
        info[name] = None
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    info.update(device=props.name, capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                memory_gib=round(props.total_memory / 2**30, 1), device_count=torch.cuda.device_count())
import importlib.util
info["native_libraries"] = {m: importlib.util.find_spec(f"hyperparallel.{m}") is not None
                            for m in ("_mx_native", "_dvm_native", "_mega_gate_native", "_mega_mhc_native")}
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info, indent=1))
EOF
}

# a few trainer steps on the smallest MoE config; the metrics stay in the run directory
train() {
    local label=$1 mx=$2
    "$PY" -m hyperparallel train configs/qwen3_moe.yaml \
        --set training.steps="$TRAIN_STEPS" --set training.mixed_precision=bf16 --set training.eval_every=0 \
        --set checkpoint.every=0 --set logging.every=5 --set data.max_corpus_bytes=500000 \
        --set data.cache_dir="$WORK/data-cache" --set low_precision.enabled="$mx" \
        --set logging.run_dir="$WORK/run_$label"
}

# what the step functions read, for the `bash -c` that `timeout` starts them in
export PY SITE ROOT WORK TRAIN_STEPS
export -f install_wheels build_native versions train

say "root $ROOT, python $PY, out $OUT, work $WORK, budget ${BUDGET_S}s"
step setup 60 "$WORK/setup.log" install_wheels
step build 120 "$WORK/build.log" build_native
step versions 60 "$WORK/versions.log" versions
cat "$WORK/versions.log" >>"$LOG"
step tests_gpu 240 "$OUT/pytest_gpu.log" "$PY" -m pytest -p no:cacheprovider -q -rfEs --durations=15 \
    --junitxml="$WORK/junit_tests_gpu.xml" tests/gpu
# without a GPU (a dry run) the benchmark's smoke mode, so that its code runs all the same
BENCH_ARGS=()
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null ||
    BENCH_ARGS=(--device cpu --small)
step bench 110 "$OUT/bench.log" "$PY" benchmarks/mx_gpu.py --json "$WORK/bench.json" "${BENCH_ARGS[@]}"
step train_bf16 70 "$OUT/train_bf16.log" train bf16 false
step train_mxfp8 70 "$OUT/train_mxfp8.log" train mxfp8 true
# the CUDA cases of the existing tests (their CPU cases run everywhere else), then the Triton
# interpreter's backend tests, which hold one CUDA check
step tests_existing 90 "$OUT/pytest_existing.log" "$PY" -m pytest -p no:cacheprovider -q -rfEs --durations=10 \
    --junitxml="$WORK/junit_tests_existing.xml" -k cuda tests/dist/test_device_paths.py tests/multicore/test_scheduler.py
step tests_triton_interp 60 "$WORK/pytest_triton_interp.log" "$PY" -m pytest -p no:cacheprovider -q -rfE \
    --junitxml="$WORK/junit_tests_triton_interp.xml" tests/mx/test_triton_backend.py -k "unavailable_reason or corner_cases"
cat "$WORK/pytest_triton_interp.log" >>"$OUT/pytest_existing.log" 2>/dev/null

say "summary"
"$PY" "$ROOT/scripts/gpu_check_summary.py" "$WORK" "$OUT/gpu_check.json" 2>&1 | tee -a "$LOG"
cat "$WORK/setup.log" "$WORK/build.log" >"$OUT/setup_build.log" 2>/dev/null
say "done in $((SECONDS - START))s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
