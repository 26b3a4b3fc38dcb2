"""Redis that fails over or goes back in time, and `genq verify`, the audit that says whether genq
recovered: every way Redis loses recent writes leaves a consistent earlier state, and genq's state
in Redis plus its fsynced files recover from any earlier state.

Real redis-servers: a primary, a replica and three Sentinels (`redis-server --sentinel`) on this
machine, SIGKILLed and SIGSTOPped mid-run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import orjson
import pytest
import redis

from genq.commands.embedded import EmbeddedRedis, free_port, redis_binary
from tests.helpers import check_records, log_of, read_jsonl, snapshot, status_json, wait_until, write_prompts

pytestmark = pytest.mark.slow  # Redis snapshots, Sentinel failovers: each test runs a minute or more
PARAMS = {"max_new_tokens": 100}
MASTER = "genq"


def verify(procs, out: Path, *files, env=None) -> tuple[int, dict]:
    res = procs.run("verify", "--out", out, *files, "--json", env=env)
    (audit,) = orjson.loads(res.stdout)
    return res.returncode, audit


def test_verify_reports_a_duplicated_line_and_a_missing_one(procs, start_sim, out, tmp_path):
    url = start_sim()
    data = tmp_path / "audit.jsonl"
    prompts = write_prompts(data, 50)
    with data.open("ab") as fh:
        fh.write(b'{"prompt": ""}\n')  # rejected at enqueue: accounted for, not missing
    assert procs.run("enqueue", data, "--max-new-tokens", "100").returncode == 3  # the rejected row
    assert procs.run("worker", "--server", url, "--burst").returncode == 0
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    check_records(out, "audit", prompts, PARAMS)  # a sound run: what verify finds wrong next is the edit
    code, audit = verify(procs, out, data)
    assert code == 0 and audit["ok"] and (audit["expected"], audit["done"]) == (51, 50)
    assert audit["rejected_at_enqueue"] == 1
    raw = out / "audit" / "raw_responses.jsonl"
    lines = raw.read_bytes().splitlines(keepends=True)
    raw.write_bytes(b"".join([*lines[:7], lines[3], *lines[8:]]))  # line 3 twice, line 7's record gone
    code, audit = verify(procs, out, data)
    assert code == 1 and not audit["ok"]
    assert (audit["missing"], audit["duplicated"]) == (1, 1)
    assert audit["missing_examples"] == [orjson.loads(lines[7])["id"]]
    assert audit["duplicated_examples"] == [orjson.loads(lines[3])["id"]]
    assert audit["put_back"] == f"genq enqueue {data} --dataset audit"
    text = procs.run("verify", "--out", out)
    assert text.returncode == 1 and "MISSING 1" in text.stderr and "DUPLICATED 1" in text.stderr


# Its waits: 60 + 120 + 30 + 180 + 120 (the enqueue) + 60 + 240 s, commands of up to 3 x 120 s (verify,
# enqueue), and 3 x 60 s for the roles to stop.
@pytest.mark.timeout(1500)
def test_redis_back_in_time_from_an_older_snapshot(procs, start_sim, out, tmp_path):
    """A snapshot taken while enqueue was still running; Redis killed later and restarted from it
    (its AOF gone): part of the dataset's enqueueing is forgotten too. verify says so until the
    enqueue runs again; then every prompt is on disk exactly once."""
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    env = {"GENQ_REDIS_URL": url}
    sim = start_sim("--latency", "realistic", "--decode-step-ms", "4")
    data = tmp_path / "timewarp.jsonl"
    prompts = write_prompts(data, 1500)
    conn = redis.Redis.from_url(url)
    try:
        enqueue = procs.start("enqueue", data, "--max-new-tokens", "100", "--max-queued", "200", env=env)
        collector = procs.start("collect", "--out", out, env=env)
        workers = [
            procs.start("worker", "--server", sim, "--concurrency", "32", "--heartbeat-ttl", "5", env=env)
            for _ in range(2)
        ]
        wait_until(lambda: (out / "timewarp" / "raw_responses.jsonl").exists(), 60, "records on disk")
        wait_until(lambda: _done(procs, env) > 300, 120, "a quarter on disk")
        snapshot(conn)
        assert enqueue.poll() is None, "the enqueue is still running when the snapshot is taken"
        wait_until(lambda: _done(procs, env) > 1100, 180, "three quarters on disk")
        server.proc.kill()  # the last writes since the snapshot are gone with the AOF
        server.proc.wait()
        shutil.rmtree(tmp_path / "redis" / "appendonlydir", ignore_errors=True)
        server = EmbeddedRedis(tmp_path / "redis", port=server.port, extra=("--appendonly", "no"))
        server.start()
        enqueue.wait(120)  # done, or stopped by the restart ("run the same command again")
        wait_until(
            lambda: procs.run("verify", "--out", out, data, env=env).returncode == 1, 60, "verify to fail"
        )
        code, audit = verify(procs, out, data, env=env)
        assert audit["missing"] > 0 and audit["put_back"].startswith("genq enqueue"), audit
        # The enqueue is run again, as verify says; then everything lands once.
        assert procs.run("enqueue", data, "--max-new-tokens", "100", env=env).returncode == 0
        wait_until(lambda: _finished(procs, env, "timewarp", 1500), 240, "every record on disk", interval=1)
        code, audit = verify(procs, out, data, env=env)
        assert code == 0 and audit["done"] == 1500, audit
        for w in workers:
            w.send_signal(signal.SIGTERM)
        collector.send_signal(signal.SIGTERM)
        assert all(p.wait(60) == 0 for p in (*workers, collector))
    finally:
        server.stop()
    check_records(out, "timewarp", prompts, PARAMS)


def _finished(procs, env, dataset: str, n: int) -> bool:
    try:
        status = status_json(procs, env)
    except AssertionError:  # Redis between primaries
        return False
    return status["datasets"][dataset]["done"] == n and status["stream"]["length"] == 0


def _done(procs, env) -> int:
    try:
        return status_json(procs, env)["datasets"]["timewarp"]["done"]
    except (AssertionError, KeyError):  # Redis restarting, or the dataset not registered yet
        return 0


class Sentinels:
    """A primary, a replica and three Sentinels watching them, on this machine."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.primary = EmbeddedRedis(folder / "primary")
        self.replica = EmbeddedRedis(folder / "replica")
        self.ports = [free_port() for _ in range(3)]
        self.procs: list[subprocess.Popen] = []

    def start(self) -> str:
        self.primary.start()
        self.replica.extra = ("--replicaof", "127.0.0.1", str(self.primary.port))
        self.replica.start()
        for i, port in enumerate(self.ports):
            conf = self.folder / f"sentinel-{i}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {self.folder}\nlogfile {self.folder}/sentinel-{i}.log\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {self.primary.port} 2\n"
                f"sentinel down-after-milliseconds {MASTER} 1000\n"
                f"sentinel failover-timeout {MASTER} 5000\n"
                f"sentinel parallel-syncs {MASTER} 1\n"
            )
            self.procs.append(
                subprocess.Popen([redis_binary(), str(conf), "--sentinel"], stdout=subprocess.DEVNULL)
            )
        first = redis.Redis(port=self.ports[0], socket_connect_timeout=1)
        wait_until(
            lambda: _quiet(lambda: first.sentinel_master(MASTER)["num-other-sentinels"] == 2), 30, "sentinels"
        )
        wait_until(lambda: _quiet(lambda: len(first.sentinel_slaves(MASTER)) == 1), 30, "the replica seen")
        return f"redis+sentinel://{','.join(f'127.0.0.1:{p}' for p in self.ports)}/{MASTER}/0"

    def master_port(self) -> int:
        return int(redis.Redis(port=self.ports[0]).sentinel_get_master_addr_by_name(MASTER)[1])

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(10)
        for server in (self.primary, self.replica):
            if server.proc is not None and server.proc.poll() is None:
                os.kill(server.proc.pid, signal.SIGCONT)
            server.stop()


