#!/bin/sh
# What redis:7's docker-entrypoint.sh does with `redis-server ...`, the only use compose.yaml makes
# of it: protected mode off (only the compose network reaches this Redis), the data folder owned
# by the redis user, and Redis run as that user.
set -eu
if [ "${1:-}" = redis-server ]; then
    shift
    set -- redis-server --protected-mode no "$@"
    if [ "$(id -u)" = 0 ]; then
        find . \! -user redis -exec chown redis '{}' +
        exec setpriv --reuid=redis --regid=redis --init-groups "$@"
    fi
fi
exec "$@"
