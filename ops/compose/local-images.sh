#!/usr/bin/env bash
# Base images for compose.yaml on a host that can pull none (no registry reachable), with podman:
# Debian bookworm made by debootstrap from the apt mirror this host already uses, then stand-ins
# for python:3.11-slim and redis:7 built on it (python.Containerfile, redis.Containerfile).
# Prints the compose variables that select them:
#
#   eval "$(ops/compose/local-images.sh)" && podman-compose --profile demo up --build
#
# The root filesystem is kept in ~/.cache/genq/containers (GENQ_CACHE), one tarball per suite and
# mirror; the images stay in podman's store and its layer cache, so a second run takes seconds.
# Needs root (debootstrap), podman and debootstrap.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
suite=bookworm
# shellcheck disable=SC2016  # '$(REPO_URI)' is apt-get's format field, not a shell expansion
mirror="${DEBIAN_MIRROR:-$(apt-get indextargets --format '$(REPO_URI)' 'Created-By: Packages' \
    "Release: $suite" 'Origin: Debian' 2>/dev/null | head -n 1)}"
mirror="${mirror:-http://deb.debian.org/debian/}"
cache="${GENQ_CACHE:-$HOME/.cache/genq}/containers"
key="$(printf '%s minbase %s\n' "$suite" "$mirror" | sha256sum | cut -c1-12)"
debian="localhost/genq-debian:$suite-$key"
tarball="$cache/debian-$suite-$key.tar"

if ! podman image exists "$debian"; then
    if [ ! -f "$tarball" ]; then
        mkdir -p "$cache"
        rootfs="$(mktemp -d "$cache/rootfs.XXXXXX")"
        trap 'rm -rf "$rootfs"' EXIT
        echo "debootstrap $suite from $mirror" >&2
        debootstrap --variant=minbase "$suite" "$rootfs" "$mirror" >"$cache/debootstrap.log" 2>&1 \
            || { tail -n 20 "$cache/debootstrap.log" >&2; exit 1; }
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
        tar -C "$rootfs" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    fi
    podman import --quiet "$tarball" "$debian" >/dev/null
fi

for name in python redis; do
    podman build --build-arg "DEBIAN=$debian" -t "localhost/genq-$name:$suite" \
        -f "$here/$name.Containerfile" "$here" >"$cache/build-$name.log" 2>&1 \
        || { tail -n 20 "$cache/build-$name.log" >&2; exit 1; }
done
echo "export PYTHON_IMAGE=localhost/genq-python:$suite"
echo "export REDIS_IMAGE=localhost/genq-redis:$suite"
