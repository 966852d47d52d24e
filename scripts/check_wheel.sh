#!/usr/bin/env bash
# The package as a cluster user installs it (`make test-wheel`, run by .ci/run): a wheel built from
# this checkout, installed in a fresh venv outside it, and `hyperparallel train` run there from an
# empty directory: the embedded default, an example config by name (with its data beside it), the
# native kernels loaded. Then the same source built where no C compiler works: the build says so in
# one line, and the package it installs trains on the portable paths.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
work=$(mktemp -d /tmp/hyperparallel-wheel.XXXXXX)
trap 'rm -rf "$work"' EXIT
say() { echo "check_wheel: $*"; }

# the source as a clone has it (what git tracks, and new files not ignored), built from a copy: no
# build of this checkout's is reused
copy_source() {
  mkdir -p "$1" && git ls-files -z --cached --others --exclude-standard | tar -c --null -T - | tar -x -C "$1"
}
copy_source "$work/src"
# the wheel: the native libraries and the example configs inside it
.venv/bin/pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$work/src"
wheel=$(ls "$work"/dist/hyperparallel-*.whl)
contents=$(unzip -Z1 "$wheel")
for member in hyperparallel/_mx_native hyperparallel/_dvm_native hyperparallel/_mega_gate_native \
    hyperparallel/_mega_mhc_native hyperparallel/configs/default.yaml hyperparallel/configs/qwen3_moe.yaml \
    hyperparallel/configs/models/qwen3_tiny.yaml hyperparallel/configs/data/same_answer_chats.jsonl \
    hyperparallel/fusion/vf_table.txt; do
  grep -q "^$member" <<< "$contents" || { echo "check_wheel: $member is not in $(basename "$wheel")" >&2; exit 1; }
done
say "built $(basename "$wheel") ($(du -h "$wheel" | cut -f1)), with the native kernels and the example configs"

# a fresh venv outside the checkout (torch first: the CPU build, as make setup installs it)
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/pip" install -q "$TORCH_SPEC"
"$work/venv/bin/pip" install -q "$wheel"
mkdir "$work/elsewhere" && cd "$work/elsewhere"
"$work/venv/bin/python" - <<'EOF'
import torch
import hyperparallel
from hyperparallel.mx.backends import cpu
assert "site-packages" in hyperparallel.__file__, hyperparallel.__file__
assert cpu.unavailable_reason(torch.device("cpu")) is None, cpu.unavailable_reason(torch.device("cpu"))
EOF
say "installed in a fresh venv: $("$work/venv/bin/pip" list 2>/dev/null | grep -E '^(hyperparallel|torch|transformers) ' | tr -s ' ' | paste -sd, -)"

# the embedded default, a few steps of it (make demo runs it whole)
SHORT=(--set training.steps=4 --set training.eval_every=4 --set data.max_corpus_bytes=300000 --set logging.every=2)
"$work/venv/bin/hyperparallel" train "${SHORT[@]}" --set logging.run_dir=default > default.log
grep -q "done: 4 steps" default.log || { cat default.log; exit 1; }
test -s default/metrics.jsonl && test -s default/checkpoints/step_00000004/checkpoint.json
say "hyperparallel train (the embedded default) trained 4 steps from $PWD: $(grep 'done:' default.log)"
# an example by name, its data file beside it in the package
"$work/venv/bin/hyperparallel" train chat --set training.steps=2 --set logging.run_dir=chat > chat.log
grep -q "done: 2 steps" chat.log || { cat chat.log; exit 1; }
say "hyperparallel train chat: $(grep 'done:' chat.log)"

# no C compiler: the build says so in one line; the package installs and trains on the portable paths
cd "$ROOT"
copy_source "$work/src-portable"
CC=false .venv/bin/pip wheel -v --no-deps --no-build-isolation -w "$work/portable" "$work/src-portable" \
  > "$work/portable.log" 2>&1
grep "hyperparallel: no native CPU kernels built" "$work/portable.log"
if unzip -Z1 "$work"/portable/hyperparallel-*.whl | grep -q "_native"; then
  echo "check_wheel: the wheel built without a compiler holds a native library" >&2; exit 1
fi
"$work/venv/bin/pip" install -q --force-reinstall --no-deps "$work"/portable/hyperparallel-*.whl
cd "$work/elsewhere"
"$work/venv/bin/python" -c "
import torch
from hyperparallel.mx.backends import cpu
print('check_wheel: the portable package says:', cpu.unavailable_reason(torch.device('cpu')))"
# no C++ compiler either: the default's Inductor is refused in one line before any work (exit 2)
status=0
CXX=no-such-compiler "$work/venv/bin/hyperparallel" train "${SHORT[@]}" --set logging.run_dir=refused \
  > refused.log 2>&1 || status=$?
test "$status" = 2 && test ! -e refused && grep -q "inductor compiles C++" refused.log || { cat refused.log; exit 1; }
say "no C++ compiler: $(cat refused.log)"
"$work/venv/bin/hyperparallel" train "${SHORT[@]}" --set training.compile=none --set logging.run_dir=portable \
  > portable.log
grep -q "done: 4 steps" portable.log || { cat portable.log; exit 1; }
grep "the native CPU kernels are not built" portable.log
say "without a C compiler: installed and trained 4 steps on the portable paths (training.compile: none)"
