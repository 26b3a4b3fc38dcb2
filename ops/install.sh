#!/usr/bin/env bash
# Install genq on a host as systemd services: a dedicated user, a venv in /opt/genq, the units in
# /etc/systemd/system and the example env files in /etc/genq (existing env files are kept).
#
#   sudo ops/install.sh [PACKAGE]       PACKAGE: a source folder, a wheel, or a pip requirement
#                                       (default: the checkout this script is in)
#   sudo ops/install.sh --units-only    refresh units and examples only, keep the installed genq
#
# Each install goes into a fresh venv, /opt/genq/releases/<stamp>, and /opt/genq/venv is switched
# to it atomically only once pip has succeeded, so running services keep their code until they are
# restarted (an upgrade mid-run: install, then restart hosts one at a time; see the README).
#
# Environment: PYTHON (interpreter for the venv, default python3, >= 3.11), PIP_ARGS (extra pip
# arguments, e.g. "--no-index --find-links /srv/wheels"), DESTDIR (stage everything under this
# folder instead of /; no user is created and systemctl is not called).
set -euo pipefail
umask 022 # the venv must be readable by the genq user; secrets get their own modes below

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
units_only=0
package=""
for arg in "$@"; do
  case "$arg" in
    --units-only) units_only=1 ;;
    -h | --help)
      sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    -*)
      echo "install.sh: unknown option $arg" >&2
      exit 2
      ;;
    *) package="$arg" ;;
  esac
done
package="${package:-$(dirname "$here")}"

root="${DESTDIR:-}"
python="${PYTHON:-python3}"
prefix="$root/opt/genq"
unit_dir="$root/etc/systemd/system"
conf_dir="$root/etc/genq"
out_dir="$root/data/genq"

if [[ -z "$root" && "$(id -u)" -ne 0 ]]; then
  echo "install.sh: run as root (or set DESTDIR to stage the files somewhere else)" >&2
  exit 1
fi

# 1. A system user with no login and no home to write to; it owns only the output folder.
if [[ -z "$root" ]] && ! id genq >/dev/null 2>&1; then
  useradd --system --user-group --home-dir /opt/genq --no-create-home --shell /usr/sbin/nologin genq
  echo "created system user genq"
fi

# 2. genq in a fresh venv, switched in atomically.
if [[ "$units_only" -eq 0 ]]; then
  "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
    echo "install.sh: $python is older than 3.11; set PYTHON=/path/to/python3.11" >&2
    exit 1
  }
  if [[ -d "$prefix/venv" && ! -L "$prefix/venv" ]]; then
    echo "install.sh: $prefix/venv is a folder, not a link to a release: move it away first" >&2
    exit 1
  fi
  release="$prefix/releases/$(date -u +%Y%m%dT%H%M%SZ)"
  mkdir -p "$prefix/releases"
  trap 'rm -rf "$release"; echo "install.sh: failed; $prefix/venv is unchanged" >&2' ERR
  "$python" -m venv "$release"
  # shellcheck disable=SC2086  # PIP_ARGS is a list of words on purpose
  "$release/bin/pip" install --quiet --disable-pip-version-check ${PIP_ARGS:-} "$package"
  "$release/bin/genq" --version
  ln -sfn "$release" "$prefix/venv.new"
  mv -Tf "$prefix/venv.new" "$prefix/venv"
  trap - ERR
  echo "installed $("$prefix/venv/bin/genq" --version) into $release (now $prefix/venv)"
elif [[ ! -x "$prefix/venv/bin/genq" ]]; then
  echo "install.sh: warning: $prefix/venv/bin/genq is missing; the units need it" >&2
fi

# 3. Units, and env files from the examples unless they exist already (they hold your settings).
install -d -m 0755 "$unit_dir"
for unit in genq-worker@.service genq-collector.service genq-dashboard.service; do
  install -m 0644 "$here/systemd/$unit" "$unit_dir/$unit"
done
install -d -m 0755 "$conf_dir"
install -m 0644 "$here/systemd/worker-numa.conf.example" "$conf_dir/worker-numa.conf.example"
for name in worker collector dashboard; do
  install -m 0600 "$here/systemd/$name.env.example" "$conf_dir/$name.env.example"
  target="$conf_dir/$name.env"
  [[ "$name" == worker ]] && target="$conf_dir/worker-gpu0.env"
  if [[ ! -e "$target" ]]; then
    install -m 0600 "$here/systemd/$name.env.example" "$target"
    echo "wrote $target from the example: edit it"
  fi
done
# The Redis password, root-only; the units hand it to genq as a credential. Empty: no password.
if [[ ! -e "$conf_dir/redis-password" ]]; then
  install -m 0600 /dev/null "$conf_dir/redis-password"
  echo "wrote an empty $conf_dir/redis-password: put the Redis password in it"
fi
# The inference servers' API key (their --api-key), the same way. Empty: the servers need none.
if [[ ! -e "$conf_dir/server-api-key" ]]; then
  install -m 0600 /dev/null "$conf_dir/server-api-key"
fi
# The dashboard's basic-auth password: a random one, root-only, handed over as a credential too.
if [[ ! -e "$conf_dir/dashboard-password" ]]; then
  (umask 077 && head -c 18 /dev/urandom | base64 >"$conf_dir/dashboard-password")
  echo "wrote a random dashboard password to $conf_dir/dashboard-password (user genq)"
fi
# The collector's output folder, writable by genq only.
install -d -m 0750 "$out_dir"
if [[ -z "$root" ]]; then
  chown genq:genq "$out_dir"
  systemctl daemon-reload
fi

cat <<EOF

Next steps:
  GPU host (one worker per inference server):
    cp $conf_dir/worker-gpu0.env $conf_dir/worker-gpu1.env     # one env file per server
    \$EDITOR $conf_dir/worker-gpu0.env                          # GENQ_SERVER, GENQ_REDIS_URL, ...
    \$EDITOR $conf_dir/redis-password
    systemctl enable --now genq-worker@gpu0
  Storage host:
    \$EDITOR $conf_dir/collector.env $conf_dir/dashboard.env
    systemctl enable --now genq-collector genq-dashboard
  Then: journalctl -fu genq-worker@gpu0 ; $prefix/venv/bin/genq status
EOF