def _quiet(check) -> bool:
    try:
        return bool(check())
    except (redis.RedisError, KeyError, IndexError):
        return False


def _run_through(procs, start_sim, out, tmp_path, event, report, what: str) -> None:
    """600 prompts through two workers and a collector on a Sentinel-watched Redis; ``event(cluster)``
    happens a third of the way; then the run must end with every prompt on disk exactly once."""
    cluster = Sentinels(tmp_path)
    url = cluster.start()
    env = {"GENQ_REDIS_URL": url}
    sim = start_sim("--latency", "realistic", "--decode-step-ms", "4")
    data = tmp_path / "failover.jsonl"
    prompts = write_prompts(data, 600)
    try:
        assert procs.run("enqueue", data, "--max-new-tokens", "100", env=env).returncode == 0
        collector = procs.start("collect", "--out", out, env=env)
        workers = [
            procs.start("worker", "--server", sim, "--concurrency", "32", "--heartbeat-ttl", "5", env=env)
            for _ in range(2)
        ]
        raw = out / "failover" / "raw_responses.jsonl"
        wait_until(lambda: raw.exists() and len(raw.read_bytes().splitlines()) > 200, 120, "a third on disk")
        lines = len(raw.read_bytes().splitlines())
        assert lines < 600, "the event comes mid-run"
        started = time.monotonic()
        event(cluster)
        wait_until(lambda: cluster.master_port() == cluster.replica.port, 60, "the Sentinels to fail over")
        promoted = time.monotonic() - started
        wait_until(
            lambda: len(raw.read_bytes().splitlines()) > lines + 50, 120, "records again after the failover"
        )
        report(
            f"redis failover ({what}): replica promoted {promoted:.1f} s after, records on disk again "
            f"{time.monotonic() - started:.1f} s after (Sentinel down-after 1 s)"
        )
        wait_until(lambda: _finished(procs, env, "failover", 600), 240, "every record on disk", interval=1)
        code, audit = verify(procs, out, data, env=env)
        assert code == 0 and audit["done"] == 600, audit
        for proc in (*workers, collector):
            proc.send_signal(signal.SIGTERM)
        assert all(p.wait(60) == 0 for p in (*workers, collector)), [log_of(p) for p in workers]
    finally:
        cluster.stop()
    check_records(out, "failover", prompts, PARAMS)
    assert not read_jsonl(out / "failover" / "errors.jsonl")


