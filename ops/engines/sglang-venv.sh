#!/usr/bin/env bash
# Build a virtualenv with the real SGLang 0.5.23 that serves a tiny model on the CPU (no GPU, no
# CUDA packages), for genq's real-engine tests. Only PyPI is needed.
#
#   py=$(ops/engines/sglang-venv.sh | tail -1)
#   SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=ops/engines/cpu_stubs "$py" -m sglang.launch_server \
#     --model-path MODEL --device cpu --attention-backend torch_native \
#     --cuda-graph-backend-decode disabled --cuda-graph-backend-prefill disabled \
#     --mem-fraction-static 0.1 --skip-server-warmup --sleep-on-idle --max-total-tokens 65536
#
# ops/engines/cpu_stubs must come first on PYTHONPATH: it holds the stand-ins for sgl_kernel and
# torchvision that SGLang imports at start-up (see their docstrings). The venv also has
# transformers, tokenizers and safetensors, so `"$py" ops/engines/tiny_model.py DIR` writes a model.
#
# The venv is cached outside the clone, keyed by a hash of this script and
# ops/engines/sglang-requirements.txt (changing either builds a new one):
#   ${GENQ_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/genq}/sglang-0.5.23-<key>/bin/python
# A venv counts as finished only once its .complete marker exists (written last); a cached one is
# reused at once, an unfinished one (a killed build) is removed and built again. ~1.5 min and
# ~2.8 GB from scratch. Progress goes to stderr; the last stdout line is the venv's python.
#
# Needs: python3.11 with the venv module (Debian: python3-venv), pip reaching PyPI, and the CPU
# build of torch 2.13.0 where pip finds it (this machine's pip config has it in /opt/wheels): the
# script refuses to go on if pip would take any other torch build (PyPI's is the multi-GB CUDA one).
#
# Environment:
#   GENQ_ENGINE_CACHE  cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/genq)
#   PYTHON             python that creates the venv (default python3; must be 3.11)
set -euo pipefail

readonly SGLANG_VERSION="0.5.23"
readonly TORCH_VERSION="2.13.0"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
readonly HERE
readonly REQUIREMENTS="${HERE}/sglang-requirements.txt"
readonly CACHE_ROOT="${GENQ_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/genq}"
readonly PY="${PYTHON:-python3}"

log() { printf '[sglang-venv] %s\n' "$*" >&2; }
die() { printf '[sglang-venv] error: %s\n' "$*" >&2; exit 1; }

[[ -f "$REQUIREMENTS" ]] || die "missing $REQUIREMENTS"
key="$(cat "${BASH_SOURCE[0]}" "$REQUIREMENTS" | sha256sum | cut -c1-12)"
readonly VENV="${CACHE_ROOT}/sglang-${SGLANG_VERSION}-${key}"
readonly VPY="${VENV}/bin/python"

# Fast path: .complete is written only after every step below succeeded.
if [[ -f "${VENV}/.complete" && -x "$VPY" ]]; then
  printf '%s\n' "$VPY"
  exit 0
fi

command -v "$PY" >/dev/null 2>&1 || die "$PY not found"
pyver="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[[ "$pyver" == "3.11" ]] || die "$PY is Python $pyver; the pins are for 3.11 (set PYTHON=python3.11)"
"$PY" -c 'import venv, ensurepip' 2>/dev/null || die "$PY has no venv/ensurepip (Debian: apt-get install python3-venv)"

mkdir -p "$CACHE_ROOT"

# Serialise concurrent builds of the same venv (e.g. two CI jobs on one box).
if command -v flock >/dev/null 2>&1; then
  exec 9>"${VENV}.lock"
  flock 9
  if [[ -f "${VENV}/.complete" && -x "$VPY" ]]; then   # another process finished while we waited
    printf '%s\n' "$VPY"
    exit 0
  fi
fi

# A venv's scripts hold its absolute path, so it is built in place; whatever is there without the
# marker is a build that was killed, and goes.
rm -rf -- "$VENV"
work="$(mktemp -d "${TMPDIR:-/tmp}/genq-sglang-venv.XXXXXX")"
ok=0
cleanup() {
  rm -rf -- "$work"
  ((ok)) || rm -rf -- "$VENV"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start=$SECONDS
# Every pip call below gets this on top of the machine's own pip config: torch stays the CPU build.
printf 'torch==%s\n' "$TORCH_VERSION" >"$work/constraints.txt"
# This machine's pip config lists local index folders that lack most projects; pip warns once per
# project ("Location ... is ignored"), which only buries the progress lines.
pip_install() {
  "$VPY" -m pip install --quiet --disable-pip-version-check --only-binary :all: \
    -c "$work/constraints.txt" "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2) >&2
}

log "creating venv ${VENV}"
"$PY" -m venv "$VENV"

# Ask pip which torch file it would take before downloading anything: PyPI's torch for Linux is
# the CUDA build (and pulls ~3 GB of nvidia-* wheels).
report="$("$VPY" -m pip install --quiet --disable-pip-version-check --dry-run --no-deps \
  --ignore-installed --report - "torch==${TORCH_VERSION}" 2>/dev/null)" || die "pip cannot find torch==${TORCH_VERSION}"
url="$(printf '%s' "$report" | "$VPY" -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["download_info"]["url"])')"
case "$url" in
  *%2Bcpu-* | *+cpu-*) log "torch ${TORCH_VERSION} CPU build: ${url}" ;;
  *) die "pip would install torch from ${url}, not the CPU build; put torch-${TORCH_VERSION}+cpu in a pip --find-links folder" ;;
esac

log "installing torch==${TORCH_VERSION} (CPU)"
pip_install "torch==${TORCH_VERSION}"

log "installing the pinned dependencies (${REQUIREMENTS##*/})"
pip_install -r "$REQUIREMENTS"

# --no-deps: sglang's metadata asks for CUDA torch 2.14.1, sglang-kernel, flashinfer, ...
log "installing sglang==${SGLANG_VERSION} (--no-deps)"
pip_install --no-deps "sglang==${SGLANG_VERSION}"

log "checking the venv"
"$VPY" - "$SGLANG_VERSION" >&2 <<'EOF' || die "the new venv fails its check"
import importlib.metadata as md
import sys

import safetensors  # noqa: F401  (tiny_model.py needs these three)
import tokenizers  # noqa: F401
import torch
import transformers  # noqa: F401

assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build"
assert md.version("sglang") == sys.argv[1], md.version("sglang")
cuda = [d.metadata["Name"] for d in md.distributions()
        if d.metadata["Name"].lower().startswith(("nvidia-", "cuda-")) and d.metadata["Name"] != "nvidia-ml-py"]
assert not cuda, f"CUDA packages in the venv: {cuda}"
print(f"torch {torch.__version__}, sglang {md.version('sglang')}, transformers {transformers.__version__}")
EOF

touch "${VENV}/.complete"
ok=1
log "done in $((SECONDS - start))s ($(du -sh "$VENV" | cut -f1))"
printf '%s\n' "$VPY"
