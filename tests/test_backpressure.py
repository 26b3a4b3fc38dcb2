"""`enqueue --max-queued`: a bounded queue topped up as it drains, resumable, full totals in status."""

from __future__ import annotations

import socket
import time

import pytest
from rq import Queue

from genq.keys import Keys
from genq.producer.lease import TTL_MS
from genq.progress import STATES, dataset_counts
from tests.helpers import check_records, log_of, sigkill, stop, wait_until, write_prompts

PARAMS = {"max_new_tokens": 64}


def _counts(conn, namespace: str, name: str, settled: bool = False) -> dict[str, int]:
    """Status counts; once nothing moves (``settled``) the five states must add up to the total."""
    counts = dataset_counts(conn, Keys(namespace))[name]
    if settled:
        assert sum(counts[s] for s in STATES) == counts["total"], counts
    return counts


def test_the_queue_stays_bounded_and_tops_up_as_it_drains(procs, start_sim, conn, namespace, out, tmp_path):
    url = start_sim("--latency", "zero")
    data = tmp_path / "bounded.jsonl"
    prompts = write_prompts(data, 240)
    queue = Queue(Keys(namespace).queue_name("bounded"), connection=conn, serializer="json")
    collector = procs.start("collect", "--out", out)
    worker = procs.start("worker", "--server", url, "--concurrency", "8")
    enqueue = procs.start("enqueue", data, "--max-new-tokens", "64", "--max-queued", "30")
    longest, totals = 0, set()
    deadline = time.monotonic() + 90
    while enqueue.poll() is None:
        assert time.monotonic() < deadline, "the enqueue did not finish"
        longest = max(longest, conn.llen(queue.key))
        if conn.hexists(Keys(namespace).datasets, "bounded"):
            totals.add(_counts(conn, namespace, "bounded")["total"])
        time.sleep(0.02)
    assert enqueue.returncode == 0, log_of(enqueue)
    assert "bounded: 240 rows in its sources; at most 30 jobs queued at once" in log_of(enqueue)
    assert 0 < longest <= 30, f"queue reached {longest}"
    assert totals - {0} == {240}, f"status showed totals {totals}: the full total once counted"
    wait_until(lambda: _counts(conn, namespace, "bounded")["done"] == 240, 60, "every record on disk")
    assert stop(worker) == 0 and stop(collector) == 0
    check_records(out, "bounded", prompts, PARAMS)
    assert _counts(conn, namespace, "bounded", settled=True)["total"] == 240
    assert not conn.hexists(Keys(namespace).in_source, "bounded")


@pytest.mark.timeout(390)  # its waits, the second enqueue and two stops add up to 330 s
def test_a_killed_bounded_enqueue_resumes_without_duplicates(
    procs, start_sim, conn, namespace, out, tmp_path
):
    url = start_sim("--latency", "zero")
    data = tmp_path / "resume.jsonl"
    prompts = write_prompts(data, 200)
    queue = Queue(Keys(namespace).queue_name("resume"), connection=conn, serializer="json")
    # No worker yet: the enqueue fills the queue to its bound and waits.
    first = procs.start("enqueue", data, "--max-new-tokens", "64", "--max-queued", "20")
    wait_until(lambda: conn.llen(queue.key) >= 20, 30, "the queue to reach its bound")
    # While it waits for room the enqueue looks at the queue every 50 ms and its lease is renewed
    # every 2 s: stretch the lease, and its renewal back to TTL_MS proves the enqueue is alive,
    # still waiting since, and pushed nothing.
    alive = Keys(namespace).enqueuing("resume")
    assert conn.get(alive).startswith(f"{socket.gethostname()}:{first.pid}:".encode())
    conn.pexpire(alive, 600_000)
    wait_until(lambda: 0 < conn.pttl(alive) <= TTL_MS, 30, "the enqueue to look again")
    assert first.poll() is None, "the enqueue waits for room"
    assert conn.llen(queue.key) == 20, f"the enqueue pushed past its bound: {conn.llen(queue.key)} queued"
    counts = _counts(conn, namespace, "resume", settled=True)
    assert (counts["total"], counts["queued"]) == (200, 200), counts
    sigkill(first)
    assert _counts(conn, namespace, "resume", settled=True) == counts, "the full total after the kill"
    # Restarted with workers: it skips what is queued and continues.
    collector = procs.start("collect", "--out", out)
    worker = procs.start("worker", "--server", url, "--concurrency", "8")
    res = procs.run("enqueue", data, "--max-new-tokens", "64", "--max-queued", "20", timeout=90)
    assert res.returncode == 0, res.stderr
    assert "resume: read 200, enqueued 180, skipped 20, rejected 0" in res.stdout
    wait_until(lambda: _counts(conn, namespace, "resume")["done"] == 200, 60, "every record on disk")
    assert stop(worker) == 0 and stop(collector) == 0
    check_records(out, "resume", prompts, PARAMS)
    assert _counts(conn, namespace, "resume", settled=True)["done"] == 200
