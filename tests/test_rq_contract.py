"""The real `rq info` sees genq's asyncio worker the way it sees RQ's own: busy, jobs executing.

These are contract tests for the RQ internals genq relies on (``rq>=2.12,<4``): they run against
the installed RQ, and test_the_contract_holds_on_the_other_rq_major runs them again against the
other major (OTHER_RQ, installed once into a cache outside the clone).
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from tests.helpers import (
    check_records,
    log_of,
    pinned_env,
    run_tests_in,
    status_json,
    wait_until,
    write_prompts,
)

RQ = str(Path(sys.executable).parent / "rq")
# The RQ each supported major is checked against when the other one is installed.
OTHER_RQ = {"2": "3.0.0", "3": "2.12.0"}
LONG = {"min_len": 1500, "max_len": 1600}


def rq_info(redis_url: str, *flags: str) -> str:
    res = subprocess.run([RQ, "info", "-u", redis_url, *flags], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


@pytest.mark.slow
def test_rq_info_lists_the_worker_busy_and_its_jobs_executing(
    procs, start_sim, out, tmp_path, redis_url, namespace
):
    url = start_sim(
        "--latency", "realistic", "--min-len", "1500", "--max-len", "1600", "--decode-step-ms", "4"
    )
    data = tmp_path / "contract.jsonl"
    prompts = write_prompts(data, 30)
    assert procs.run("enqueue", data, "--max-new-tokens", "2000").returncode == 0
    worker = procs.start("worker", "--server", url, "--concurrency", "12")
    # 12 sent and 3 taken ahead for the next free slots (WorkerConfig.prefetch): all 15 are
    # started jobs of this worker in RQ's registry, and come back if it dies.
    wait_until(lambda: status_json(procs)["datasets"]["contract"]["in_flight"] == 15, 30, "15 jobs in flight")

    queue = f"{namespace}.contract"
    for flags in (("-S", "json"), ()):  # operators run it without the serializer flag too
        info = rq_info(redis_url, *flags)
        line = next(line for line in info.splitlines() if line.startswith(queue))
        assert re.search(r"\b15 executing\b", line), info
        assert re.search(rf"genq\.{namespace}\.\S+ \(.*\): busy {re.escape(queue)}", info), info

    collector = procs.start("collect", "--out", out)
    wait_until(lambda: status_json(procs)["datasets"]["contract"]["done"] == 30, 120, "all 30 on disk")
    info = rq_info(redis_url, "-S", "json")
    line = next(line for line in info.splitlines() if line.startswith(queue))
    assert re.search(r"\b0 executing\b", line) and re.search(r"\b0 failed\b", line), info
    worker.terminate()
    collector.terminate()
    assert worker.wait(60) == 0, log_of(worker)
    assert collector.wait(60) == 0, log_of(collector)
    check_records(out, "contract", prompts, {"max_new_tokens": 2000}, **LONG)


def _state(conn, queue, job_id: str) -> dict:
    """Everything RQ keeps about one job and its executions, values that vary between two runs
    (times, execution ids) replaced by what they are."""
    from rq.job import Job

    def shape(key: str) -> dict:
        kind = conn.type(key).decode()
        ttl = conn.ttl(key)
        value: object
        if kind == "hash":
            value = {k.decode(): v.decode(errors="replace") for k, v in conn.hgetall(key).items()}
        elif kind == "zset":
            value = [m.decode() for m in conn.zrange(key, 0, -1)]
        else:
            value = kind
        return {"type": kind, "expires": ttl > 0, "value": value}

    from rq.executions import Execution

    from genq.worker import rq_batch

    job = Job.fetch(job_id, connection=conn, serializer="json")
    found = [
        *conn.scan_iter(Execution("*", job_id, conn).key),
        *conn.scan_iter(rq_batch.EXECUTIONS.format(job_id)),
    ]
    keys = sorted(k.decode() for k in found)
    return {
        "job": {k: v for k, v in shape(job.key)["value"].items() if k not in {"data", "description"}},
        "job_expires": shape(job.key)["expires"],
        "executions": [(k.replace(job_id, "JOB").split(":", 3)[:3], shape(k)["type"]) for k in keys],
        "started": [m.split(":")[0] for m in queue.started_job_registry.get_job_ids(cleanup=False)],
        "finished": queue.finished_job_registry.get_job_ids(cleanup=False),
        "failed": queue.failed_job_registry.get_job_ids(cleanup=False),
        "results": [r.type.name for r in job.results()],
        "status": job.get_status(),
    }


def _normalize(state: dict, job_id: str, worker: str) -> dict:
    times = ("created_at", "enqueued_at", "started_at", "ended_at", "last_heartbeat")
    state["job"] = {k: ("TIME" if k in times and v else v) for k, v in state["job"].items()}
    state["job"] = {k: ("WORKER" if v == worker else v) for k, v in state["job"].items()}
    state["started"] = ["JOB" if m == job_id else m for m in state["started"]]
    state["finished"] = ["JOB" if m == job_id else m for m in state["finished"]]
    state["failed"] = ["JOB" if m == job_id else m for m in state["failed"]]
    return state


def test_genq_takes_and_finishes_jobs_writing_what_rqs_own_worker_writes(conn, namespace):
    """worker/rq_batch.py writes RQ's keys itself, for many jobs per round trip. One job goes
    through RQ's own worker code (dequeue, Execution.create, prepare_for_execution,
    handle_job_success), one through genq's take script and batched finish: RQ must read the
    same state back after each step. Allowed difference: RQ's Result stream, which genq leaves out."""
    from rq import Queue, Worker
    from rq.executions import Execution
    from rq.results import Result
    from rq.utils import now

    from genq.clock import RedisClock, redis_time
    from genq.worker import rq_batch

    queue = Queue(f"{namespace}.contract", connection=conn, serializer="json")
    for name in ("theirs", "ours"):
        queue.enqueue_call(
            "genq.jobs.generate", kwargs={"id": name}, job_id=f"{namespace}-{name}", result_ttl=60
        )
    rq_worker = Worker([queue], connection=conn, serializer="json", name=f"{namespace}-rq")
    rq_worker.register_birth()

    # RQ's own worker, step by step.
    theirs = queue.dequeue_any([queue], None, connection=conn, serializer=queue.serializer)[0]
    with conn.pipeline() as pipe:
        execution = Execution.create(theirs, 60, pipeline=pipe, worker_name=rq_worker.name)
        theirs.prepare_for_execution(rq_worker.name, pipeline=pipe)
        pipe.execute()
    conn.lrem(queue.intermediate_queue_key, 1, theirs.id)
    started_theirs = _normalize(_state(conn, queue, theirs.id), theirs.id, rq_worker.name)

    # genq's take script.
    script = conn.register_script(rq_batch.TAKE)
    keys = (
        rq_worker.key,
        f"{namespace}:crashes",
        f"{namespace}:attempts",
        rq_batch.executions_index(rq_worker.name),
    )
    clock = RedisClock(conn)
    full, popped = rq_batch.take(
        script, [(queue, f"{namespace}:stream")], 1, rq_worker.name, keys, 100, 60, at=clock.now()
    )
    assert (full, [p.state for p in popped]) == ([], ["started"])
    ours = popped[0]
    assert ours.job.kwargs == {"id": "ours"} and ours.attempt == 1
    started_ours = _normalize(_state(conn, queue, ours.job_id), ours.job_id, rq_worker.name)
    registry = conn.zrange(queue.started_job_registry.key, 0, -1, withscores=True)
    scores = {member.decode().split(":")[0]: score for member, score in registry}
    assert set(scores) == {theirs.id, ours.job_id} and abs(scores[theirs.id] - scores[ours.job_id]) <= 2
    started_theirs["started"] = started_ours["started"] = ["JOB"]  # each sees the other in the registry too
    assert started_ours == started_theirs

    # A heartbeat: RQ's three (worker, execution, job), then genq's, which writes Redis's time.
    with conn.pipeline() as pipe:
        rq_worker.heartbeat(120, pipeline=pipe)
        execution.heartbeat(theirs.started_job_registry, 90, pipeline=pipe)
        theirs.heartbeat(now(), 90, pipeline=pipe)
        pipe.execute()
    with conn.pipeline() as pipe:
        index = rq_batch.executions_index(rq_worker.name)
        rq_batch.heartbeat(pipe, rq_worker.key, index, [(ours.job, ours.execution)], 90, clock.now())
        pipe.execute()
    beat_theirs = _normalize(_state(conn, queue, theirs.id), theirs.id, rq_worker.name)
    beat_ours = _normalize(_state(conn, queue, ours.job_id), ours.job_id, rq_worker.name)
    beat_theirs["started"] = beat_ours["started"] = ["JOB"]
    assert beat_ours == beat_theirs
    registry = conn.zrange(queue.started_job_registry.key, 0, -1, withscores=True)
    scores = {member.decode().split(":")[0]: score for member, score in registry}
    assert abs(scores[theirs.id] - scores[ours.job_id]) <= 2 and scores[ours.job_id] > redis_time(conn) + 80
    executions = {k: conn.zrange(rq_batch.EXECUTIONS.format(k), 0, -1, withscores=True) for k in scores}
    assert abs(executions[theirs.id][0][1] - executions[ours.job_id][0][1]) <= 2
    assert {k: conn.ttl(rq_batch.EXECUTIONS.format(k)) > 140 for k in scores} == {k: True for k in scores}

    # Finishing: RQ's handle_job_success, then genq's finish of its job.
    theirs.ended_at = now()
    theirs._result = {"tokens": 1}
    rq_worker.execution = execution
    rq3 = {"execution": execution} if rq_batch.INDEXED else {}
    rq_worker.handle_job_success(theirs, queue, theirs.started_job_registry, **rq3)
    with conn.pipeline() as pipe:
        index = rq_batch.executions_index(rq_worker.name)
        rq_batch.finish(pipe, rq_worker.key, index, [(ours.job, ours.execution)], clock.now())
        pipe.execute()
    done_theirs = _normalize(_state(conn, queue, theirs.id), theirs.id, rq_worker.name)
    done_ours = _normalize(_state(conn, queue, ours.job_id), ours.job_id, rq_worker.name)
    for state in (done_theirs, done_ours):
        state["finished"] = ["JOB"]
    assert (
        done_theirs.pop("results") == ["SUCCESSFUL"] and done_ours.pop("results") == []
    )  # the Result stream
    assert done_ours == done_theirs
    assert done_ours["status"] == "finished" and done_ours["job_expires"] and done_ours["started"] == []
    assert conn.exists(Result.get_key(theirs.id)) and not conn.exists(Result.get_key(ours.job_id))
    assert int(conn.hget(rq_worker.key, "successful_job_count")) == 2
    assert conn.hget(rq_worker.key, "current_job") is None


