#!/usr/bin/env bash
# The example dataset on a real inference engine: llama.cpp's llama-server (built once, cached)
# serving a tiny random-weight llama written now, genq rendering the prompts with that model's
# own tokenizer and sending token ids through its llamacpp backend.
#
#   ops/llamacpp/demo.sh [OUT]        (make real-engine)
#
# Needs the project's venv (.venv, `make` sets it up) and cmake + g++ for the first build.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-out-llama}"
bin=.venv/bin
server=$(bash ops/llamacpp/build-server.sh | tail -1)
mkdir -p "$out/model"
"$bin/python" ops/llamacpp/tiny_model.py "$out/model/tiny.gguf" --hf-tokenizer "$out/model/tokenizer" 2>/dev/null
port=$("$bin/python" -c 'from genq.commands.embedded import free_port; print(free_port())')
"$server" -m "$out/model/tiny.gguf" --host 127.0.0.1 --port "$port" -t 1 --parallel 8 -c 4096 \
  >"$out/model/llama-server.log" 2>&1 &
llama=$!
trap 'kill "$llama" 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  sleep 0.1
done
"$bin/genq" run examples/prompts.jsonl --out "$out" --server "http://127.0.0.1:$port" --backend llamacpp \
  --tokenizer "$out/model/tokenizer" --max-new-tokens 64 --temperature 0
