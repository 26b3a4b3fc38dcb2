#!/usr/bin/env bash
# Build a virtualenv with SGLang's router (PyPI `sglang-router` 0.3.2, a.k.a. sgl-model-gateway:
# a Rust binary in a wheel, no GPU, no torch) for genq's router tests:
#
#   py=$(ops/engines/sglang-router-venv.sh | tail -1)
#   "$py" -m sglang_router.launch_router --port 30000 --worker-urls http://a:30001 http://b:30002
#
# The venv is cached outside the clone, keyed by a hash of this script and
# ops/engines/sglang-router-requirements.txt (changing either builds a new one):
#   ${GENQ_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/genq}/sglang-router-0.3.2-<key>/bin/python
# A venv counts as finished only once its .complete marker exists (written last); a cached one is
# reused at once, an unfinished one is removed and built again. ~20 s and ~150 MB from scratch.
# Progress goes to stderr; the last stdout line is the venv's python.
#
# Environment:
#   GENQ_ENGINE_CACHE  cache root (default ${XDG_CACHE_HOME:-$HOME/.cache}/genq)
#   PYTHON             python the venv is made from (default python3)
set -euo pipefail

readonly ROUTER_VERSION="0.3.2"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SELF="${HERE}/$(basename "${BASH_SOURCE[0]}")"
readonly HERE SELF
readonly REQS="${HERE}/sglang-router-requirements.txt"
readonly CACHE_ROOT="${GENQ_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/genq}"
readonly PY="${PYTHON:-python3}"

log() { printf '[sglang-router-venv] %s\n' "$*" >&2; }
die() { printf '[sglang-router-venv] error: %s\n' "$*" >&2; exit 1; }

[[ -f "$REQS" ]] || die "missing $REQS"
command -v "$PY" >/dev/null 2>&1 || die "no $PY (set PYTHON)"
pyver="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" || die "$PY does not run"

key="$(cat "$SELF" "$REQS" <(printf 'python%s\n' "$pyver") | sha256sum | cut -c1-12)"
readonly DEST="${CACHE_ROOT}/sglang-router-${ROUTER_VERSION}-${key}"
readonly VPY="${DEST}/bin/python"

if [[ -f "${DEST}/.complete" && -x "$VPY" ]]; then
  printf '%s\n' "$VPY"
  exit 0
fi

"$PY" -c 'import venv, ensurepip' 2>/dev/null \
  || die "$PY lacks the venv/ensurepip modules (on Debian: apt-get install -y python3-venv)"
mkdir -p "$CACHE_ROOT"

if command -v flock >/dev/null 2>&1; then
  exec 9>"${DEST}.lock"
  if ! flock -n 9; then
    log "another build of ${DEST} is running; waiting for it"
    flock 9
  fi
  if [[ -f "${DEST}/.complete" && -x "$VPY" ]]; then
    printf '%s\n' "$VPY"
    exit 0
  fi
fi

start=$SECONDS
if [[ -e "$DEST" ]]; then
  log "removing unfinished venv ${DEST}"
  rm -rf -- "$DEST"
fi
log "creating venv ${DEST} with $PY (Python $pyver)"
"$PY" -m venv "$DEST" >&2 || die "python -m venv failed"
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$VPY" -m pip install --no-deps --progress-bar off "sglang-router==${ROUTER_VERSION}" -r "$REQS" >&2 \
  || die "pip install failed (the venv stays unfinished and is rebuilt next time)"
"$VPY" -m pip check >&2 || die "pip check failed: a pin is missing from $REQS"
"$VPY" -c 'import sglang_router.launch_router' >&2 || die "the venv does not import sglang_router"
date -u +%Y-%m-%dT%H:%M:%SZ > "${DEST}/.complete"
log "done in $((SECONDS - start))s ($(du -sh "$DEST" 2>/dev/null | cut -f1))"
printf '%s\n' "$VPY"