def _taken(conn, namespace: str, queue, worker_name: str, keys):
    """One job of ``queue`` started by genq's take script, as the worker holds it."""
    from rq import Worker

    from genq.clock import RedisClock
    from genq.schema import JobSpec
    from genq.worker import rq_batch
    from genq.worker.rq_worker import Taken

    script = conn.register_script(rq_batch.TAKE)
    take_keys = (
        Worker.redis_worker_namespace_prefix + worker_name,
        keys.crashes,
        keys.attempts,
        rq_batch.executions_index(worker_name),
    )
    _, popped = rq_batch.take(
        script,
        [(queue, keys.results("contract"))],
        1,
        worker_name,
        take_keys,
        100,
        60,
        at=RedisClock(conn).now(),
    )
    p = popped[0]
    return Taken(p.job, p.queue, p.execution, JobSpec.from_kwargs(p.job.kwargs), charged=p.attempt)


def _error(t) -> dict:
    from genq.schema import error_record

    spec = t.spec
    return error_record(
        id=spec.id,
        dataset=spec.dataset,
        row=spec.row,
        sample=spec.sample,
        source_id=None,
        error="server_timeout",
        message="Request running timeout reached.",
        status=503,
        attempts=5,
    )


def _spec(namespace: str, row: int) -> dict:
    return {
        "dataset": "contract", "row": row, "sample": 0, "id": f"contract-{row}",
        "sampling_params": {"max_new_tokens": 8}, "input_ids": [5, 6],
    }  # fmt: skip


