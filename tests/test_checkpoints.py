"""A collector whose Redis went back in time without a word: restarted from an older snapshot
between two of its commands. Redis-py's pool reconnects an idle connection on its own, so the
collector sees no error at all; what it must notice is that Redis no longer holds the checkpoints
it last committed (collector/checkpoint.py).

The collector is driven step by step in this process (claim, read, write) against a real
redis-server that is SIGKILLed and restarted from its snapshot at exactly the moment under test;
the results come from a real worker and simulator.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import redis

from genq.collector.writer import Collector
from genq.commands.embedded import EmbeddedRedis
from genq.connection import connect
from genq.keys import Keys
from tests.helpers import check_records, read_jsonl, snapshot, write_prompts

PARAMS = {"max_new_tokens": 100}
N = 300


@pytest.fixture
def timewarp(procs, start_sim, tmp_path, namespace):
    """A private Redis holding N results in the dataset's stream, none collected yet."""
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    env = {"GENQ_REDIS_URL": url}
    data = tmp_path / "warp.jsonl"
    prompts = write_prompts(data, N)
    assert procs.run("enqueue", data, "--max-new-tokens", "100", env=env).returncode == 0
    assert procs.run("worker", "--server", start_sim(), "--burst", env=env).returncode == 0
    keys = Keys(namespace)
    conn = redis.Redis.from_url(url)
    assert conn.xlen(keys.results("warp")) == N
    state = [server, conn, keys, prompts]  # the test puts the restarted server in place
    yield state
    state[0].stop()


def _restart_from_snapshot(server: EmbeddedRedis, tmp_path: Path) -> EmbeddedRedis:
    server.proc.kill()
    server.proc.wait()
    shutil.rmtree(tmp_path / "redis" / "appendonlydir", ignore_errors=True)  # only the snapshot is left
    restarted = EmbeddedRedis(tmp_path / "redis", port=server.port, extra=("--appendonly", "no"))
    restarted.start()
    return restarted


def _drain(collector: Collector) -> None:
    stream = collector.keys.results("warp")
    for _ in range(100):
        collector.renew_leases()
        items = collector.read(100)
        if items:
            collector.write(items)
        elif not collector.conn.xlen(stream):
            return
    raise AssertionError("the stream never ran dry")


def test_bits_restored_from_an_older_snapshot_write_nothing_twice(timewarp, out, tmp_path, caplog):
    """The snapshot holds the lease, the group and every result unread; the collector writes them
    all, then Redis restarts from the snapshot while its connection waits idle in the pool."""
    server, conn, keys, prompts = timewarp
    collector = Collector(connect(server.url), keys, out, batch=100)
    assert collector.claim() == ["warp"]
    # As if taken just after a renewal: the restored lease is still this collector's when it next
    # looks, so nothing about the lease says it holds the dataset anew.
    conn.expire(keys.collector_lease("warp"), 600)
    snapshot(conn)
    _drain(collector)
    assert len(read_jsonl(out / "warp" / "raw_responses.jsonl")) == N
    timewarp[0] = _restart_from_snapshot(server, tmp_path)
    assert conn.xlen(keys.results("warp")) == N and not conn.get(keys.done("warp")), "Redis went back"
    _drain(collector)  # no error on the way: the pool reconnected
    collector.close()
    check_records(out, "warp", prompts, PARAMS)
    assert collector.written == N and collector.duplicates == N
    assert conn.xlen(keys.results("warp")) == 0
    assert bin(int.from_bytes(conn.get(keys.done("warp")), "big")).count("1") == N
    assert "lost this collector's last writes of warp" in caplog.text


def test_a_group_restored_from_before_it_was_made_is_made_again(timewarp, out, tmp_path, caplog):
    """The snapshot is older than the collector: no lease, no consumer group. Its next read finds
    no group (NOGROUP) before its lease is due for renewal."""
    server, conn, keys, prompts = timewarp
    snapshot(conn)
    collector = Collector(connect(server.url), keys, out, batch=100)
    assert collector.claim() == ["warp"]
    _drain(collector)
    timewarp[0] = _restart_from_snapshot(server, tmp_path)
    assert not conn.exists(keys.collector_lease("warp"))
    _drain(collector)
    collector.close()
    check_records(out, "warp", prompts, PARAMS)
    assert collector.written == N and collector.duplicates == N
    assert conn.get(keys.collector_lease("warp")).decode() == collector.lease_id
    assert "lost this collector's last writes of warp" in caplog.text
