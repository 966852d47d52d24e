#!/usr/bin/env bash
# Run here (where pip reaches PyPI) before a GPU check: the wheels the lent GPU machine lacks
# (its Python 3.12 has torch, triton, transformers, ... but not pydantic), into .whl/ (git-ignored),
# for scripts/gpu_check.sh to install there without a registry. Versions: this checkout's .venv's.
set -euo pipefail
cd "$(dirname "$0")/.."
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf .whl && mkdir -p .whl  # one version of each: two stop the whole install there
for name in pydantic pydantic_core annotated-types typing-inspection typing_extensions; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$name==$(version "$name")"
done
du -sh .whl