def test_genq_fails_a_job_in_one_step_writing_what_rqs_own_worker_writes(conn, namespace):
    """A terminal failure is one script call (worker/rq_batch.py fail + APPLY) with its error's
    stream entry, not RQ's handle_job_failure after the entry: RQ must read the same failed state
    back as its own worker leaves, and the stream must hold the error."""
    from rq import Queue
    from rq.executions import Execution

    from genq.keys import Keys
    from genq.schema import KIND_ERROR
    from genq.worker import rq_batch
    from genq.worker.rq_worker import Bookkeeper, Finished

    keys = Keys(namespace)
    queue = Queue(f"{namespace}.contract", connection=conn, serializer="json")
    for row, name in ((0, "theirs"), (1, "ours")):
        queue.enqueue_call(
            "genq.jobs.generate", kwargs=_spec(namespace, row), job_id=f"{namespace}-{name}", result_ttl=60
        )
    books = Bookkeeper(conn, keys, 60, "http://sim")
    books.register_birth()

    theirs = queue.dequeue_any([queue], None, connection=conn, serializer=queue.serializer)[0]
    with conn.pipeline() as pipe:
        execution = Execution.create(theirs, 60, pipeline=pipe, worker_name=books.name)
        theirs.prepare_for_execution(books.name, pipeline=pipe)
        pipe.execute()
    conn.lrem(queue.intermediate_queue_key, 1, theirs.id)
    theirs.ended_at = books.clock.now()
    theirs.retries_left = 0  # a final verdict, as genq's always is (genq's jobs carry RQ retries)
    rq3 = {"execution": execution} if rq_batch.INDEXED else {}  # RQ 3 takes it; RQ 2 reads the one below
    books.execution = execution
    books.handle_job_failure(
        theirs, queue, theirs.started_job_registry, exc_string="server_timeout: x", **rq3
    )

    ours = _taken(conn, namespace, queue, books.name, keys)
    assert books.commit("token", [], [Finished(ours, KIND_ERROR, _error(ours))]) == []
    failed_theirs = _normalize(_state(conn, queue, theirs.id), theirs.id, books.name)
    failed_ours = _normalize(_state(conn, queue, ours.job.id), ours.job.id, books.name)
    for state in (failed_theirs, failed_ours):
        state["failed"] = ["JOB"]
        state["job"].pop("exc_info", None)  # the message differs
    assert failed_ours == failed_theirs
    assert failed_ours["status"] == "failed" and failed_ours["results"] == ["FAILED"]
    assert failed_ours["started"] == [] and failed_ours["executions"] == []
    entries = conn.xrange(keys.results("contract"))
    assert [(e[b"kind"], e[b"id"]) for _, e in entries] == [(KIND_ERROR, b"contract-1")]
    assert int(conn.hget(books.key, "failed_job_count")) == 2


