#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (and nothing else) from the llama.cpp source
# vendored in the llama-cpp-python sdist on PyPI, so CI needs no network beyond PyPI.
#
#   path=$(ops/llamacpp/build-server.sh | tail -1)
#
# The binary is cached per version outside the clone:
#   ${GENQ_LLAMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/genq}/llama-server-<version>/llama-server
# A cached binary is reused at once. Progress goes to stderr; the last stdout
# line is the binary path.
#
# Needs: cmake (>= 3.14), a C and C++ compiler (gcc/g++), make or ninja, tar,
# python3 with pip. It installs nothing itself (on Debian:
# `apt-get install -y cmake g++ make`).
#
# Environment:
#   GENQ_LLAMA_CACHE       cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/genq)
#   GENQ_LLAMA_CPP_PY_VER  llama-cpp-python version to take llama.cpp from (default below)
#   GENQ_LLAMA_SDIST       path to an already downloaded llama_cpp_python-<ver>.tar.gz
#                          (skips `pip download`)
#   GENQ_LLAMA_JOBS        parallel compile jobs (default 2)
#   PYTHON                 python used for `pip download` (default python3)
set -euo pipefail

# 0.3.36 vendors a llama.cpp with tools/server (router mode, /props, /slots, ...).
readonly VERSION="${GENQ_LLAMA_CPP_PY_VER:-0.3.36}"
readonly CACHE_ROOT="${GENQ_LLAMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/genq}"
readonly DEST_DIR="${CACHE_ROOT}/llama-server-${VERSION}"
readonly DEST="${DEST_DIR}/llama-server"
readonly JOBS="${GENQ_LLAMA_JOBS:-2}"
readonly PY="${PYTHON:-python3}"

log() { printf '[build-server] %s\n' "$*" >&2; }
die() { printf '[build-server] error: %s\n' "$*" >&2; exit 1; }

# Fast path: a finished binary only ever appears through the atomic rename below.
if [[ -x "$DEST" ]]; then
  printf '%s\n' "$DEST"
  exit 0
fi

# Check the toolchain up front so a missing package fails in a second, not mid-build.
missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v g++ >/dev/null 2>&1 || command -v c++ >/dev/null 2>&1 || missing+=(g++)
command -v gcc >/dev/null 2>&1 || command -v cc >/dev/null 2>&1 || missing+=(gcc)
command -v tar >/dev/null 2>&1 || missing+=(tar)
if command -v ninja >/dev/null 2>&1; then
  generator=(-G Ninja)
elif command -v make >/dev/null 2>&1; then
  generator=(-G "Unix Makefiles")
else
  missing+=("make (or ninja)")
fi
if [[ -z "${GENQ_LLAMA_SDIST:-}" ]] && ! "$PY" -m pip --version >/dev/null 2>&1; then
  missing+=("$PY with pip")
fi
if ((${#missing[@]} > 0)); then
  die "missing build tools: ${missing[*]} (on Debian: apt-get install -y cmake g++ make)"
fi

mkdir -p "$DEST_DIR"

# Serialise concurrent builds of the same version (e.g. two CI jobs on one box).
if command -v flock >/dev/null 2>&1; then
  exec 9>"${DEST_DIR}/.lock"
  flock 9
  if [[ -x "$DEST" ]]; then   # another process finished while we waited
    printf '%s\n' "$DEST"
    exit 0
  fi
fi

work="$(mktemp -d "${TMPDIR:-/tmp}/genq-llama-build.XXXXXX")"
partial="${DEST_DIR}/.llama-server.partial.$$"
cleanup() { rm -rf -- "$work" "$partial"; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start=$SECONDS

if [[ -n "${GENQ_LLAMA_SDIST:-}" ]]; then
  [[ -f "$GENQ_LLAMA_SDIST" ]] || die "GENQ_LLAMA_SDIST=$GENQ_LLAMA_SDIST is not a file"
  sdist="$GENQ_LLAMA_SDIST"
else
  log "downloading llama-cpp-python==${VERSION} sdist from PyPI"
  # --no-binary :all: forces the sdist (the wheel carries no llama.cpp source).
  "$PY" -m pip download --quiet --no-deps --no-binary :all: \
    --dest "$work/dl" "llama-cpp-python==${VERSION}" >&2 \
    || die "pip download of llama-cpp-python==${VERSION} failed"
  sdist="$(find "$work/dl" -maxdepth 1 -name 'llama_cpp_python-*.tar.gz' -print -quit)"
  [[ -n "$sdist" ]] || die "no llama_cpp_python sdist in $work/dl"
fi

log "unpacking vendor/llama.cpp from $(basename "$sdist")"
mkdir -p "$work/src"
# Only the vendored tree is needed; --strip-components drops the sdist's top folder.
# The pattern also matches .git/modules/vendor/llama.cpp, which the sdist ships: with it
# llama.cpp's build-info records the upstream commit (llama-server --version, /props build_info).
tar -xzf "$sdist" -C "$work/src" --strip-components=1 --wildcards '*/vendor/llama.cpp/*'
src="$work/src/vendor/llama.cpp"
[[ -f "$src/CMakeLists.txt" ]] || die "vendor/llama.cpp missing from $sdist"

log "configuring (cmake ${generator[*]})"
# LLAMA_USE_PREBUILT_UI=OFF + LLAMA_BUILD_UI=OFF: scripts/ui-assets.cmake then neither
# downloads the web UI from Hugging Face nor runs npm; the server builds without UI.
# LLAMA_OPENSSL=OFF: no HTTPS client needed. GGML_NATIVE=OFF: portable x86-64 build
# (SSE4.2/AVX/AVX2/FMA/F16C/BMI2), not tuned to the build box's CPU.
cmake -S "$src" -B "$work/build" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_OPENSSL=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_UI=OFF \
  -DGGML_NATIVE=OFF \
  -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON \
  -DLLAMA_BUILD_SERVER=ON >&2

log "building llama-server with -j${JOBS} (several minutes on 2 cores)"
cmake --build "$work/build" --config Release --target llama-server -j "$JOBS" >&2

built="$work/build/bin/llama-server"
[[ -x "$built" ]] || die "build finished but $built is missing"
"$built" --version >&2 || die "built llama-server does not run"

# Copy next to the destination first, then rename: rename(2) within one
# filesystem is atomic, so a killed build never leaves a half-written binary.
cp "$built" "$partial"
chmod 0755 "$partial"
mv -f "$partial" "$DEST"

log "done in $((SECONDS - start))s"
printf '%s\n' "$DEST"
