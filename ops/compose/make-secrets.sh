#!/bin/sh
# The passwords compose.yaml needs, made once: random, in a folder only you can enter (0700), and
# never in git (.gitignore) nor in an image (ops/Dockerfile.dockerignore). The files themselves are
# readable (0644) because compose bind-mounts them into containers where genq runs as uid 10001;
# the folder is what keeps other users of this host out.
#
#   ops/compose/make-secrets.sh [FOLDER]     FOLDER: default .secrets next to compose.yaml
#
# A file that exists is kept (a Redis volume made with it still wants it).
set -eu
dir=${1:-"$(dirname "$0")/../../.secrets"}
mkdir -p "$dir"
chmod 0700 "$dir"
for name in redis-password dashboard-password; do
    if [ ! -s "$dir/$name" ]; then
        (umask 022 && head -c 24 /dev/urandom | base64 | tr -d '/+=\n' >"$dir/$name")
        echo "wrote a random $name to $dir/$name"
    fi
done