def test_a_commit_sent_again_after_its_reply_was_lost_writes_nothing_twice(conn, namespace):
    """A group commit whose reply was lost is sent again whole, with its token: the second call
    charges no attempt, adds no stream entry, counts no job twice, and answers the first call's
    attempt numbers. One group: a record, an error, and a send charged."""
    from rq import Queue

    from genq.keys import Keys
    from genq.schema import KIND_ERROR, KIND_RECORD
    from genq.worker.rq_worker import Bookkeeper, Finished

    keys = Keys(namespace)
    queue = Queue(f"{namespace}.contract", connection=conn, serializer="json")
    for row in range(3):
        queue.enqueue_call(
            "genq.jobs.generate", kwargs=_spec(namespace, row), job_id=f"{namespace}-{row}", result_ttl=60
        )
    books = Bookkeeper(conn, keys, 60, "http://sim")
    books.register_birth()
    done, failed, charged = (_taken(conn, namespace, queue, books.name, keys) for _ in range(3))
    group = [Finished(done, KIND_RECORD, {"id": done.spec.id}), Finished(failed, KIND_ERROR, _error(failed))]

    first = books.commit("group-1", [charged.job.id], group)
    again = books.commit("group-1", [charged.job.id], group)
    assert first == again == [2]  # its first send charged at the take, this one second
    assert int(conn.hget(keys.attempts, charged.job.id)) == 2
    kinds = sorted(e[b"kind"] for _, e in conn.xrange(keys.results("contract")))
    assert kinds == [KIND_ERROR, KIND_RECORD]
    assert int(conn.hget(keys.in_stream, "contract")) == 2
    assert int(conn.hget(books.key, "failed_job_count")) == 1
    assert int(conn.hget(books.key, "successful_job_count")) == 1
    assert [r.type.name for r in failed.job.results()] == ["FAILED"]
    assert queue.failed_job_registry.get_job_ids() == [failed.job.id]
    assert queue.finished_job_registry.get_job_ids() == [done.job.id]
    # A new group (a new token) is applied as usual.
    assert books.commit("group-2", [charged.job.id], []) == [3]


