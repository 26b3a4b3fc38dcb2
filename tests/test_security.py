"""docs/security.md, tested: Redis content is untrusted input, secrets stay where they belong, TLS
checks the server's name, and `genq run`'s private Redis is private."""

from __future__ import annotations

import base64
import os
import re
import shutil
import stat
import subprocess
import threading
import time
import uuid
from pathlib import Path

import orjson
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from genq.backends import Http
from genq.commands.embedded import EmbeddedRedis, free_port
from genq.connection import connect, redact, split_password
from genq.keys import Keys
from genq.templates import ChatTemplate, TemplateError
from tests.helpers import check_records, genq_argv, http, log_of, wait_until, write_prompts
from tests.test_settings import RedisServer, clean_env, openssl, pki  # noqa: F401 (pki: a fixture)
from tests.test_settings import genq as settings_genq

PARAMS = {"max_new_tokens": 32}


def test_a_dataset_name_from_redis_cannot_leave_out(procs, start_sim, conn, namespace, out, tmp_path):
    """Names written into Redis by hand (``../escape``, an absolute path) with entries in their
    streams: the collector refuses each with one line, leaves its entries, and writes nothing
    outside OUT, while the sound dataset lands."""
    sim = start_sim()
    prompts = write_prompts(tmp_path / "good.jsonl", 20)
    assert procs.run("enqueue", tmp_path / "good.jsonl", "--max-new-tokens", "32").returncode == 0
    keys = Keys(namespace)
    settings = orjson.loads(conn.hget(keys.datasets, "good"))
    escaped = tmp_path / "abs"
    bad = ["../escape", str(escaped)]
    procs.start("worker", "--server", sim, "--burst").wait(120)
    entries = conn.xrange(keys.results("good"))
    assert entries, "the worker left the sound dataset's results in its stream"
    for name in bad:
        conn.hset(keys.datasets, name, orjson.dumps({**settings, "name": name}))
        for _, fields in entries:
            conn.xadd(keys.results(name), fields)

    collector = procs.start("collect", "--out", out, "--burst")
    assert collector.wait(120) == 0, log_of(collector)
    check_records(out, "good", prompts, PARAMS)
    assert not (tmp_path / "escape").exists() and not escaped.exists()
    assert sorted(p.name for p in out.iterdir()) == ["good"]
    for name in bad:
        refused = [line for line in log_of(collector).splitlines() if "refusing dataset" in line]
        assert sum(repr(name.encode()) in line for line in refused) == 1, log_of(collector)
        assert conn.xlen(keys.results(name)) == len(entries), "its entries are left for an operator"


def test_a_job_cannot_choose_its_tokenizer_or_smuggle_a_chat_template(tokenizer_dir, tmp_path):
    """A job's template spec is Redis content: the worker loads only the tokenizer, kwargs and
    fingerprint the dataset's settings recorded, and the fingerprint covers the kwargs."""
    enqueued = ChatTemplate(str(tokenizer_dir))
    recorded = {"tokenizer": enqueued.name, "chat_template": enqueued.fingerprint}
    assert ChatTemplate.from_spec(enqueued.spec(), recorded).fingerprint == enqueued.fingerprint

    smuggled = ChatTemplate(str(tokenizer_dir), {"chat_template": "{{ 'pwned' }}"})
    assert smuggled.fingerprint != enqueued.fingerprint
    # Other kwargs are recorded beside it: datasets enqueued before keep their fingerprint.
    assert ChatTemplate(str(tokenizer_dir), {"enable_thinking": True}).fingerprint == enqueued.fingerprint
    forged = {**enqueued.spec(), "kwargs": smuggled.kwargs}
    other = shutil.copytree(tokenizer_dir, tmp_path / "other")
    for spec in (forged, smuggled.spec(), {**enqueued.spec(), "tokenizer": str(other)}):
        with pytest.raises(TemplateError, match="not the one its dataset recorded"):
            ChatTemplate.from_spec(spec, recorded)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc."""
    parents: dict[int, list[int]] = {}
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = path.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(path.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _cmdlines(pid: int) -> dict[int, bytes]:
    seen = {}
    for child in _descendants(pid):
        try:
            seen[child] = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
    return seen


def _run(data: Path, out: Path, env: dict[str, str], *flags: str) -> subprocess.Popen:
    """`genq run`, its output in OUT's sibling files (searched for secrets like the rest)."""
    stdout = (out.parent / "run.stdout").open("ab")
    stderr = (out.parent / "run.stderr").open("ab")
    argv = genq_argv("run", data, "--out", out, "--workers", "2", "--max-new-tokens", "64", *flags)
    return subprocess.Popen(argv, env=env, stdout=stdout, stderr=stderr)


