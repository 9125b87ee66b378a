#!/usr/bin/env bash
# Set up `osd experiment` / `osd bench` on a machine without network whose python3 already has torch
# and transformers (a GPU machine): install a folder of wheels into a site folder and build the
# suffix tree's C++ (arctic-inference 0.3.0's csrc/suffix_decoding, nanobind + CMake) against this
# Python, beside the package's Python files. Then `export PYTHONPATH=$SITE` and run bench/gpu_check.sh.
#   W=/path/to/wheels SITE=/tmp/site bash bench/offline_setup.sh
# W holds the wheels this python lacks (for the experiments: gguf, nanobind and, where missing,
# pydantic with its pydantic_core for this Python, annotated-types, typing-inspection,
# typing-extensions; fetch them elsewhere with `pip download --no-deps --only-binary=:all:
# --python-version X.Y ...`) and arctic-inference's source package, fetched with
# `pip download --no-binary :all: --no-deps --no-build-isolation arctic-inference==0.3.0`.
set -euo pipefail
W=${W:?folder of wheels and arctic_inference-0.3.0.tar.gz}
SITE=${SITE:-/tmp/site}
PY=${PYTHON:-python3}
mkdir -p "$SITE"
shopt -s nullglob
wheels=("$W"/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
src=$(mktemp -d)
tar -xzf "$W"/arctic_inference-0.3.0.tar.gz -C "$src"
root="$src/arctic_inference-0.3.0"
mkdir -p "$SITE/arctic_inference/suffix_decoding"
cp "$root/arctic_inference/__init__.py" "$SITE/arctic_inference/"
cp "$root"/arctic_inference/suffix_decoding/*.py "$SITE/arctic_inference/suffix_decoding/"
cmake -S "$root/csrc/suffix_decoding" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$(command -v "$PY")" >"$src/build.log" 2>&1 \
  && cmake --build "$src/build" -j "$(nproc)" >>"$src/build.log" 2>&1 || { tail -30 "$src/build.log"; exit 1; }
cp "$src"/build/_C*.so "$SITE/arctic_inference/suffix_decoding/"
rm -rf "$src"
$PY -c "from arctic_inference.suffix_decoding import SuffixDecodingCache; import gguf, pydantic; print('ready:', '$SITE')"