# _run_through's waits: 30 + 30 (the Sentinels) + 120 + 60 + 120 + 240 s, the event's (up to 120 s), the
# enqueue and verify (2 x 120 s) and 3 x 60 s for the roles to stop.
@pytest.mark.timeout(1300)
def test_roles_follow_a_sentinel_failover_when_the_primary_dies(procs, start_sim, out, tmp_path, report):
    def kill(cluster: Sentinels) -> None:
        cluster.primary.proc.kill()  # type: ignore[union-attr]

    _run_through(procs, start_sim, out, tmp_path, kill, report, "primary SIGKILLed")


@pytest.mark.timeout(1300)  # as above
def test_a_frozen_primary_that_comes_back_loses_and_repeats_nothing(procs, start_sim, out, tmp_path, report):
    """SIGSTOP long enough for the Sentinels to promote the replica, then SIGCONT: the old primary
    believes it is primary for a moment, a role still connected to it writes there until Sentinel
    demotes it, and those writes vanish with its data."""

    def freeze(cluster: Sentinels) -> None:
        pid = cluster.primary.proc.pid  # type: ignore[union-attr]
        os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: cluster.master_port() == cluster.replica.port, 60, "the promotion")
        time.sleep(1)  # frozen a moment longer (not a wait for anything): roles may still hold it
        os.kill(pid, signal.SIGCONT)
        # It came back: it answers, and the Sentinels turn it into a replica of the new primary.
        old = redis.Redis(port=cluster.primary.port, socket_connect_timeout=1, socket_timeout=5)
        wait_until(lambda: _quiet(lambda: old.role()[0] == b"slave"), 60, "the old primary to be demoted")

    _run_through(procs, start_sim, out, tmp_path, freeze, report, "primary SIGSTOPped, then SIGCONTed")
