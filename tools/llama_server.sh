#!/usr/bin/env bash
# llama.cpp's own server, the CPU server users would otherwise pick, for `osd bench-serve --against`.
#   tools/llama_server.sh build [DIR]        build llama-server from the llama-cpp-python source package
#                                            (PyPI; about 5 minutes on 2 cores) under DIR (default /opt/llamacpp),
#                                            for this CPU less its AMX tiles: where the CPU lists AMX but the
#                                            kernel does not grant its tile state (virtual machines), llama.cpp's
#                                            AMX kernels die at the first token with SIGILL
#   tools/llama_server.sh run PORT [DIR]     serve the embedded SmolLM2-135M GGUF on 127.0.0.1:PORT with
#                                            continuous batching over 8 slots and 2 threads (foreground)
set -euo pipefail
cmd=${1:?build or run}
here=$(cd "$(dirname "$0")/.." && pwd)
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
py=${PY:-$here/.venv/bin/python}
case $cmd in
  build)
    dir=${2:-/opt/llamacpp}
    mkdir -p "$dir" && cd "$dir"
    "$py" -m pip download -q --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d .
    tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON \
      -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX"
    cmake --build build --target llama-server -j 2
    echo "$dir/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
    ;;
  run)
    port=${2:?port}
    dir=${3:-/opt/llamacpp}
    gguf=$("$py" -c 'from speculative.locate import embedded_gguf_path; print(embedded_gguf_path())')
    exec "$dir/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server" -m "$gguf" -t 2 -c 8192 --parallel 8 \
      --host 127.0.0.1 --port "$port"
    ;;
  *) echo "usage: $0 build [DIR] | run PORT [DIR]" >&2; exit 2 ;;
esac