def test_jobs_pushed_by_genq_read_back_as_rqs_enqueue_many_writes_them(conn, redis_url, namespace):
    """genq/rq_jobs.py writes RQ's job hashes itself. A short and a long job each, pushed by
    RQ's enqueue_many and by genq: RQ must read every attribute back alike, queue them in order,
    and `rq info` count them; genq's hashes only leave out fields RQ writes empty."""
    from rq import Queue, Retry
    from rq.job import Job

    from genq import rq_jobs
    from genq.schema import JOB_FUNC

    kwargs = {"short": {"id": "s", "input_ids": [1, 2]}, "long": {"id": "l", "input_ids": list(range(400))}}
    theirs = Queue(f"{namespace}.theirs", connection=conn, serializer="json")
    ours = Queue(f"{namespace}.ours", connection=conn, serializer="json")
    retry = Retry(max=rq_jobs.JOBS.retries, interval=rq_jobs.JOBS.retry_interval)
    jobs = [
        theirs.prepare_data(
            JOB_FUNC,
            kwargs=kw,
            job_id=f"{namespace}-theirs-{name}",
            description=name,
            timeout=rq_jobs.JOBS.timeout,
            result_ttl=rq_jobs.JOBS.result_ttl,
            retry=retry,
        )
        for name, kw in kwargs.items()
    ]
    with conn.pipeline() as pipe:
        theirs.enqueue_many(jobs, pipeline=pipe)
        pipe.execute()
    with conn.pipeline() as pipe:
        rq_jobs.push(pipe, ours, [(f"{namespace}-ours-{n}", kw, n) for n, kw in kwargs.items()], rq_jobs.JOBS)
        pipe.execute()

    for name in kwargs:
        a = Job.fetch(f"{namespace}-theirs-{name}", connection=conn, serializer="json")
        b = Job.fetch(f"{namespace}-ours-{name}", connection=conn, serializer="json")
        # What RQ would write back for each (its own view of the job), payload decoded.
        read = [{k: v for k, v in j.to_dict().items() if k != "data"} for j in (a, b)]
        for attr in ("origin", "enqueued_at", "created_at"):  # other queue; another moment
            assert read[0].pop(attr) and read[1].pop(attr)
        assert read[0] == read[1]
        assert (
            (b.func_name, b.args, b.kwargs) == (a.func_name, a.args, a.kwargs) == (JOB_FUNC, [], kwargs[name])
        )
        assert (
            b.get_status() == "queued"
            and b.retries_left == rq_jobs.JOBS.retries
            and b.timeout == rq_jobs.JOBS.timeout
        )
        theirs_fields = {k for k, v in conn.hgetall(a.key).items() if v != b""}
        assert set(conn.hgetall(b.key)) <= theirs_fields
    assert ours.get_job_ids() == [f"{namespace}-ours-{n}" for n in kwargs]
    assert ours.count == 2
    assert re.search(rf"{re.escape(ours.name)} \|\S* 2, 0 executing", rq_info(redis_url, "-Q", ours.name))


# -- every step, the whole state ------------------------------------------------------------------

TIME_FIELDS = {"created_at", "enqueued_at", "started_at", "ended_at", "last_heartbeat"}
# The worker hash's job counters and its current job (RQ 2; RQ 3 indexes executions instead).
WORKER_FIELDS = ("successful_job_count", "failed_job_count", "total_working_time", "current_job")
TOLERANCE_S = 2


