"""Settings (issue 6): every flag has its GENQ_* variable; the Redis password from a file; TLS.

The flags are read from the live click tree, so commands added later are checked too.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import click
import orjson
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from genq import connection, settings
from genq.commands.cli import main
from genq.commands.embedded import free_port
from genq.connection import REDIS_ENV, connect
from genq.settings import SERVER_ENV, env_name
from tests.helpers import genq_argv, need, wait_until, write_prompts


def walk(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[str, click.Command]]:
    """Every command under ``group``, nested groups included, as ('genq worker', command)."""
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        assert cmd is not None
        yield " ".join(("genq", *path, name)), cmd
        if isinstance(cmd, click.Group):
            yield from walk(cmd, (*path, name))


def options(cmd: click.Command) -> list[click.Option]:
    """The options a user sets (not --help/--version, which only print)."""
    return [p for p in cmd.params if isinstance(p, click.Option) and p.expose_value]


COMMANDS = dict(walk(main))


def test_the_walk_sees_the_commands():
    assert {"genq worker", "genq collect", "genq enqueue", "genq status", "genq run"} <= set(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_flag_has_its_genq_variable(name):
    cmd = COMMANDS[name]
    seen: dict[str, str] = {}
    for opt in options(cmd):
        flag = max(opt.opts, key=len)
        assert isinstance(opt.envvar, str) and opt.envvar.startswith("GENQ_"), f"{name} {flag}: {opt.envvar}"
        assert opt.show_envvar, f"{name} {flag}: --help does not show {opt.envvar}"
        # GENQ_<FLAG>, or qualified as GENQ_<WHAT>_<FLAG> (the simulator's GENQ_SIM_*, --redis's
        # GENQ_REDIS_URL): a user can guess it from the flag.
        bare = env_name(flag).removeprefix("GENQ_")
        guessable = opt.envvar == env_name(flag) or opt.envvar.endswith("_" + bare)
        assert guessable or flag == "--redis", f"{name} {flag}: {opt.envvar}, expected {env_name(flag)}"
        assert opt.envvar not in seen, f"{name}: {flag} and {seen[opt.envvar]} share {opt.envvar}"
        seen[opt.envvar] = flag


def test_variables_reach_the_command(monkeypatch):
    """A variable sets its flag; a flag on the command line wins."""
    worker = main.get_command(click.Context(main), "worker")
    assert worker is not None
    monkeypatch.setenv("GENQ_SERVER", "http://gpu7:30000")
    monkeypatch.setenv("GENQ_CONCURRENCY", "64")
    monkeypatch.setenv("GENQ_BURST", "true")
    params = worker.make_context("worker", []).params
    assert (params["server"], params["concurrency"], params["burst"]) == ("http://gpu7:30000", 64, True)
    assert worker.make_context("worker", ["--concurrency", "8"]).params["concurrency"] == 8


# -- Redis servers of their own ----------------------------------------------------------------------


class RedisServer:
    """A throwaway redis-server with extra arguments (a password, TLS)."""

    def __init__(self, folder: Path, port: int, *args: str):
        self.port = port
        binary = need("redis-server")
        self.proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--dir", str(folder), "--save", "", "--port", str(port), *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def wait(self, client: redis.Redis) -> None:
        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                assert self.proc.poll() is None, "redis-server exited"
                return False

        wait_until(answers, 20, "redis-server")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


def genq(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}
    return subprocess.run(genq_argv(*args), env={**clean, **env}, capture_output=True, text=True, timeout=60)


def no_retry(url: str, **kwargs) -> redis.Redis:
    """``connect`` as the commands call it, but failing at once (redis-py retries for seconds)."""
    return connect(url, retry=Retry(NoBackoff(), 0), **kwargs)


def clean_env(monkeypatch, **env: str) -> None:
    for key in [k for k in os.environ if k.startswith("GENQ_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_redis_password_from_a_file(tmp_path, monkeypatch):
    password = "pw-" + os.urandom(8).hex()
    server = RedisServer(tmp_path, free_port(), "--requirepass", password)
    try:
        server.wait(redis.Redis(port=server.port, password=password, socket_connect_timeout=1))
        url = f"redis://127.0.0.1:{server.port}/0"
        secret = tmp_path / "redis-password"
        secret.write_text(password + "\n")  # a trailing newline, as editors leave it
        ok = genq("status", "--json", "--redis", url, env={"GENQ_REDIS_PASSWORD_FILE": str(secret)})
        assert ok.returncode == 0, ok.stderr
        assert orjson.loads(ok.stdout)["datasets"] == {}
        # The file wins over GENQ_REDIS_PASSWORD; no password at all is refused.
        clean_env(monkeypatch, GENQ_REDIS_PASSWORD_FILE=str(secret), GENQ_REDIS_PASSWORD="wrong")
        assert no_retry(url).ping()
        clean_env(monkeypatch, GENQ_REDIS_PASSWORD=password)
        assert no_retry(url).ping()
        clean_env(monkeypatch)
        with pytest.raises(redis.AuthenticationError):
            no_retry(url).ping()
        # A long-running worker: authenticated, and the password is neither in its argv nor its log.
        log = tmp_path / "worker.log"
        clean = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}
        env = {**clean, "GENQ_REDIS_URL": url, "GENQ_REDIS_PASSWORD_FILE": str(secret)}
        with log.open("wb") as fh:
            worker = subprocess.Popen(
                genq_argv("worker", "--server", "http://127.0.0.1:9"), env=env, stdout=fh, stderr=fh
            )
        try:
            admin = redis.Redis(port=server.port, password=password)
            wait_until(lambda: len(admin.client_list()) > 1, 30, "the worker's connection")
            assert password.encode() not in Path(f"/proc/{worker.pid}/cmdline").read_bytes()
            assert password.encode() not in Path(f"/proc/{worker.pid}/environ").read_bytes()
        finally:
            worker.terminate()
            worker.wait(30)
        assert password not in log.read_text()
    finally:
        server.stop()


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def pki(tmp_path) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    need("openssl")
    d = tmp_path / "pki"
    d.mkdir()
    key = ["-newkey", "rsa:2048", "-nodes", "-days", "1"]
    openssl(
        "req", "-x509", *key, "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.crt", "-subj", "/CN=genq test CA"
    )
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        openssl("req", *key, "-keyout", f"{d}/{name}.key", "-out", f"{d}/{name}.csr", "-subj", f"/CN={name}")
        openssl(
            "x509", "-req", "-in", f"{d}/{name}.csr", "-CA", f"{d}/ca.crt", "-CAkey", f"{d}/ca.key",
            "-CAcreateserial", "-days", "1", "-out", f"{d}/{name}.crt", "-extfile", f"{d}/san.cnf",
        )  # fmt: skip
    return d


def test_rediss_tls(tmp_path, pki, monkeypatch):
    """rediss:// with the CA from GENQ_REDIS_CA_FILE and a client certificate (mutual TLS)."""
    port = free_port()
    server = RedisServer(
        tmp_path, 0, "--tls-port", str(port),
        "--tls-cert-file", str(pki / "server.crt"), "--tls-key-file", str(pki / "server.key"),
        "--tls-ca-cert-file", str(pki / "ca.crt"), "--tls-auth-clients", "yes",
    )  # fmt: skip
    url = f"rediss://127.0.0.1:{port}/0"
    tls = {
        "GENQ_REDIS_CA_FILE": str(pki / "ca.crt"),
        "GENQ_REDIS_CERT_FILE": str(pki / "client.crt"),
        "GENQ_REDIS_KEY_FILE": str(pki / "client.key"),
    }
    try:
        server.wait(
            redis.Redis(
                port=port,
                ssl=True,
                ssl_ca_certs=tls["GENQ_REDIS_CA_FILE"],
                ssl_certfile=tls["GENQ_REDIS_CERT_FILE"],
                ssl_keyfile=tls["GENQ_REDIS_KEY_FILE"],
                socket_connect_timeout=1,
            )
        )
        data = tmp_path / "tls.jsonl"
        write_prompts(data, 5)
        env = {**tls, "GENQ_REDIS_URL": url, "GENQ_NAMESPACE": "tls"}
        res = genq("enqueue", str(data), "--max-new-tokens", "16", env=env)
        assert res.returncode == 0, res.stderr
        res = genq("status", "--json", env=env)
        assert res.returncode == 0, res.stderr
        assert orjson.loads(res.stdout)["datasets"]["tls"]["queued"] == 5
        # The certificate is checked: without the CA it is refused, unless verification is off.
        no_ca = {k: v for k, v in tls.items() if k != "GENQ_REDIS_CA_FILE"}
        clean_env(monkeypatch, **no_ca)
        with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
            no_retry(url).ping()
        assert no_retry(url + "?ssl_cert_reqs=none").ping()
        # This server asks for a client certificate: without one, no connection.
        clean_env(monkeypatch, GENQ_REDIS_CA_FILE=tls["GENQ_REDIS_CA_FILE"])
        with pytest.raises(redis.ConnectionError):
            no_retry(url).ping()
    finally:
        server.stop()