def _follow(run: subprocess.Popen) -> dict[int, bytes]:
    """The command lines of every process the run starts, gathered on a thread until it exits
    (the dict fills as they come)."""
    seen: dict[int, bytes] = {}

    def gather() -> None:
        while run.poll() is None:
            seen.update(_cmdlines(run.pid))
            time.sleep(0.02)

    threading.Thread(target=gather, daemon=True).start()
    return seen


def _with_worker(status: str) -> str | None:
    """``status --json`` once it lists a worker (with the server it uses)."""
    return status if status and orjson.loads(status)["workers"] else None


def test_planted_secrets_appear_nowhere(procs, start_sim, tmp_path):
    """A Redis password in --redis, a server API key and a password in the --server URL: not in
    any file genq writes under OUT, any log line, `status --json`, nor the command line of any
    process `genq run` starts."""
    redis_server = EmbeddedRedis(tmp_path / "redis", private=True)
    redis_server.start()
    try:
        redis_pw, api_key, url_pw = redis_server.password(), f"key{uuid.uuid4().hex}", f"pw{uuid.uuid4().hex}"
        assert redis_pw
        host = start_sim("--api-key", api_key, "--latency", "realistic").split("://", 1)[1]
        data = tmp_path / "plant.jsonl"
        prompts = write_prompts(data, 120)
        out = tmp_path / "out"
        env = {k: v for k, v in procs.env.items() if not k.startswith("GENQ_")}
        env["GENQ_SERVER_API_KEY"] = api_key
        redis_url = f"redis://:{redis_pw}@127.0.0.1:{redis_server.port}/0"
        port = free_port()
        dashboard_url = f"redis://127.0.0.1:{redis_server.port}/0?password={redis_pw}"  # redis-py reads it
        dashboard_env = {"GENQ_REDIS_URL": dashboard_url, "GENQ_NAMESPACE": "genq"}
        procs.start("dashboard", "--port", str(port), env=dashboard_env)
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: http(f"{base}/0/data/queues.json")[0] == 200, 30, "the dashboard")
        run = _run(data, out, env, "--redis", redis_url, "--server", f"http://genq:{url_pw}@{host}")
        seen = _follow(run)
        status_env = {"GENQ_REDIS_URL": redis_server.url, "GENQ_REDIS_PASSWORD": redis_pw}
        status_env["GENQ_NAMESPACE"] = "genq"
        status = wait_until(
            lambda: _with_worker(procs.run("status", "--json", env=status_env).stdout),
            60,
            "a worker in status",
        )
        pages = {path: http(base + path) for path in ("/", "/0/view/workers", "/0/data/workers.json")}
        assert all(code == 200 for code, _ in pages.values()), pages
        assert run.wait(240) == 0, (tmp_path / "run.stderr").read_text()[-3000:]
        check_records(out, "plant", prompts, {"max_new_tokens": 64})
        assert len(seen) >= 4, f"redis, collector, enqueue and workers: {seen}"

        places = {f"cmdline of {pid}": line for pid, line in seen.items()}
        places["status --json"] = status.encode()
        places.update({f"dashboard {path}": body for path, (_, body) in pages.items()})
        assert b"genq.plant" in places["dashboard /0/data/workers.json"], "a worker is on the page"
        for path in tmp_path.rglob("*"):
            if path.is_file() and not path.is_relative_to(tmp_path / "redis"):
                places[str(path)] = path.read_bytes()
        assert any("worker-0.log" in where for where in places), "the workers' logs are searched"
        for secret in (redis_pw, api_key, url_pw):
            leaks = [where for where, text in places.items() if secret.encode() in text]
            assert not leaks, f"{secret} found in {leaks}"
        assert f"http://{host}".encode() in places["status --json"], "the bare server URL is shown"
    finally:
        redis_server.stop()