class Near:
    """A time or TTL (seconds, relative to Redis's clock): equal to another within TOLERANCE_S."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Near) and abs(self.seconds - other.seconds) <= TOLERANCE_S

    def __repr__(self) -> str:
        return f"~{self.seconds:.0f}s"


def _seconds(value: str) -> float:
    """A time field as epoch seconds: RQ writes job times as strings, execution times as floats."""
    from rq.utils import utcparse

    try:
        return float(value)
    except ValueError:
        return utcparse(value).timestamp()


def _whole_state(conn, queue, job_id: str, worker, dataset: str) -> dict:
    """Every key RQ keeps about one job, its queue, its executions and its worker: type, TTL
    (absent, none, or about how long), and value, each name that differs between two runs (job,
    queue, worker, execution ids) replaced by what it is, times relative to Redis's clock."""
    from rq.executions import Execution

    from genq.clock import redis_time
    from genq.worker import rq_batch

    now = redis_time(conn)
    executions = rq_batch.EXECUTIONS.format(job_id)
    exec_ids = [m.decode() for m in conn.zrange(executions, 0, -1)]
    exec_keys = [k.decode() for k in conn.scan_iter(Execution("*", job_id, conn).key)]
    names = {job_id: "JOB", queue.name: "QUEUE", worker.name: "WORKER", **dict.fromkeys(exec_ids, "EXEC")}
    names.update({f"{dataset}-0": "RECORD", f'"{dataset}"': '"DATASET"'})  # the payload and description
    names.update({k.rsplit(":", 1)[1]: "EXEC" for k in exec_keys})

    def norm(text: str) -> str:
        for name, what in sorted(names.items(), key=lambda kv: -len(kv[0])):
            text = text.replace(name, what)
        return text

    def shape(key: str) -> tuple:
        kind, ttl = conn.type(key).decode(), conn.ttl(key)
        value: object = None
        if kind == "hash":
            raw = conn.hgetall(key)
            if b"data" in raw:  # RQ re-saves a whole job's payload compressed; genq's short one is not
                with contextlib.suppress(zlib.error):
                    raw[b"data"] = zlib.decompress(raw[b"data"])
            # Job.restore (rq/job.py) reads a missing field and an empty one alike; genq writes none.
            text = {k.decode(): v.decode(errors="replace") for k, v in raw.items() if v != b""}
            value = {f: Near(_seconds(v) - now) if f in TIME_FIELDS else norm(v) for f, v in text.items()}
        elif kind == "zset":
            value = {norm(m.decode()): Near(s - now) for m, s in conn.zrange(key, 0, -1, withscores=True)}
        elif kind == "list":
            value = [norm(m.decode()) for m in conn.lrange(key, 0, -1)]
        elif kind == "set":
            value = sorted(norm(m.decode()) for m in conn.smembers(key))
        return kind, Near(ttl) if ttl > 0 else ttl, value

    registries = {
        "queue": queue.key,
        "intermediate": queue.intermediate_queue_key,
        "started": queue.started_job_registry.key,
        "finished": queue.finished_job_registry.key,
        "failed": queue.failed_job_registry.key,
        "scheduled": queue.scheduled_job_registry.key,
        "executions": executions,
        "worker executions": rq_batch.executions_index(worker.name),
    }
    state = {"job": shape(queue.job_class.redis_job_namespace_prefix + job_id)}
    state.update({what: shape(key) for what, key in registries.items() if key})
    state["execution hashes"] = sorted(shape(k)[:2] + (sorted(shape(k)[2]),) for k in exec_keys)
    counters = {k.decode(): v.decode() for k, v in conn.hgetall(worker.key).items()}
    state["worker"] = {
        f: Near(float(counters[f])) if f == "total_working_time" else norm(counters[f])
        for f in WORKER_FIELDS
        if f in counters
    }
    return state


def _differences(theirs: dict, ours: dict) -> dict:
    """What differs between two states, field by field where a value is a hash: RQ's, genq's."""
    out = {}
    for key in theirs.keys() | ours.keys():
        a, b = theirs.get(key), ours.get(key)
        if a == b:
            continue
        if (
            isinstance(a, tuple)
            and isinstance(b, tuple)
            and isinstance(a[2], dict)
            and isinstance(b[2], dict)
        ):
            fields = {
                f: (a[2].get(f), b[2].get(f)) for f in a[2].keys() | b[2].keys() if a[2].get(f) != b[2].get(f)
            }
            out[key] = {"type, ttl": (a[:2], b[:2]), **fields}
        else:
            out[key] = (a, b)
    return out