def test_tls_settings_leave_plain_urls_alone(monkeypatch):
    """GENQ_REDIS_CA_FILE set for a TLS Redis must not break a redis:// or unix:// URL."""
    monkeypatch.setenv("GENQ_REDIS_CA_FILE", "/nonexistent/ca.crt")
    for url in ("redis://127.0.0.1:1/0", "unix:///tmp/nonexistent.sock"):
        kwargs = connect(url).connection_pool.connection_kwargs
        assert "ssl_ca_certs" not in kwargs


def test_connection_variables_are_all_listed():
    """REDIS_ENV and SERVER_ENV (what the env examples must carry) name every variable settings.py
    and connection.py read (a secret X is read from GENQ_X_FILE or GENQ_X)."""
    source = inspect.getsource(settings) + inspect.getsource(connection)
    read = set(re.findall(r"""environ(?:\.get)?\(?\[?\s*["'](GENQ_[A-Z0-9_]+)["']""", source))
    tls = set(re.findall(r'"(GENQ_REDIS_[A-Z_]+_FILE)"', source))
    secrets = {f"GENQ_{n}{t}" for n in re.findall(r'secret\("([A-Z_]+)"\)', source) for t in ("", "_FILE")}
    listed = set(REDIS_ENV) | set(SERVER_ENV)
    assert secrets and read | tls | secrets <= listed, (read | tls | secrets) - listed
