"""`genq status --json`: known counters give exact numbers; a real run agrees with the files and stats."""

from __future__ import annotations

import datetime as dt

import orjson
import pytest
from rq.utils import utcformat

from genq import datasets
from genq.commands.status import status
from genq.keys import Keys
from genq.sim.model import generate
from genq.token_counts import BUCKET_S
from tests.helpers import (
    assert_adds_up,
    check_records,
    kill_collector_mid_write,
    log_of,
    read_jsonl,
    sim_post,
    status_json,
    wait_until,
    write_prompts,
)

NOW = 1_000_005.0  # window of the recent rate: buckets 99971..100000, from 999,710 s


def _register(conn, keys: Keys, name: str, enqueued: int, done: int, failed: tuple[int, ...] = ()) -> None:
    datasets.register(conn, keys, datasets.DatasetSettings(name, 1, {"max_new_tokens": 100}))
    for i in range(enqueued):
        conn.setbit(keys.enqueued(name), i, 1)
    for i in range(done):
        conn.setbit(keys.done(name), i, 1)
    for i in failed:
        conn.setbit(keys.failed(name), i, 1)


def test_status_reads_known_counters_exactly(conn, namespace):
    keys = Keys(namespace)
    # "known": 10 jobs: 2 queued, 3 started (2 of them backing off in a worker), 1 result in the
    # stream, 3 done, 1 failed.
    _register(conn, keys, "known", enqueued=10, done=3, failed=(9,))
    queue = f"rq:queue:{keys.queue_name('known')}"
    conn.rpush(queue, "a", "b")
    conn.zadd(f"rq:wip:{keys.queue_name('known')}", {"c:1": NOW + 60, "d:1": NOW + 60, "e:1": NOW + 60})
    conn.hset(keys.in_stream, "known", 1)
    conn.xadd(keys.results("known"), {"kind": "record"}, id=f"{int((NOW - 7) * 1000)}-0")
    for name in ("known", "legacy"):
        conn.set(keys.collector_lease(name), "host:1:abc")
    worker = f"{keys.worker_prefix}host.4242.abc"
    conn.sadd("rq:workers", f"rq:worker:{worker}")
    beat = dt.datetime.fromtimestamp(NOW - 3, dt.UTC)
    conn.hset(
        f"rq:worker:{worker}",
        mapping={
            "hostname": "host",
            "pid": 4242,
            "state": "busy",
            "last_heartbeat": utcformat(beat),
            "successful_job_count": 3,
            "genq_server": "http://gpu-1:30000",
            "genq_slurm_job": "77_1",
            "genq_in_flight": 3,
            "genq_retrying": 2,
            "genq_retries": 7,
            "genq_target": 40,
            "genq_backend": "sglang",
            "genq_version": "0.5.23",
            "genq_model": "m",
            "genq_seeds": "False",
            "genq_heartbeat_ttl": 60,
            "genq_suspects": 4,
            "genq_probation_s": 1800,  # 4 suspects, a send lately 450 s
            "genq_held": "",  # it takes jobs
        },
    )
    conn.hset(keys.retrying(worker), "known", 2)
    # 1,600 completion tokens on disk: 1,000 written long ago, 600 within the last 5 minutes.
    conn.hset(
        keys.tokens("known"),
        mapping={
            "records": 3,
            "prompt_tokens": 30,
            "completion_tokens": 1600,
            "cut": 1,
            "length": 2,  # ended on length: the ledger's cut
            "continued": 0,
            "live_tokens": 1600,
            "first_at": NOW - 400,
            "last_at": NOW - 50,
        },
    )
    for age, n in ((350, 1000), (150, 300), (50, 300)):
        conn.set(keys.rate_bucket("known", int((NOW - age) // BUCKET_S)), n)
    # "legacy": records on disk that no counter covers (a run begun by an older genq).
    _register(conn, keys, "legacy", enqueued=2, done=2)
    # "fresh": nothing done yet.
    _register(conn, keys, "fresh", enqueued=5, done=0)
    conn.rpush(f"rq:queue:{keys.queue_name('fresh')}", *"vwxyz")

    data = status(conn, keys, now=NOW)

    recent = 600 / 295  # since the window's start, 999,710 s
    assert data["datasets"]["known"] == {
        "total": 10,
        "queued": 2,
        "in_flight": 3 - 2 + 1,
        "retrying": 2,
        "done": 3,
        "failed": 1,
        "unaccounted": 0,
        "prompt_tokens": 30,
        "completion_tokens": 1600,
        "avg_completion_tokens": 533.3,
        "capped": 1,
        "tokens_per_s": round(recent, 1),
        "tokens_per_s_since_start": 4.0,  # 1,600 in the 400 s since the first record
        "eta_s": round(6 * (1600 / 3) / recent, 1),
        "extending": 0,
        "rejected": 0,
        # Where each of the 10 went: 3 on disk (1 stopped, 2 cut), 1 failed, 6 not done yet.
        "ledger": {
            "stopped": 1,
            "continued": 0,
            "cut": 2,
            "failed": 1,
            "rejected": 0,
            "pending": 6,
            "read": 10,
        },
        "check": None,  # not a checked dataset
        "from": None,  # no stage: its rows are its files
    }
    legacy = data["datasets"]["legacy"]
    assert legacy["ledger"] is None, "counters of an older genq: where the rows went is unknown"
    assert data["datasets"]["fresh"]["ledger"]["pending"] == 5
    assert (legacy["prompt_tokens"], legacy["completion_tokens"], legacy["avg_completion_tokens"]) == (
        None,
    ) * 3
    assert legacy["eta_s"] == 0.0, "nothing left to do"
    fresh = data["datasets"]["fresh"]
    assert (fresh["queued"], fresh["tokens_per_s"], fresh["eta_s"]) == (5, None, None), "unknown, never 0"
    totals = data["totals"]
    assert (totals["total"], totals["done"], totals["completion_tokens"], totals["eta_s"]) == (
        17,
        5,
        None,
        None,
    )
    assert data["workers"] == [
        {
            "name": worker,
            "host": "host",
            "pid": 4242,
            "server": "http://gpu-1:30000",
            "slurm_job": "77_1",
            "state": "busy",
            "in_flight": 3,
            "retrying": 2,
            "target": 40,
            "done": 3,
            "failed": 0,
            "retries": 7,
            "backend": "sglang",
            "server_version": "0.5.23",
            "model": "m",
            "seeds": False,
            "last_heartbeat": utcformat(beat),
            "heartbeat_age_s": 3.0,
            "alive": True,
            "suspects": 4,
            "probation_s": 1800.0,
            "held": None,
        }
    ]
    assert data["suspects"] == 4 and data["probation_s"] == 1800.0
    assert "about 30 min 0 s until they pass (the ETA counts it)" in " ".join(data["warnings"])
    assert not [w for w in data["warnings"] if "takes no jobs" in w]
    # Its server gate closed (worker/gate.py): status says which worker, its server and why.
    conn.hset(f"rq:worker:{worker}", "genq_held", "server looks down (connection: refused)")
    held = [w for w in status(conn, keys, now=NOW)["warnings"] if "takes no jobs" in w]
    assert held == [
        f"worker {worker} takes no jobs: http://gpu-1:30000 server looks down (connection: refused)"
    ]
    # Silent for longer than its own heartbeat TTL: killed, though RQ keeps its hash for minutes.
    conn.hset(f"rq:worker:{worker}", "genq_heartbeat_ttl", 2)
    assert [w["alive"] for w in status(conn, keys, now=NOW)["workers"]] == [False]
    assert data["stream"] == {
        "length": 1,
        "oldest_pending_s": 7.0,
        "collector": None,  # "fresh" has no collector
        "collectors": {"fresh": None, "known": "host:1:abc", "legacy": "host:1:abc"},
    }


def test_the_eta_waits_for_crash_suspects_to_pass_one_at_a_time(conn, namespace):
    """Suspects are resent one at a time (probation): the ETA is at least the time the slowest
    worker's suspects take, each as long as its sends lately; unknown before a send was timed,
    and a worker's unreadable figure is unknown, not zero."""
    keys = Keys(namespace)
    _register(conn, keys, "only", enqueued=100, done=50)
    conn.hset(keys.tokens("only"), mapping={"records": 50, "prompt_tokens": 500, "completion_tokens": 5000,
                                            "first_at": NOW - 100, "last_at": NOW - 1})  # fmt: skip
    conn.set(keys.rate_bucket("only", int((NOW - 50) // BUCKET_S)), 5000)
    # No worker alive: nothing is being made, so no ETA from the last minutes' rate, and a warning.
    idle = status(conn, keys, now=NOW)
    assert idle["datasets"]["only"]["eta_s"] is None and idle["totals"]["eta_s"] is None
    assert "no worker alive: 50 jobs wait" in " ".join(idle["warnings"]), idle["warnings"]
    worker = f"{keys.worker_prefix}host.1.abc"
    conn.sadd("rq:workers", f"rq:worker:{worker}")
    beat = utcformat(dt.datetime.fromtimestamp(NOW - 1, dt.UTC))
    conn.hset(f"rq:worker:{worker}", mapping={"last_heartbeat": beat})
    by_rate = status(conn, keys, now=NOW)["datasets"]["only"]["eta_s"]  # 50 left × 100 tokens / rate
    assert by_rate is not None and by_rate < 600
    conn.hset(f"rq:worker:{worker}", mapping={"genq_suspects": 6, "genq_probation_s": 900})
    data = status(conn, keys, now=NOW)
    assert data["datasets"]["only"]["eta_s"] == data["totals"]["eta_s"] == 900.0
    for unknown in ("", "nan", "-5", "soon"):
        conn.hset(f"rq:worker:{worker}", "genq_probation_s", unknown)
        data = status(conn, keys, now=NOW)
        assert data["probation_s"] is None and data["totals"]["eta_s"] == by_rate, unknown
        assert "slower than the ETA says until they pass" in " ".join(data["warnings"])


@pytest.mark.slow
def test_status_during_a_run_agrees_with_the_files_and_stats(procs, start_sim, out, tmp_path):
    url = start_sim("--latency", "realistic", "--decode-step-ms", "5", "--fail-500", "1.0")
    data = tmp_path / "run.jsonl"
    write_prompts(data, 80)
    assert procs.run("enqueue", data, "--max-new-tokens", "200").returncode == 0
    worker = procs.start("worker", "--server", url, "--concurrency", "16", "--max-attempts", "50")
    collector = procs.start("collect", "--out", out)

    # Every attempt fails: jobs wait between attempts, and status says so (not "in flight").
    def backing_off():
        s = status_json(procs)
        return s if s["datasets"]["run"]["retrying"] >= 8 and s["workers"][0]["retrying"] else None

    s = wait_until(backing_off, 20, "jobs waiting to retry")
    assert_adds_up(s)
    assert s["datasets"]["run"]["tokens_per_s"] is None and s["datasets"]["run"]["eta_s"] is None
    sim_post(url, "/sim/faults", {"error_500": 0.0})

    # Mid-run: a rate and an ETA once records land; the five still add up.
    def flowing():
        s = status_json(procs)
        c = s["datasets"]["run"]
        return s if c["eta_s"] and c["done"] < 80 and c["tokens_per_s"] else None

    s = wait_until(flowing, 30, "a rate and an ETA")
    assert_adds_up(s)
    assert s["stream"]["collector"] is not None

    def finished():
        s = status_json(procs)
        return s if s["datasets"]["run"]["done"] == 80 and s["workers"][0]["in_flight"] == 0 else None

    s = wait_until(finished, 60, "every record on disk")
    records = read_jsonl(out / "run" / "raw_responses.jsonl")
    c = s["datasets"]["run"]
    assert c["prompt_tokens"] == sum(r["prompt_tokens"] for r in records)
    assert c["completion_tokens"] == sum(r["completion_tokens"] for r in records)
    assert c["avg_completion_tokens"] == round(c["completion_tokens"] / 80, 1)
    assert c["eta_s"] == 0.0 and c["tokens_per_s_since_start"] > 0
    (w,) = s["workers"]
    assert (w["pid"], w["server"], w["done"], w["failed"]) == (worker.pid, url, 80, 0)
    assert w["retries"] >= 8
    assert s["stream"] == {**s["stream"], "length": 0, "oldest_pending_s": 0.0}

    res = procs.run("stats", out, "--json")
    stats = orjson.loads(res.stdout)["datasets"]["run"]
    assert (stats["records"], stats["prompt_tokens"], stats["completion_tokens"]) == (
        80,
        c["prompt_tokens"],
        c["completion_tokens"],
    )
    assert stats["avg_completion_tokens"] == c["avg_completion_tokens"]
    for proc in (worker, collector):
        proc.terminate()
        assert proc.wait(60) == 0, log_of(proc)


def test_token_counters_count_each_record_once_through_kills_and_lost_state(
    procs, start_sim, out, tmp_path, conn, namespace
):
    url = start_sim()
    data = tmp_path / "k.jsonl"
    raw = out / "k" / "raw_responses.jsonl"
    prompts = write_prompts(data, 600)
    assert procs.run("enqueue", data, "--max-new-tokens", "100").returncode == 0
    assert procs.run("worker", "--server", url, "--burst").returncode == 0
    assert status_json(procs)["stream"]["length"] == len(prompts), "every result waits in the stream"
    # Killed three times while it drains that backlog (each kill must leave lines still to write):
    # lines past the checkpoint are counted at start-up.
    kill_collector_mid_write(procs, out, raw, len(prompts))
    keys = Keys(namespace)
    conn.delete(keys.collector_offsets)  # every line looks new: none may be counted twice
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    # Each record once on disk, the server's output for its prompt: the expected sums follow from
    # the prompts themselves.
    records = check_records(out, "k", prompts, {"max_new_tokens": 100})
    sums = (
        len(prompts),
        sum(len(p) for p in prompts),
        sum(len(generate(p, {"max_new_tokens": 100}).output_ids) for p in prompts),
    )
    assert (len(records), sum(r["completion_tokens"] for r in records)) == (sums[0], sums[2])
    c = status_json(procs)["datasets"]["k"]
    assert (c["done"], c["prompt_tokens"], c["completion_tokens"]) == sums

    # A Redis that lost the counters, bitmaps and checkpoints: what is on disk is counted once,
    # and not as tokens generated since the start (that rate would be absurd).
    conn.delete(keys.tokens("k"), keys.done("k"), keys.collector_offsets)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    c = status_json(procs)["datasets"]["k"]
    assert (c["done"], c["prompt_tokens"], c["completion_tokens"]) == sums
    assert conn.hget(keys.tokens("k"), "live_tokens") is None and c["tokens_per_s_since_start"] is None