@pytest.mark.parametrize("ending", ["finish", "fail", "abandon", "requeue"])
def test_each_step_leaves_the_whole_state_rqs_own_worker_leaves(conn, namespace, ending):
    """Two jobs written by genq's producer: one taken, heartbeated and ended by RQ's own worker
    code (dequeue_any, prepare_execution, prepare_job_execution, maintain_heartbeats, then
    handle_job_success, handle_job_failure, its abandoned-job cleanup, or cleanup_execution and a
    push to the front), one by genq's Bookkeeper (take, heartbeat_all, commit, fail, reap, requeue
    on a graceful stop). After every step the whole state RQ keeps must read the same: job hash,
    execution hashes, the job's executions, queue, intermediate list, registries with their scores,
    TTLs, the worker's counters and its execution index (worker/rq_batch.py,
    worker/rq_worker.py against rq/worker/base.py, rq/executions.py, rq/registry.py).

    Allowed differences: RQ's Result stream (genq keeps none), fields RQ writes empty."""
    from rq import Queue, Worker
    from rq.utils import now

    from genq import datasets, rq_jobs
    from genq.keys import Keys
    from genq.reaper import reap
    from genq.schema import KIND_ERROR, KIND_RECORD, JobSpec
    from genq.worker import rq_batch
    from genq.worker.rq_worker import Bookkeeper, Finished

    keys = Keys(namespace)
    datasets.register(conn, keys, datasets.DatasetSettings("ours", 1, {"max_new_tokens": 8}))
    theirs_q = Queue(keys.queue_name("theirs"), connection=conn, serializer="json")
    ours_q = Queue(keys.queue_name("ours"), connection=conn, serializer="json")
    for queue, dataset in ((theirs_q, "theirs"), (ours_q, "ours")):
        spec = JobSpec(dataset, 0, 0, f"{dataset}-0", {"max_new_tokens": 8}, input_ids=[1, 2, 3])
        with conn.pipeline() as pipe:
            rq_jobs.push(pipe, queue, [(keys.job_id(spec.id), spec.to_kwargs(), spec.id)], rq_jobs.JOBS)
            pipe.execute()
    theirs_id, ours_id = keys.job_id("theirs-0"), keys.job_id("ours-0")

    # RQ's heartbeat TTL is its job monitoring interval + 60 (BaseWorker.get_heartbeat_ttl).
    rq_worker = Worker(
        [theirs_q], connection=conn, serializer="json", name=f"{namespace}-rq", job_monitoring_interval=30
    )
    rq_worker.register_birth()
    ours = Bookkeeper(conn, keys, heartbeat_ttl=90, server="http://unused")
    ours.start({})

    def compare(step: str) -> None:
        a = _whole_state(conn, theirs_q, theirs_id, rq_worker, "theirs")
        b = _whole_state(conn, ours_q, ours_id, ours, "ours")
        assert b == a, f"{step}: {_differences(a, b)}"

    compare("queued")

    job, _ = theirs_q.dequeue_any([theirs_q], None, connection=conn, serializer=theirs_q.serializer)
    execution = rq_worker.prepare_execution(job)
    rq_worker.prepare_job_execution(job, remove_from_intermediate_queue=True)
    _, taken = ours.take(10, 1000)
    assert [t.job.id for t in taken] == [ours_id]
    compare("taken")

    if rq_batch.INDEXED:
        rq_worker.maintain_heartbeats(job, execution)
    else:
        rq_worker.maintain_heartbeats(job)
    ours.heartbeat_all(taken)
    compare("heartbeat")

    rq3 = {"execution": execution} if rq_batch.INDEXED else {}
    if ending == "finish":
        job.ended_at = now()
        job._result = {"tokens": 1}
        rq_worker.handle_job_success(job, theirs_q, theirs_q.started_job_registry, **rq3)
        ours.commit("finish", [], [Finished(taken[0], KIND_RECORD, {"id": "ours-0"})])
        compare("finished")
        assert job.get_status() == "finished"
    elif ending == "fail":
        job.ended_at = now()
        job.retries_left = 0  # genq's failures are final verdicts
        rq_worker.handle_job_failure(
            job, theirs_q, theirs_q.started_job_registry, exc_string="bad_request: no", **rq3
        )
        ours.commit("fail", [], [Finished(taken[0], KIND_ERROR, _error(taken[0]))])
        compare("failed")
        assert job.get_status() == "failed"
    elif ending == "requeue":
        # RQ has no requeue of a running job (a stopping RQ worker finishes it first): its own
        # worker's end of an execution (cleanup_execution) and its queue's front push, against
        # genq's graceful stop.
        with conn.pipeline() as pipe:
            rq_worker.cleanup_execution(job, pipe, **rq3)
            theirs_q._enqueue_job(job, pipeline=pipe, at_front=True)
            pipe.execute()
        ours.requeue(taken)
        compare("requeued")
        assert job.get_status() == "queued"
    else:
        # The heartbeat lapsed: both executions' deadlines are moved into the past.
        for queue in (theirs_q, ours_q):
            (member,) = conn.zrange(queue.started_job_registry.key, 0, -1)
            conn.zadd(queue.started_job_registry.key, {member: 1})
        # RQ's worker maintenance (rq/registry.py StartedJobRegistry.cleanup); genq's reaper.
        theirs_q.started_job_registry.cleanup()
        assert reap(conn, keys, 1)
        compare("abandoned")
        assert job.get_status() == "queued"
    ours.stop()


