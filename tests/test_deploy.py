"""Deployment files (issue 6): systemd units, their env examples, install.sh, compose.yaml, Dockerfile.

The settings each file must carry are read from the live click commands, so a flag added to
`genq worker` later fails here until the worker's env example documents it.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path

import click
import pytest
import redis
import yaml
from redis.backoff import NoBackoff
from redis.retry import Retry

from genq import progress
from genq.commands.cli import main
from genq.commands.embedded import free_port
from genq.connection import REDIS_ENV
from genq.keys import Keys
from genq.settings import SERVER_ENV
from tests.helpers import (
    assert_adds_up,
    check_records,
    http_status,
    log_of,
    need,
    read_jsonl,
    status_json,
    wait_until,
    write_prompts,
)

REPO = Path(__file__).resolve().parents[1]
OPS = REPO / "ops"
SYSTEMD = OPS / "systemd"
UNIT_GENQ = "/opt/genq/venv/bin/genq"
VENV_GENQ = Path(sys.executable).parent / "genq"

# unit file -> (genq command, env example, EnvironmentFile in the unit)
UNITS = {
    "genq-worker@.service": ("worker", "worker.env.example", "/etc/genq/worker-%i.env"),
    "genq-collector.service": ("collect", "collector.env.example", "/etc/genq/collector.env"),
    "genq-dashboard.service": ("dashboard", "dashboard.env.example", "/etc/genq/dashboard.env"),
}
INSTANCE = "gpu0"


def need_command(name: str) -> click.Command:
    """A live `genq` command. One that is not registered skips the test, except in CI, where it
    fails: there its deployment files must be checked (as helpers.need does for tools)."""
    cmd = main.get_command(click.Context(main), name)
    if cmd is None:
        why = f"`genq {name}` is not registered: its deployment files are not checked"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return cmd


def option_envvars(cmd: click.Command) -> dict[str, click.Option]:
    """Every environment variable ``cmd`` reads through its options."""
    out: dict[str, click.Option] = {}
    for param in cmd.params:
        if isinstance(param, click.Option) and param.envvar:
            for env in [param.envvar] if isinstance(param.envvar, str) else param.envvar:
                out[env] = param
    return out


ENV_READ = re.compile(r"""(?:environ(?:\.get)?\(?\[?|getenv\()\s*["'](GENQ_[A-Z0-9_]+)["']""")
SECRET_READ = re.compile(r"""\bsecret\(\s*["']([A-Z0-9_]+)["']""")


def env_read_in_source(cmd: click.Command) -> set[str]:
    """GENQ_* variables the command's module reads straight from the environment (a secret X is
    read from GENQ_X_FILE or GENQ_X)."""
    module = inspect.getmodule(inspect.unwrap(cmd.callback))
    if module is None:
        return set()
    source = inspect.getsource(module)
    secrets = {f"GENQ_{name}{tail}" for name in SECRET_READ.findall(source) for tail in ("", "_FILE")}
    return set(ENV_READ.findall(source)) | secrets


def parse_env_file(path: Path, commented: bool = False) -> dict[str, str]:
    """``KEY=value`` lines as systemd's EnvironmentFile reads them (``commented``: also ``# KEY=v``)."""
    out: dict[str, str] = {}
    pattern = re.compile(r"^\s*(#\s*)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")
    for line in path.read_text().splitlines():
        m = pattern.match(line)
        if not m or (m.group(1) and not commented):
            continue
        value = m.group(3).strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        out[m.group(2)] = value
    return out


def parse_unit(path: Path) -> dict[str, list[str]]:
    """``Section.Key`` -> values, in order (systemd keys may repeat)."""
    out: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return out


def specifiers(value: str, instance: str, creds: Path) -> str:
    return value.replace("%i", instance).replace("%d", str(creds)).replace("%%", "%")


# -- systemd ------------------------------------------------------------------------------------------


@pytest.fixture
def unit_dir(tmp_path: Path) -> Path:
    """The units as installed, with every path they name made real under ``tmp_path``."""
    root = tmp_path / "root"
    units = tmp_path / "units"
    units.mkdir()
    for name in UNITS:
        text = (SYSTEMD / name).read_text()
        text = text.replace(UNIT_GENQ, str(VENV_GENQ))
        for path in ("/etc/genq", "/data/genq"):
            text = text.replace(path, f"{root}{path}")
        (units / name).write_text(text)
    (root / "etc/genq").mkdir(parents=True)
    (root / "data/genq").mkdir(parents=True)
    for _, example, env_file in UNITS.values():
        target = Path(f"{root}{specifiers(env_file, INSTANCE, Path('/'))}")
        shutil.copy(SYSTEMD / example, target)
    for secret in ("redis-password", "dashboard-password", "server-api-key"):
        (root / "etc/genq" / secret).write_text("")
    # The CPU/NUMA pinning example, as the drop-in it is meant to become.
    dropin = units / f"genq-worker@{INSTANCE}.service.d"
    dropin.mkdir()
    shutil.copy(SYSTEMD / "worker-numa.conf.example", dropin / "numa.conf")
    return units


def verify(units: Path) -> subprocess.CompletedProcess:
    instances = [units / n.replace("@.", f"@{INSTANCE}.") for n in UNITS]
    return subprocess.run(
        [need("systemd-analyze"), "verify", "--man=no", *map(str, instances)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def ours(output: str) -> list[str]:
    """Lines about our units (the host's own units may add unrelated noise)."""
    return [line for line in output.splitlines() if "genq" in line]


def test_units_pass_systemd_analyze_verify(unit_dir):
    result = verify(unit_dir)
    assert result.returncode == 0 and not ours(result.stdout + result.stderr), result.stdout + result.stderr
    # The check can fail: a misspelt key and a missing ExecStart binary are both reported.
    worker = unit_dir / "genq-worker@.service"
    worker.write_text(worker.read_text().replace("KillMode=", "KilMode=").replace(str(VENV_GENQ), "/nope"))
    broken = verify(unit_dir)
    report = "\n".join(ours(broken.stdout + broken.stderr))
    assert "KilMode" in report and "/nope" in report and broken.returncode != 0, report


def test_units_are_hardened(unit_dir):
    """`systemd-analyze security` rates each unit; "OK" or better (exposure at most 2.5 of 10)."""
    instances = [str(unit_dir / n.replace("@.", f"@{INSTANCE}.")) for n in UNITS]
    result = subprocess.run(
        [need("systemd-analyze"), "security", "--offline=true", "--threshold=25", "--no-pager", *instances],
        capture_output=True,
        text=True,
        timeout=60,
    )
    overall = [line for line in result.stdout.splitlines() if "Overall exposure" in line]
    assert result.returncode == 0 and len(overall) == len(UNITS), result.stdout + result.stderr


@pytest.mark.parametrize("unit", list(UNITS))
def test_unit_settings(unit):
    command, example, env_file = UNITS[unit]
    u = parse_unit(SYSTEMD / unit)
    env = parse_env_file(SYSTEMD / example)
    # genq from the venv, everything else from the environment file: no flags, no secrets in argv.
    assert u["Service.ExecStart"] == [f"{UNIT_GENQ} {command}"]
    assert u["Service.EnvironmentFile"] == [env_file]
    # Secrets come as credentials: each *_FILE=%d/NAME has its LoadCredential=NAME:/etc/genq/NAME.
    assert "redis-password:/etc/genq/redis-password" in u["Service.LoadCredential"]
    assert "GENQ_REDIS_PASSWORD_FILE=%d/redis-password" in u["Service.Environment"]
    for assignment in u["Service.Environment"]:
        if "=%d/" in assignment:
            name = assignment.split("=%d/")[1]
            assert f"{name}:/etc/genq/{name}" in u["Service.LoadCredential"], assignment
    text = (SYSTEMD / unit).read_text()
    assert not re.search(r"^[^#]*PASSWORD=(?!.*_FILE)", text, re.M), "a password in the unit"
    expected = {
        "User": "genq",
        "Group": "genq",
        "KillSignal": "SIGTERM",
        "KillMode": "mixed",
        "Restart": "always",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
    }
    for key, value in expected.items():
        assert u.get(f"Service.{key}") == [value], f"{unit}: {key}={u.get(f'Service.{key}')}"
    assert u.get("Service.RestartSec"), f"{unit}: RestartSec"
    assert u.get("Install.WantedBy") == ["multi-user.target"]
    if command == "worker":
        grace = float(env["GENQ_GRACE"])
        stop = float(u["Service.TimeoutStopSec"][0])
        assert stop >= grace + 15, f"TimeoutStopSec={stop} leaves the drain ({grace} s) no margin"
    if command == "collect":
        assert env["GENQ_OUT"] in u["Service.ReadWritePaths"][0].split()
        assert u["Unit.RequiresMountsFor"] == [env["GENQ_OUT"]]


@pytest.mark.parametrize("unit", list(UNITS))
def test_env_examples_carry_every_setting(unit, monkeypatch):
    command, example, _ = UNITS[unit]
    cmd = need_command(command)
    documented = parse_env_file(SYSTEMD / example, commented=True)
    options = option_envvars(cmd)
    read = env_read_in_source(cmd)
    known = set(options) | set(REDIS_ENV) | read | (set(SERVER_ENV) if command == "worker" else set())
    assert not (missing := sorted(known - set(documented))), f"{example} lacks {missing}"
    assert not (unknown := sorted(k for k in documented if k.startswith("GENQ_") and k not in known)), (
        f"{example} sets variables `genq {command}` does not read: {unknown}"
    )
    set_ = parse_env_file(SYSTEMD / example)
    unset = [env for env, opt in options.items() if opt.required and env not in set_]
    assert not unset, f"{example}: required {unset} must be set, not commented"
    # Every value in it, commented ones too, is one the command accepts.
    for key in [k for k in os.environ if k.startswith("GENQ_")]:
        monkeypatch.delenv(key)
    for key, value in documented.items():
        monkeypatch.setenv(key, value)
    cmd.make_context(command, [])


@pytest.mark.slow
def test_worker_unit_execstart_drains_on_sigterm(procs, start_sim, tmp_path, out, redis_url, namespace):
    """The worker as systemd starts it (ExecStart, Environment=, EnvironmentFile=, credential),
    stopped as KillMode=mixed stops it: SIGTERM to the main process only, then SIGKILL to the rest."""
    u = parse_unit(SYSTEMD / "genq-worker@.service")
    argv = shlex.split(u["Service.ExecStart"][0])
    assert argv[0] == UNIT_GENQ
    argv[0] = str(VENV_GENQ)
    creds = tmp_path / "credentials"
    creds.mkdir()
    for secret in ("redis-password", "server-api-key"):  # the test Redis and server want none
        (creds / secret).write_text("")
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin",
        "LANG": "C.UTF-8",
        "CREDENTIALS_DIRECTORY": str(creds),
    }
    for assignment in u["Service.Environment"]:
        key, _, value = specifiers(assignment, INSTANCE, creds).partition("=")
        env[key] = value
    env.update(parse_env_file(SYSTEMD / "worker.env.example"))  # EnvironmentFile= wins over Environment=
    url = start_sim(
        "--latency", "realistic", "--min-len", "1500", "--max-len", "1600", "--decode-step-ms", "5"
    )
    # This host's Redis, simulator and namespace; a short grace so the drain puts jobs back
    # (the example's own grace is checked against TimeoutStopSec above).
    env.update(GENQ_REDIS_URL=redis_url, GENQ_SERVER=url, GENQ_NAMESPACE=namespace, GENQ_GRACE="2")

    data = tmp_path / "deploy.jsonl"
    prompts = write_prompts(data, 12)
    res = procs.run("enqueue", data, "--dataset", "deploy", "--max-new-tokens", "2000")
    assert res.returncode == 0, res.stderr
    log = tmp_path / "unit.log"
    with log.open("wb") as fh:
        unit = subprocess.Popen(argv, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(
            lambda: status_json(procs)["datasets"]["deploy"]["in_flight"] == len(prompts), 30, "all in flight"
        )
        os.kill(unit.pid, signal.SIGTERM)
        assert unit.wait(2 + 15) == 0, log.read_text()
    finally:
        if unit.poll() is None:
            unit.kill()
    with pytest.raises(ProcessLookupError):  # KillMode=mixed would SIGKILL leftovers: there are none
        os.killpg(unit.pid, signal.SIGKILL)
    counts = status_json(procs)  # every in-flight job back at the front of its queue
    assert counts["datasets"]["deploy"]["queued"] == len(prompts), counts
    assert_adds_up(counts)

    collector = procs.start("collect", "--out", out, "--burst")
    worker = procs.start("worker", "--server", url, "--burst")
    assert worker.wait(120) == 0, log_of(worker)
    assert collector.wait(60) == 0, log_of(collector)
    check_records(out, "deploy", prompts, {"max_new_tokens": 2000}, min_len=1500, max_len=1600)
    assert not (out / "deploy" / "errors.jsonl").exists()


def shell_scripts() -> list[Path]:
    """Every shell script of the repository (by its #! line): ops/ and CI's own."""
    candidates = [*sorted(OPS.rglob("*")), REPO / ".ci" / "run"]
    return [p for p in candidates if p.is_file() and re.match(rb"#!\S*(/| )(ba)?sh\b", p.read_bytes()[:64])]


SHELL_SCRIPTS = shell_scripts()


def test_the_shell_scripts_are_found():
    assert {OPS / "install.sh", REPO / ".ci" / "run"} <= set(SHELL_SCRIPTS), SHELL_SCRIPTS


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_shell_scripts_pass_shellcheck(script):
    """shellcheck skips locally where it is not installed; CI (.ci/run) installs it."""
    res = subprocess.run([need("shellcheck"), script], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_install_script(tmp_path):
    script = OPS / "install.sh"
    assert os.access(script, os.X_OK)
    assert subprocess.run(["bash", "-n", script], timeout=60).returncode == 0
    usage = subprocess.run(["bash", script, "--help"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and "--units-only" in usage.stdout and "set -e" not in usage.stdout
    root = tmp_path / "stage"
    env = {**os.environ, "DESTDIR": str(root)}
    res = subprocess.run(
        ["bash", script, "--units-only"], env=env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert "systemctl enable --now genq-worker@gpu0" in res.stdout
    for unit in UNITS:
        assert (root / "etc/systemd/system" / unit).read_text() == (SYSTEMD / unit).read_text()
    conf = root / "etc/genq"
    for name in ("worker-gpu0.env", "collector.env", "dashboard.env", "redis-password", "dashboard-password"):
        assert stat.S_IMODE((conf / name).stat().st_mode) == 0o600, name
    dashboard_password = (conf / "dashboard-password").read_text()
    assert len(dashboard_password.strip()) >= 20, "install.sh writes a random dashboard password"
    assert (conf / "worker-gpu0.env").read_text() == (SYSTEMD / "worker.env.example").read_text()
    assert (root / "data/genq").is_dir()
    # Run again: the settings someone wrote are kept, the examples refreshed.
    (conf / "worker-gpu0.env").write_text("GENQ_SERVER=http://10.0.0.7:30000\n")
    (conf / "redis-password").write_text("s3cret\n")
    res = subprocess.run(
        ["bash", script, "--units-only"], env=env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    assert (conf / "worker-gpu0.env").read_text() == "GENQ_SERVER=http://10.0.0.7:30000\n"
    assert (conf / "redis-password").read_text() == "s3cret\n"
    assert (conf / "dashboard-password").read_text() == dashboard_password
    assert (conf / "worker.env.example").read_text() == (SYSTEMD / "worker.env.example").read_text()


# -- compose ------------------------------------------------------------------------------------------

COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
INTERPOLATION = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?([-?])([^}]*))?\}")


def interpolate(value, env: dict[str, str] | None = None):
    """Compose's variable substitution: ``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}``, ``$$``."""
    env = env or {}
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, kind, arg = m.groups()
        if env.get(name):
            return env[name]
        assert kind != "?", f"compose needs {name}: {arg}"
        return arg or ""

    return INTERPOLATION.sub(sub, value)


def service(name: str) -> dict:
    return interpolate(SERVICES[name])


def genq_services() -> list[str]:
    return [n for n, s in SERVICES.items() if "build" in s or str(s.get("image", "")).startswith("genq")]


def environment(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: str(v) for k, v in env.items()}


@pytest.mark.parametrize("name", genq_services())
def test_compose_service_runs_a_real_genq_command(name, monkeypatch):
    """Its command parses with the live CLI, flags and environment together (nothing runs)."""
    svc = service(name)
    build = svc["build"]
    assert (build["context"], build["dockerfile"]) == (".", "ops/Dockerfile"), build
    assert svc["image"] == "genq:local", "one image, built once, for every genq service"
    # Build args: each one an ARG of ops/Dockerfile, defaulting to what the Dockerfile defaults to.
    args = re.findall(r"^ARG (\w+)=(\S*)$", (OPS / "Dockerfile").read_text(), re.M)
    declared = {name: default.strip('"') for name, default in args}
    assert build.get("args") and set(build["args"]) <= set(declared), (build.get("args"), declared)
    for arg, value in build["args"].items():  # ${VAR:-default}: the default
        assert value == declared[arg], f"{arg}: compose.yaml {value!r}, ops/Dockerfile {declared[arg]!r}"
    assert svc.get("init") is True, "PID 1 must forward SIGTERM to genq (init: true)"
    argv = svc["command"]
    assert isinstance(argv, list) and argv[0] == "genq", argv
    cmd = need_command(argv[1])
    for key in [k for k in os.environ if k.startswith("GENQ_")]:
        monkeypatch.delenv(key)
    env = environment(svc)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cmd.make_context(argv[1], list(argv[2:]))
    known = set(option_envvars(cmd)) | set(REDIS_ENV) | env_read_in_source(cmd)
    assert not (unknown := sorted(k for k in env if k.startswith("GENQ_") and k not in known)), unknown
    if name != "sim-server":
        secret = f"/run/secrets/{svc['secrets'][0]}"
        assert env["GENQ_REDIS_PASSWORD_FILE"] == secret
        assert env["GENQ_REDIS_URL"].startswith("redis://redis:")
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"


def test_compose_layout():
    collector, dashboard, worker = service("collector"), service("dashboard"), service("worker")
    out = collector["command"][collector["command"].index("--out") + 1]
    assert any(v.split(":")[1] == out and v.split(":")[0] in COMPOSE["volumes"] for v in collector["volumes"])
    assert dashboard["command"][dashboard["command"].index("--bind") + 1] == "0.0.0.0"
    ports = dashboard["ports"]
    assert ports and all(p.startswith("127.0.0.1:") for p in ports), (
        f"the dashboard must be published, on 127.0.0.1 only: {ports}"
    )
    # Workers: scalable, pointed at a server by URL, stopped no sooner than their drain.
    assert int(worker["deploy"]["replicas"]) >= 1
    assert worker["environment"]["GENQ_SERVER"].startswith("http")
    grace_period = float(worker["stop_grace_period"].rstrip("s"))
    assert grace_period >= float(worker["environment"]["GENQ_GRACE"]) + 15
    # The demo: simulator and an enqueue, only with --profile demo; the rest always.
    demo = {n for n, s in SERVICES.items() if "demo" in s.get("profiles", [])}
    assert demo == {"sim-server", "enqueue"}
    assert all(not SERVICES[n].get("profiles") for n in SERVICES if n not in demo)
    sim = service("sim-server")["command"]
    host = worker["environment"]["GENQ_SERVER"].split("//")[1]
    assert host == f"sim-server:{sim[sim.index('--port') + 1]}"
    enqueue = service("enqueue")
    assert enqueue["restart"] == "no"
    data = Path(enqueue["command"][2])
    assert data.parts[:4] == ("/", "opt", "genq", "examples") and (REPO / "examples" / data.name).exists()
    assert "COPY examples/ /opt/genq/examples/" in (OPS / "Dockerfile").read_text()
    # No password in the repository: each secret's default is a file ops/compose/make-secrets.sh
    # makes, in a folder git and the image's build context both leave out.
    assert COMPOSE["secrets"]
    script = (OPS / "compose/make-secrets.sh").read_text()
    assert all(name in script for name in COMPOSE["secrets"])
    for secret in COMPOSE["secrets"].values():
        assert Path(interpolate(secret["file"])).parts[0] == ".secrets"
    assert ".secrets/" in (REPO / ".gitignore").read_text().split()
    assert ".secrets" in (OPS / "Dockerfile.dockerignore").read_text().split()
    assert not list((OPS / "compose").glob("*.demo")), "a committed demo password"


@contextlib.contextmanager
def compose_redis(tmp_path: Path, password: str) -> Iterator[tuple[subprocess.Popen, int]]:
    """The redis service's own command, run by this host's redis-server the way the image's
    docker-entrypoint.sh runs it (--protected-mode no inserted after redis-server)."""
    svc = service("redis")
    assert svc["command"][:2] == ["sh", "-c"]
    local = need("redis-server")
    secret = tmp_path / "redis-secret"
    secret.write_text(password + "\n")
    port = free_port()
    script = svc["command"][-1].replace("/run/secrets/redis-password", str(secret))
    script = script.replace(
        "docker-entrypoint.sh redis-server",
        f"{local} --protected-mode no --port {port} --bind 127.0.0.1 --dir {tmp_path} --save ''",
    )
    proc = subprocess.Popen(["sh", "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, password=password, socket_connect_timeout=1)

    def up() -> bool:
        try:
            return client.ping()
        except redis.ConnectionError:
            assert proc.poll() is None, "the compose redis command exited"
            return False

    try:
        wait_until(up, 20, "the compose redis command")
        yield proc, port
    finally:
        proc.terminate()
        proc.wait(20)


def test_compose_redis_settings(tmp_path):
    """AOF on, noeviction, the password from the secret file (not in argv), a passing healthcheck."""
    redis_svc = service("redis")
    assert redis_svc["image"].startswith("redis:7")
    assert any(v.endswith(":/data") and v.split(":")[0] in COMPOSE["volumes"] for v in redis_svc["volumes"])
    for flag in ("--appendonly yes", "--maxmemory-policy noeviction"):
        assert flag in redis_svc["command"][-1]
    with compose_redis(tmp_path, "pa55-word") as (proc, port):
        client = redis.Redis(port=port, password="pa55-word")
        assert client.config_get("appendonly")["appendonly"] == "yes"
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, retry=Retry(NoBackoff(), 0)).ping()
        assert b"pa55-word" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        test = redis_svc["healthcheck"]["test"]
        assert test[0] == "CMD-SHELL"
        secret = tmp_path / "redis-secret"
        check = test[1].replace("/run/secrets/redis-password", str(secret))
        check = check.replace("redis-cli", f"redis-cli -p {port}")
        assert subprocess.run(["sh", "-c", check]).returncode == 0


@pytest.mark.slow
@pytest.mark.timeout(420)  # its bounded waits (redis, enqueue, the run, six stops) add up to 340 s
def test_compose_demo_runs_without_docker(tmp_path, out):
    """`docker compose --profile demo up`, minus the containers: every service's own command and
    environment, with the compose hostnames, secrets, volume and image paths mapped onto this host.
    Only the simulator is made faster (--latency zero appended). All 200 example prompts land."""
    made = tmp_path / "made"
    subprocess.run([REPO / "ops/compose/make-secrets.sh", made], check=True, capture_output=True, timeout=30)
    secrets = {n: (made / n).read_text() for n in COMPOSE["secrets"]}
    for name, text in secrets.items():
        (tmp_path / name).write_text(text)
    collector_out = service("collector")["command"][-1]
    sim_port, dash_port = free_port(), free_port()
    procs: list[tuple[str, subprocess.Popen]] = []

    def start(name: str, redis_port: int, wait: bool = False) -> subprocess.Popen:
        svc = service(name)
        mapping = {
            "redis:6379": f"127.0.0.1:{redis_port}",
            "sim-server:30000": f"127.0.0.1:{sim_port}",
            "/run/secrets/": f"{tmp_path}/",
            collector_out: str(out),
            "/opt/genq/examples/": f"{REPO}/examples/",
            "0.0.0.0": "127.0.0.1",
        }

        def local(value: str) -> str:
            for old, new in mapping.items():
                value = value.replace(old, new)
            return value

        argv = [local(a) for a in svc["command"][1:]]
        if name == "sim-server":
            argv = [*argv[: argv.index("--port") + 1], str(sim_port), "--latency", "zero"]
        if name == "dashboard":
            argv[argv.index("--port") + 1] = str(dash_port)
        env = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}
        env.update({k: local(v) for k, v in environment(svc).items()})
        log = (tmp_path / f"{name}-{len(procs)}.log").open("wb")
        proc = subprocess.Popen([sys.executable, "-m", "genq", *argv], env=env, stdout=log, stderr=log)
        procs.append((name, proc))
        if wait:
            assert proc.wait(60) == 0, (tmp_path / f"{name}-{len(procs) - 1}.log").read_text()
        return proc

    password = secrets["redis-password"].strip()
    with compose_redis(tmp_path, password) as (_, redis_port):
        try:
            for name in ("collector", "dashboard", "sim-server"):
                start(name, redis_port)
            for _ in range(int(service("worker")["deploy"]["replicas"])):
                start("worker", redis_port)
            start("enqueue", redis_port, wait=True)
            conn = redis.Redis(port=redis_port, password=password)
            namespace = service("worker")["environment"]["GENQ_NAMESPACE"]
            lines = sum(1 for _ in (REPO / "examples/prompts.jsonl").open())
            counts = lambda: progress.dataset_counts(conn, Keys(namespace)).get("prompts", {})  # noqa: E731
            wait_until(lambda: counts().get("done") == lines, 60, "every example prompt on disk", 0.5)
            # The dashboard answers with its password only.
            dash_password = secrets["dashboard-password"].strip()
            base = f"http://127.0.0.1:{dash_port}/"
            assert http_status(base) == 401
            assert http_status(base, auth=("genq", dash_password)) == 200
        finally:
            for _name, proc in reversed(procs):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            codes = {f"{name}-{i}": proc.wait(30) for i, (name, proc) in enumerate(procs)}
    records = read_jsonl(out / "prompts" / "raw_responses.jsonl")
    assert len(records) == len({r["id"] for r in records}) == lines
    assert all(code == 0 for name, code in codes.items() if not name.startswith("dashboard")), codes


def test_dockerfile_installs_the_package():
    text = (OPS / "Dockerfile").read_text()
    lines = re.sub(r"\\\n\s*", " ", text).splitlines()
    instructions = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    froms = [i for i in instructions if i.startswith("FROM ")]
    # Both stages on the same base: python:3.11-slim unless the PYTHON_IMAGE build arg says otherwise.
    assert froms and all(f.split()[1] == "${PYTHON_IMAGE}" for f in froms), froms
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in instructions[: instructions.index(froms[0])]
    build = instructions.index(next(i for i in instructions if i.startswith("COPY . ")))
    wheel = [i for i in instructions[build:] if i.startswith("RUN pip wheel")]
    assert wheel and re.fullmatch(r"\.(\[[a-z0-9_,-]+\])?", wheel[0].split()[-1].strip("\"'")), wheel
    final = instructions[instructions.index(froms[-1]) :]
    assert any(i.startswith("RUN") and "pip install" in i and "genq" in i for i in final)
    users = [i.split()[1] for i in final if i.startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), "the image must run as a non-root user"
    # Extras it installs exist, and the build context keeps every package, pyproject and README.
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    for extra in re.findall(r"genq\[([a-z0-9_,-]+)\]|\"\.\[([a-z0-9_,-]+)\]\"", text):
        for name in ",".join(extra).split(","):
            if name:
                assert name in pyproject["project"]["optional-dependencies"], f"no extra {name!r}"
    ignore = [p.strip() for p in (OPS / "Dockerfile.dockerignore").read_text().splitlines()]
    ignore = [p for p in ignore if p and not p.startswith("#")]
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = [p.name for p in REPO.iterdir() if (p / "__init__.py").exists()]
    needed = [p for p in packages if any(fnmatch(p, pat) for pat in include)]
    needed += ["pyproject.toml", "README.md", "examples"]
    assert not (dropped := [n for n in needed if any(fnmatch(n, pat) for pat in ignore)]), dropped
    assert ".git" in ignore and ".env" in ignore
