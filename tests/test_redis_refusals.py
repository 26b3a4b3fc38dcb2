"""A Redis that answers but refuses commands for a while (out of memory, its disk unwritable, its
scripts flushed) is ridden out by every role like an outage; an error reply that is a bug still
fails, in one line (genq/redis_errors.py). Each test has a Redis of its own: they change its
configuration."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from genq import progress
from genq.commands.embedded import EmbeddedRedis
from genq.keys import Keys
from genq.redis_errors import NOT_NOW, not_now
from genq.worker.background import keep_running
from tests.helpers import (
    assert_adds_up,
    assert_verified,
    check_records,
    log_of,
    pinned_env,
    run_tests_in,
    sim_stats,
    status_json,
    stop,
    wait_until,
    write_prompts,
)

N = 1500
OLDEST_REDIS_PY = "5.0.1"  # pyproject.toml's floor
PARAMS = {"max_new_tokens": 200}
WORKERS, CONCURRENCY = 2, 32
HOLD_S = 20  # how long Redis refuses, as an operator would take to lift the limit
REFUSED = "Redis refuses writes:"
BACK = "Redis takes commands again"


@pytest.fixture
def own_redis(tmp_path, procs) -> Iterator[tuple[EmbeddedRedis, redis.Redis]]:
    """A Redis of the test's own (``dir`` may be changed: protected configs allowed), which every
    process the test starts uses."""
    server = EmbeddedRedis(tmp_path / "redis", extra=("--enable-protected-configs", "yes"))
    url = server.start()
    procs.env["GENQ_REDIS_URL"] = url
    yield server, redis.Redis.from_url(url)
    server.stop()


def _error(fn: Callable[[], object]) -> Exception:
    with pytest.raises(redis.RedisError) as caught:
        fn()
    return caught.value


def test_error_replies_are_classified_wherever_redis_py_puts_them(own_redis, tmp_path):
    """Real replies of a real Redis: refused plainly, inside MULTI, inside a Lua script, and at
    EXEC; a WRONGTYPE is "not now" (a key put wrong by hand, waited out until it is put right), a
    bug is not, in a pipeline or not."""
    server, conn = own_redis
    script = conn.register_script("return redis.call('SET', KEYS[1], ARGV[1])")
    conn.set("big", "x" * 200_000)
    conn.config_set("maxmemory", conn.info("memory")["used_memory"] // 2)
    oom = "Redis refuses writes: OOM command not allowed when used memory > 'maxmemory'"

    def in_multi() -> None:
        with conn.pipeline() as pipe:
            pipe.get("big")
            script(keys=["k"], args=["v"], client=pipe)
            pipe.execute()

    assert not_now(_error(lambda: conn.set("a", "b"))) == oom
    assert not_now(_error(lambda: script(keys=["k"], args=["v"]))) == oom
    assert not_now(_error(in_multi)) == oom
    # Queued while Redis had room, refused at EXEC: EXECABORT carrying the reason.
    one = redis.Redis.from_url(server.url, single_connection_client=True)
    conn.config_set("maxmemory", 0)
    one.execute_command("MULTI")
    one.execute_command("SET", "a", "b")
    conn.config_set("maxmemory", conn.info("memory")["used_memory"] // 2)
    aborted = _error(lambda: one.execute_command("EXEC"))
    assert isinstance(aborted, redis.exceptions.ExecAbortError)
    assert not_now(aborted) == oom
    conn.config_set("maxmemory", 0)
    # MISCONF: a snapshot that could not be written (its folder gone), stop-writes-on-bgsave-error.
    _refuse_misconf(conn, tmp_path)
    misconf = not_now(_error(lambda: conn.set("a", "b")))
    # genq's words and the code once, wherever redis-py keeps the code (redis-py >= 8 leaves it
    # in the text as well as in status_code); the rest is Redis's own, not asserted.
    assert misconf and misconf.startswith("Redis refuses writes: MISCONF ") and misconf.count("MISCONF") == 1
    assert not_now(_error(in_multi)) == misconf
    assert not_now(_error(lambda: script(keys=["k"], args=["v"]))) == misconf
    _restore_misconf(conn, server)
    # A key of the wrong type (a genq key overwritten by hand): waited out too, until it is put right.
    conn.set("str", "x")
    wrong = not_now(_error(lambda: conn.hget("str", "f")))
    assert wrong and wrong.startswith(f"{NOT_NOW['WRONGTYPE']}: WRONGTYPE ") and wrong.count("WRONGTYPE") == 1

    def wrong_in_pipeline() -> None:
        with conn.pipeline() as pipe:
            pipe.hget("str", "f")
            pipe.execute()

    assert not_now(_error(wrong_in_pipeline)) == wrong
    # A bug is not "not now", in a pipeline or not.
    assert not_now(_error(lambda: conn.execute_command("NOSUCHCOMMAND"))) is None

    def bug_in_pipeline() -> None:
        with conn.pipeline() as pipe:
            pipe.execute_command("SET", "only-a-key")
            pipe.execute()

    assert not_now(_error(bug_in_pipeline)) is None
    conn.script_flush()
    assert not_now(_error(lambda: conn.evalsha(script.sha, 1, "k", "v")))
    assert script(keys=["k"], args=["v"]) == b"OK", "redis-py's Script loads its script again"


def test_replies_are_classified_alike_on_the_oldest_redis_py(tmp_path):
    """pyproject.toml admits redis-py from OLDEST_REDIS_PY (RQ 3's own floor) to the newest, which
    a fresh install gets; where each puts an error code differs (5.x strips MISCONF's from the text,
    8.x keeps it there and in status_code). This module's fast tests run again on the oldest."""
    run_tests_in(pinned_env("redis", OLDEST_REDIS_PY), tmp_path, __file__, "not oldest_redis_py")


def _refuse_misconf(conn: redis.Redis, tmp_path: Path) -> None:
    """Make Redis refuse writes with MISCONF: save points on, stop-writes-on-bgsave-error, and a
    snapshot into a folder that no longer exists (as root, any existing folder is writable)."""
    gone = tmp_path / "gone"
    gone.mkdir()
    conn.config_set("save", "3600 1")
    conn.config_set("stop-writes-on-bgsave-error", "yes")
    conn.config_set("dir", str(gone))
    os.rmdir(gone)
    wait_until(lambda: conn.info("persistence")["rdb_bgsave_in_progress"] == 0, 30, "no snapshot running")
    conn.bgsave()
    wait_until(
        lambda: conn.info("persistence")["rdb_last_bgsave_status"] == "err", 30, "the snapshot to fail"
    )


def _restore_misconf(conn: redis.Redis, server: EmbeddedRedis) -> None:
    """Its folder back: the next snapshot succeeds, and writes are taken again."""
    conn.config_set("dir", str(server.folder))
    conn.bgsave()
    wait_until(lambda: conn.info("persistence")["rdb_last_bgsave_status"] == "ok", 30, "a good snapshot")
    conn.config_set("save", "")


def _run_through(
    procs,
    start_sim,
    out: Path,
    tmp_path: Path,
    conn: redis.Redis,
    name: str,
    refuse: Callable[[], object],
    restore: Callable[[], object],
    said: str | None,
    report: Callable[[str], None],
) -> dict:
    """The scenario of every refusal: 1,500 prompts, two workers and a collector; ``refuse`` when
    15% are on disk (then every role must log ``said``), ``restore`` HOLD_S seconds later. Then
    every prompt on disk once with the simulator's ids, no role exited, nothing generated twice
    beyond what was in flight, `genq verify` clean. Returns the roles' logs, the records on disk
    when Redis was restored, and what `genq status` said meanwhile."""
    sim = start_sim("--latency", "realistic", "--decode-step-ms", "3")
    data = tmp_path / f"{name}.jsonl"
    prompts = write_prompts(data, N)
    enqueue = procs.run("enqueue", data, "--max-new-tokens", "200")
    assert enqueue.returncode == 0, enqueue.stderr
    keys = Keys(procs.env["GENQ_NAMESPACE"])
    collector = procs.start("collect", "--out", out)
    workers = [
        procs.start("worker", "--server", sim, "--concurrency", str(CONCURRENCY)) for _ in range(WORKERS)
    ]
    roles = [*workers, collector]

    def done() -> int:
        return progress.dataset_counts(conn, keys)[name]["done"]

    wait_until(lambda: done() >= 0.15 * N, 120, "15% of the prompts on disk")
    refused_at = time.monotonic()
    refuse()
    assert done() < N, "Redis refused after the run, not mid-run"
    if said:  # every role met the refusal, while work was left
        wait_until(lambda: all(said in log_of(r) for r in roles), HOLD_S, f"every role to say {said!r}")
        assert done() < N, "the refusal held the run back"
    held = procs.run("status")  # it says why nothing moves, in one line at most
    time.sleep(max(0.0, refused_at + HOLD_S - time.monotonic()))
    during = done()
    restore()
    wait_until(lambda: done() == N, 180, "every record on disk")
    assert [r.poll() for r in roles] == [None] * len(roles), "a role exited: " + log_of(roles[0])
    for role in roles:
        assert stop(role, timeout=60) == 0, log_of(role)
    records = check_records(out, name, prompts, PARAMS)
    assert_verified(procs, out, data)
    assert_adds_up(status_json(procs))
    stats = sim_stats(sim)
    wasted = stats["generations"] - len(records)
    report(
        f"redis refusals ({name}): {N} prompts, {during} on disk when Redis took writes again; the "
        f"simulator finished {stats['generations']} generations: {wasted} did not become the record"
    )
    # A job in flight when Redis refused may run again (its heartbeat lapsed), never more: at most
    # what the workers held in flight, and never a prompt more than twice in all.
    assert wasted <= WORKERS * CONCURRENCY, stats
    return {"logs": [log_of(r) for r in roles], "during": during, "status": held.stdout + held.stderr}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_redis_out_of_memory_mid_run_is_ridden_out(own_redis, procs, start_sim, out, tmp_path, report):
    """maxmemory under noeviction lowered below what Redis holds (every write is refused), lifted
    20 s later, as an operator would."""
    _, conn = own_redis
    run = _run_through(
        procs,
        start_sim,
        out,
        tmp_path,
        conn,
        "oom",
        lambda: conn.config_set("maxmemory", conn.info("memory")["used_memory"] // 2),
        lambda: conn.config_set("maxmemory", 0),
        f"{REFUSED} OOM",
        report,
    )
    said = f"{REFUSED} OOM command not allowed when used memory > 'maxmemory'; retrying"
    for log in run["logs"]:
        assert said in log, log
        assert BACK in log, log
        assert "Traceback" not in log, log
    assert "Redis refuses writes (OOM: used memory" in run["status"], run["status"]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_redis_disk_refusing_snapshots_mid_run_is_ridden_out(
    own_redis, procs, start_sim, out, tmp_path, report
):
    """MISCONF: a snapshot that fails (its folder gone) with stop-writes-on-bgsave-error; the
    folder back 20 s later."""
    server, conn = own_redis
    run = _run_through(
        procs,
        start_sim,
        out,
        tmp_path,
        conn,
        "misconf",
        lambda: _refuse_misconf(conn, tmp_path),
        lambda: _restore_misconf(conn, server),
        f"{REFUSED} MISCONF",
        report,
    )
    for log in run["logs"]:
        assert f"{REFUSED} MISCONF" in log and BACK in log, log
        assert "Traceback" not in log, log
    # MISCONF refuses PING too, so redis-py's health check: status says so in one line.
    assert run["status"].startswith(f"Error: {REFUSED} MISCONF"), run["status"]
    assert run["status"].strip().count("\n") == 0, run["status"]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_scripts_flushed_mid_run_are_loaded_again(own_redis, procs, start_sim, out, tmp_path, report):
    """SCRIPT FLUSH, again and again for 5 s: every Lua script genq runs is loaded again."""
    _, conn = own_redis

    def flush_often() -> None:
        until = time.monotonic() + 5
        while time.monotonic() < until:
            conn.script_flush()
            time.sleep(0.002)  # often enough to land between a script's reload and its EVALSHA

    run = _run_through(
        procs, start_sim, out, tmp_path, conn, "noscript", flush_often, lambda: None, None, report
    )
    for log in run["logs"]:
        assert "Traceback" not in log, log
    assert conn.info("memory")["number_of_cached_scripts"] > 0, "the scripts were loaded again"
    lost = sum(log.count("Redis has lost genq's scripts") for log in run["logs"])
    report(f"redis refusals (noscript): NOSCRIPT reached genq's retry {lost} times (the rest redis-py's)")


@pytest.mark.timeout(120)
def test_enqueue_into_a_full_redis_waits_and_pushes_each_row_once(own_redis, procs, tmp_path):
    _, conn = own_redis
    data = tmp_path / "full.jsonl"
    write_prompts(data, 3000)
    conn.config_set("maxmemory", conn.info("memory")["used_memory"] // 2)
    enqueue = procs.start("enqueue", data, "--max-new-tokens", "200")
    wait_until(lambda: f"{REFUSED} OOM" in log_of(enqueue), 30, "enqueue to meet the full Redis")
    conn.config_set("maxmemory", 0)
    assert enqueue.wait(60) == 0, log_of(enqueue)
    assert BACK in log_of(enqueue) and "Traceback" not in log_of(enqueue)
    c = status_json(procs)["datasets"]["full"]
    assert (c["total"], c["queued"]) == (3000, 3000), c
    queue = Keys(procs.env["GENQ_NAMESPACE"]).queue_name("full")
    assert conn.llen(f"rq:queue:{queue}") == 3000, "each row pushed once"


@pytest.mark.timeout(120)
def test_an_enqueue_goes_on_after_an_oom_longer_than_its_lease(own_redis, procs, tmp_path):
    """Redis refuses its pushes and its renewals (PEXPIRE is a ``denyoom`` write too) until its
    lease lapses; nobody took the dataset meanwhile (the lease epoch says so), so it takes the lease
    back and goes on when Redis takes writes again."""
    _, conn = own_redis
    keys = Keys(procs.env["GENQ_NAMESPACE"])
    data, lease, queue = (
        tmp_path / "long.jsonl",
        keys.enqueuing("long"),
        f"rq:queue:{keys.queue_name('long')}",
    )
    write_prompts(data, 3000)
    enqueue = procs.start("enqueue", data, "--max-new-tokens", "200", "--max-queued", "100")
    wait_until(lambda: conn.llen(queue) == 100, 30, "the queue at its bound (no worker)")
    holder = conn.get(lease)
    conn.config_set("maxmemory", conn.info("memory")["used_memory"] // 2)
    conn.delete(queue)  # room (DEL is no denyoom write): its next push meets the full Redis
    wait_until(lambda: f"{REFUSED} OOM" in log_of(enqueue), 30, "enqueue to meet the full Redis")
    wait_until(lambda: not conn.exists(lease), 30, "the lease to lapse during the OOM")
    conn.config_set("maxmemory", 0)
    wait_until(lambda: conn.llen(queue) == 100, 30, "the enqueue to push again")
    assert enqueue.poll() is None and "another enqueue took" not in log_of(enqueue), log_of(enqueue)
    assert conn.get(lease) == holder, "the lease taken back by its holder"


@pytest.mark.timeout(120)
def test_an_error_reply_that_is_a_bug_fails_in_one_line(own_redis, procs, out):
    """A reply no wait fixes (NOPERM: the Redis user may not write genq's keys) is said in one
    line by a command and ends a role with exit 4, no traceback; a genq key of the wrong type is
    named with the type genq keeps there."""
    _, conn = own_redis
    keys = Keys(procs.env["GENQ_NAMESPACE"])
    conn.execute_command("ACL", "SETUSER", "reader", "on", ">reader-pw", "~*", "&*", "+@all", "-@write")
    reader = {**procs.env, "GENQ_REDIS_URL": procs.env["GENQ_REDIS_URL"].replace("://", "://reader@", 1)}
    reader["GENQ_REDIS_PASSWORD"] = "reader-pw"
    collector = procs.start("collect", "--out", out, env=reader)
    assert collector.wait(60) == 4, log_of(collector)
    log = log_of(collector)
    assert "Traceback" not in log and "does not wait out" in log, log
    conn.set(keys.datasets, "not a hash")
    res = procs.run("status")
    assert res.returncode == 1 and res.stderr.strip().count("\n") == 0, res.stderr
    assert f"{NOT_NOW['WRONGTYPE']}: WRONGTYPE" in res.stderr and "the roles wait" in res.stderr, res.stderr


def test_a_background_task_that_dies_is_logged_and_started_again(caplog):
    """The worker's heartbeats, commits, reports... never silently gone (worker/background.py)."""
    runs: list[int] = []

    async def body() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise RuntimeError("boom")
        await asyncio.sleep(3600)

    async def main() -> None:
        task = asyncio.create_task(keep_running("heartbeats", body, dict, pause=0.01))
        for _ in range(500):
            if len(runs) == 2:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.ERROR, logger="genq.worker"):
        asyncio.run(main())
    assert len(runs) == 2, "started again after it died"
    assert [r.getMessage() for r in caplog.records] == [
        "background task heartbeats died (RuntimeError: boom); starting it again in 0 s"
    ]


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_redis_restarted_and_loading_its_data_is_ridden_out(procs, start_sim, out, tmp_path, report):
    """LOADING: Redis restarted mid-run reads its data back slowly (key-load-delay, Redis's own
    test knob: each key 15 ms), answering LOADING meanwhile; redis-py retries that for a few
    seconds, genq for as long as it lasts."""
    server = EmbeddedRedis(tmp_path / "redis")
    procs.env["GENQ_REDIS_URL"] = server.start()
    conn = redis.Redis.from_url(server.url)
    slow = EmbeddedRedis(
        tmp_path / "redis",
        port=server.port,
        extra=("--key-load-delay", "15000", "--loading-process-events-interval-bytes", "1024"),
    )

    def restart() -> None:
        conn.bgrewriteaof()  # every key into the AOF's base RDB, which key-load-delay slows
        persisting = lambda: conn.info("persistence")  # noqa: E731
        wait_until(
            lambda: not (p := persisting())["aof_rewrite_in_progress"] and not p["aof_rewrite_scheduled"],
            60,
            "the AOF rewrite",
        )
        server.stop()
        slow.start(timeout=120)  # returns once loaded

    try:
        run = _run_through(
            procs,
            start_sim,
            out,
            tmp_path,
            conn,
            "loading",
            restart,
            lambda: None,
            "Redis is loading its data: LOADING Redis is loading the dataset in memory; retrying",
            report,
        )
    finally:
        slow.stop()
        server.stop()
    for log in run["logs"]:
        assert "Traceback" not in log and BACK in log, log