def test_a_job_genq_cannot_read_is_failed_through_rqs_own_code(conn, namespace):
    """A job in a genq queue that genq did not write (kwargs JobSpec does not take) is failed by
    RQ's handle_job_failure with its execution (RQ 3) or the worker's (RQ 2): in the failed
    registry, its execution gone from the started registry, the job's executions and the worker."""
    from rq import Queue
    from rq.executions import Execution

    from genq import datasets
    from genq.keys import Keys
    from genq.worker import rq_batch
    from genq.worker.rq_worker import Bookkeeper

    keys = Keys(namespace)
    datasets.register(conn, keys, datasets.DatasetSettings("odd", 1, {"max_new_tokens": 8}))
    queue = Queue(keys.queue_name("odd"), connection=conn, serializer="json")
    job = queue.enqueue_call("genq.jobs.generate", kwargs={"not_a_field": 1}, job_id=keys.job_id("odd-0"))
    ours = Bookkeeper(conn, keys, heartbeat_ttl=90, server="http://unused")
    ours.start({})
    assert ours.take(10, 1000)[1] == []
    assert job.get_status() == "failed" and job.id in queue.failed_job_registry.get_job_ids()
    assert "unreadable genq job payload" in job.latest_result().exc_string
    assert conn.zcard(queue.started_job_registry.key) == 0
    assert conn.zcard(rq_batch.EXECUTIONS.format(job.id)) == 0
    assert not list(conn.scan_iter(Execution("*", job.id, conn).key))
    if rq_batch.INDEXED:
        assert conn.scard(rq_batch.executions_index(ours.name)) == 0
    assert int(conn.hget(ours.key, "failed_job_count")) == 1
    ours.stop()


def _rq_env(version: str) -> dict[str, str]:
    """The environment that runs RQ ``version`` (both majors need only redis, click and croniter)."""
    return pinned_env("rq", version)


def _run_here(env: dict[str, str], tmp_path: Path, select: str) -> None:
    """This module's fast tests that ``select`` (pytest -k) picks, run in ``env``."""
    run_tests_in(env, tmp_path, __file__, select)


def test_the_contract_holds_on_the_other_rq_major(tmp_path):
    """genq supports RQ 2.12 and RQ 3 (docs/design.md, decision 1): this module's fast tests run
    again against the other major."""
    import rq

    _run_here(_rq_env(OTHER_RQ[rq.VERSION.split(".")[0]]), tmp_path, "not rq_major and not key_prefix")


def test_genq_writes_under_rqs_key_prefix(tmp_path):
    """RQ 3 names its keys after RQ_KEY_PREFIX (rq/defaults.py); genq takes every RQ key name from
    RQ, so under another prefix the whole-state contract and RQ's reading of genq's jobs hold."""
    import rq

    version = rq.VERSION if rq.VERSION.startswith("3.") else OTHER_RQ["2"]
    env = {**_rq_env(version), "RQ_KEY_PREFIX": "zq"}
    _run_here(env, tmp_path, "not rq_info_lists and not rq_major and not key_prefix")