def test_the_private_redis_of_genq_run_asks_for_its_password(tmp_path, monkeypatch):
    """`genq run`'s own Redis: a random password in OUT/.redis/password (0600, folder 0700), given
    to the roles through a file, refused to anyone without it, kept when the run resumes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENQ_")}
    data = tmp_path / "private.jsonl"
    prompts = write_prompts(data, 100)
    out = tmp_path / "out"
    run = _run(data, out, env, "--simulate")
    seen = _follow(run)
    try:
        said = wait_until(
            lambda: re.search(r"Redis redis://127\.0\.0\.1:(\d+)/0", (tmp_path / "run.stderr").read_text()),
            60,
            "genq run to start its Redis",
        )
        stranger = redis.Redis(port=int(said.group(1)), socket_connect_timeout=5)
        with pytest.raises(redis.AuthenticationError):
            stranger.set("genq:planted", "job")
        password = (out / ".redis" / "password").read_text().strip()
        assert run.wait(240) == 0, (tmp_path / "run.stderr").read_text()[-3000:]
    finally:
        run.kill()
    check_records(out, "private", prompts, {"max_new_tokens": 64})
    assert stat.S_IMODE((out / ".redis").stat().st_mode) == 0o700
    assert stat.S_IMODE((out / ".redis" / "password").stat().st_mode) == 0o600
    assert not [pid for pid, line in seen.items() if password.encode() in line]

    again = _run(data, out, env, "--simulate")
    assert again.wait(120) == 0, (tmp_path / "run.stderr").read_text()[-3000:]
    assert (out / ".redis" / "password").read_text().strip() == password, "a resumed run keeps it"


def test_redact_hides_userinfo_and_query_passwords():
    """Both places redis-py reads a password from (redis/connection.py ``parse_url``)."""
    assert redact("redis://:s%40cret@h:6379/0") == "redis://:***@h:6379/0"
    assert redact("rediss://genq:secret@h:6379/0?db=1") == "rediss://genq:***@h:6379/0?db=1"
    assert "secret" not in redact("redis://h:6379/0?ssl=1&password=secret")
    assert split_password("redis://genq:s%40cret@h/0") == ("redis://genq@h/0", "s@cret")
    assert split_password("unix:///run/redis.sock?password=secret") == ("unix:///run/redis.sock", "secret")
    assert redact("redis://h:6379/0") == "redis://h:6379/0"


def test_rediss_refuses_a_certificate_that_names_another_host(tmp_path, pki, monkeypatch):  # noqa: F811
    """A certificate signed by the trusted CA, but for another host: refused, with one line."""
    d = pki
    (d / "other.cnf").write_text("subjectAltName=DNS:elsewhere.example\n")
    key = ["-newkey", "rsa:2048", "-nodes", "-days", "1"]
    openssl("req", *key, "-keyout", f"{d}/other.key", "-out", f"{d}/other.csr", "-subj", "/CN=elsewhere")
    openssl(
        "x509", "-req", "-in", f"{d}/other.csr", "-CA", f"{d}/ca.crt", "-CAkey", f"{d}/ca.key",
        "-CAcreateserial", "-days", "1", "-out", f"{d}/other.crt", "-extfile", f"{d}/other.cnf",
    )  # fmt: skip
    port = free_port()
    server = RedisServer(
        tmp_path, 0, "--tls-port", str(port), "--tls-cert-file", str(d / "other.crt"),
        "--tls-key-file", str(d / "other.key"), "--tls-auth-clients", "no",
    )  # fmt: skip
    url = f"rediss://127.0.0.1:{port}/0"
    env = {"GENQ_REDIS_CA_FILE": str(d / "ca.crt")}
    try:
        server.wait(redis.Redis(port=port, ssl=True, ssl_cert_reqs="none", socket_connect_timeout=1))
        clean_env(monkeypatch, **env)
        assert connect(url).connection_pool.connection_kwargs["ssl_check_hostname"] is True
        with pytest.raises(redis.ConnectionError, match="match|mismatch"):
            connect(url, retry=Retry(NoBackoff(), 0)).ping()
        res = settings_genq("status", "--json", env={**env, "GENQ_REDIS_URL": url})
        assert res.returncode != 0
        assert len(res.stderr.strip().splitlines()) == 1 and "127.0.0.1" in res.stderr, res.stderr
    finally:
        server.stop()


def test_server_url_credentials_become_a_basic_header_and_leave_the_url(monkeypatch):
    """``http://user:pw@host``: the URL genq keeps is bare; the credentials go in a Basic header,
    unless an API key (a Bearer token) is set, which wins."""
    monkeypatch.delenv("GENQ_SERVER_API_KEY", raising=False)
    monkeypatch.delenv("GENQ_SERVER_API_KEY_FILE", raising=False)
    http_ = Http("http://genq:p%40ss@10.0.0.5:30000/")
    assert http_.base_url == "http://10.0.0.5:30000"
    assert http_.headers()["Authorization"] == "Basic " + base64.b64encode(b"genq:p@ss").decode()
    monkeypatch.setenv("GENQ_SERVER_API_KEY", "key")
    assert http_.headers()["Authorization"] == "Bearer key"
    assert Http("http://10.0.0.5:30000").headers().get("Authorization") == "Bearer key"
