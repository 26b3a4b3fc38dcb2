"""RQ's job state, written by genq for many jobs per round trip, key for key as RQ's worker writes it.

RQ's worker takes and finishes one job at a time in several round trips each (rq 2.12 and 3;
rq/worker/base.py, rq/executions.py, rq/job.py): ``Queue.dequeue_any`` + ``Execution.create`` +
``Job.prepare_for_execution`` to start, ``BaseWorker.handle_job_success`` with its WATCH,
``Job._handle_success``, ``Result.create`` and ``cleanup_execution`` to finish. A genq worker keeps
a hundred jobs in flight, so it writes the same keys itself: one script call takes a batch of jobs,
one script call (:data:`APPLY`) ends a batch, records and errors alike. What `rq info`,
rq-dashboard and RQ's abandoned-job cleanup read is what RQ would have written
(tests/test_rq_contract.py compares the two, step by step). Left out, as genq jobs never use
them: dependents (enqueue sets no ``depends_on``), repeats, rate limits (RQ 3), RQ 3's PERSIST of
the job hash at start (a job genq queued has no TTL), and the ``Result`` stream (the record is the
result; RQ keeps ``{"tokens": n}`` nowhere).
"""

from __future__ import annotations

import calendar
import uuid
import zlib
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from redis.client import Pipeline
from redis.commands.core import Script
from rq import Queue, executions
from rq.defaults import DEFAULT_RESULT_TTL
from rq.executions import Execution, ExecutionRegistry
from rq.job import Job, JobStatus
from rq.utils import utcformat
from rq.worker import BaseWorker

# RQ's keys as RQ names them (RQ 3 reads its prefix from RQ_KEY_PREFIX, rq/defaults.py): a job's
# hash (rq/job.py Job.key), an execution's hash (rq/executions.py Execution.key), a job's
# executions (rq/executions.py ExecutionRegistry.key_template).
EXECUTIONS = ExecutionRegistry.key_template
PREFIXES = (
    Job.redis_job_namespace_prefix,
    Execution("", "", None).key.removesuffix(":"),  # type: ignore[arg-type]
    EXECUTIONS.format(""),
)
# RQ 3 indexes a worker's executions in a set (rq/executions.py Execution.create, the worker's
# ``executions_key``), names the job in the execution hash, refreshes only executions still
# registered, and keeps no ``current_job`` in the worker hash; RQ 2 names the worker's one current
# job there (rq/worker/base.py ``set_current_job_id``).
INDEXED = hasattr(executions, "WORKER_EXECUTIONS_KEY_TEMPLATE")


def executions_index(worker: str) -> str:
    """The key of ``worker``'s execution index (RQ 3's ``BaseWorker.executions_key``); "" on RQ 2."""
    return executions.WORKER_EXECUTIONS_KEY_TEMPLATE.format(worker) if INDEXED else ""


# KEYS: worker hash, crashes hash, attempts hash, the worker's execution index (RQ 3), then (queue,
# started registry, the dataset's result stream) triples in the order to take from. ARGV: stream
# limit, how many, worker name, the time (RQ's string, epoch float, epoch int), heartbeat TTL, RQ's
# key prefixes (job, execution, executions; from RQ, see PREFIXES), whether RQ indexes executions
# (INDEXED), then one execution id per job.
# Nothing is taken from a queue whose dataset's stream holds the limit (its collector is behind).
# Takes from the left of each queue as RQ's dequeue does, many ids per LPOP (Redis >= 6.2), one
# read of each job's hash, and one ZADD per queue: in Lua every redis.call costs as much as a
# command from a client, so the script makes as few as it can. A job whose hash is gone or that has
# finished already is popped and reported, not started. Every started job gets what
# Execution.create and Job.prepare_for_execution write (rq/executions.py, rq/job.py), and its
# first attempt charged unless it is a crash suspect (worker/probation.py charges it at its turn).
# Returns {{queue index whose stream is full...}, {queue index, id, state, execution, crashes,
# attempt, {data, result_ttl, meta}}...}: what the worker needs of the job (see started_job).
TAKE = """
local worker_key, crashes_hash, attempts_hash, worker_execs = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local FIRST_QUEUE = 5  -- KEYS from here, three a queue: the queue, its started registry, its stream
local limit, want, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[7])
local worker, stamp, ts, score = ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6])
local job_prefix, exec_prefix, execs_prefix, indexed = ARGV[8], ARGV[9], ARGV[10], ARGV[11] == '1'
local full = {}
local taken = {full}
local n, last = 0, nil
for q = FIRST_QUEUE, #KEYS, 3 do
  local queue, started_registry, stream = KEYS[q], KEYS[q + 1], KEYS[q + 2]
  if n >= want then break end
  if redis.call('XLEN', stream) >= limit then
    table.insert(full, q)
  else
    local started = {}
    while n < want do
      local ids = redis.call('LPOP', queue, want - n)
      if not ids then break end
      local crashes = redis.call('HMGET', crashes_hash, unpack(ids))
      for i, id in ipairs(ids) do
        local job = job_prefix .. id
        local f = redis.call('HMGET', job, 'status', 'data', 'result_ttl', 'meta')
        if not f[1] then
          table.insert(taken, {q, id, 'missing'})
        elseif f[1] == 'finished' or f[1] == 'failed' then
          table.insert(taken, {q, id, f[1]})
        else
          n = n + 1
          local exec = ARGV[11 + n]
          local ekey = exec_prefix .. id .. ':' .. exec
          redis.call('HSET', ekey, 'id', exec, 'created_at', ts, 'last_heartbeat', ts, 'worker_name', worker)
          if indexed then
            redis.call('HSET', ekey, 'job_id', id)
            redis.call('SADD', worker_execs, id .. ':' .. exec)
          end
          redis.call('EXPIRE', ekey, ttl)
          redis.call('ZADD', execs_prefix .. id, score + ttl + 60, exec)
          redis.call('EXPIRE', execs_prefix .. id, ttl + 60)
          table.insert(started, score + ttl)
          table.insert(started, id .. ':' .. exec)
          redis.call('HSET', job, 'last_heartbeat', stamp, 'status', 'started', 'started_at', stamp,
            'worker_name', worker)
          local crashed = crashes[i] or '0'
          local attempt = 0
          if crashed == '0' then attempt = redis.call('HINCRBY', attempts_hash, id, 1) end
          table.insert(taken, {q, id, 'started', exec, crashed, attempt, {f[2], f[3], f[4]}})
          last = id
        end
      end
    end
    if #started > 0 then redis.call('ZADD', started_registry, unpack(started)) end
  end
end
if last then
  redis.call('HSET', worker_key, 'state', 'busy')
  if indexed then
    redis.call('EXPIRE', worker_execs, ttl)  -- as the worker's heartbeat in prepare_job_execution (RQ 3)
  else
    redis.call('HSET', worker_key, 'current_job', last)
  end
end
return taken
"""


@dataclass
class Popped:
    """One id the take script popped: started (with its execution), or skipped and why."""

    queue: Queue
    job_id: str
    state: str  # "started", or why it was not: "missing", "finished", "failed"
    job: Job | None = None
    execution: Execution | None = None
    crashes: int = 0
    attempt: int = 0  # its first attempt, charged by the script (0: not charged, a suspect)


def take(
    script: Script,
    queues: list[tuple[Queue, str]],
    want: int,
    worker: str,
    keys: tuple[str, str, str, str],
    stream_limit: int,
    ttl: int,
    at: datetime,
) -> tuple[list[Queue], list[Popped]]:
    """Up to ``want`` jobs from ``queues`` (each with its dataset's result stream) in that order,
    started for ``worker`` at ``at`` (Redis's clock, genq/clock.py), in one round trip; with the
    queues skipped because their stream holds ``stream_limit`` entries. ``keys``: the worker hash,
    genq's crashes and attempts hashes, and the worker's execution index (:func:`executions_index`);
    ``script``: :data:`TAKE` registered on the connection."""
    epoch = calendar.timegm(at.utctimetuple())
    queue_keys = [key for q, stream in queues for key in (q.key, q.started_job_registry.key, stream)]
    argv = [stream_limit, want, worker, utcformat(at), at.timestamp(), epoch, ttl, *PREFIXES, int(INDEXED)]
    execution_ids = [uuid.uuid4().hex for _ in range(want)]
    full, *popped = script(keys=[*keys, *queue_keys], args=[*argv, *execution_ids])
    found = []
    for q, raw_id, state, *started in popped:
        queue, job_id = queues[(q - 5) // 3][0], raw_id.decode()
        if state != b"started":
            found.append(Popped(queue, job_id, state.decode()))
            continue
        execution_id, crashes, attempt, fields = started
        job = started_job(job_id, queue, worker, at, *fields)
        execution = Execution(execution_id.decode(), job_id, queue.connection, worker_name=worker)
        execution.created_at = execution.last_heartbeat = at
        found.append(Popped(queue, job_id, "started", job, execution, int(crashes), int(attempt)))
    return [queues[(q - 5) // 3][0] for q in full], found


def started_job(
    job_id: str,
    queue: Queue,
    worker: str,
    at: datetime,
    data: bytes,
    result_ttl: bytes | None,
    meta: bytes | None,
) -> Job:
    """The job as the take script left it, built from the three fields genq reads (Job.restore of
    the whole hash parses five dates a job). Enough to run, heartbeat and finish it; before RQ's
    own code saves it (a failure, a requeue) it is read whole with ``Job.refresh``."""
    job = queue.job_class(job_id, connection=queue.connection, serializer=queue.serializer)
    try:
        job.data = zlib.decompress(data)
    except zlib.error:
        job.data = data
    job.origin, job.worker_name, job._status = queue.name, worker, JobStatus.STARTED
    job.started_at = job.last_heartbeat = at
    job.result_ttl = int(result_ttl) if result_ttl else None
    try:
        job.meta = job.serializer.loads(meta) if meta else {}
    except Exception:  # noqa: BLE001 - as Job.restore: pickled meta from a client without the JSON serializer
        job.meta = {"unserialized": meta}
    return job


def heartbeat(
    pipe: Pipeline, worker_key: str, index: str, jobs: list[tuple[Job, Execution]], ttl: int, at: datetime
) -> None:
    """What RQ's heartbeats write (``BaseWorker.heartbeat`` for the worker, ``Execution.heartbeat``
    and ``Job.heartbeat`` for each job: rq/worker/base.py, rq/executions.py, rq/job.py), into
    ``pipe``, but at ``at``: Redis's clock, not this host's, so the started registry's deadlines
    mean the same to the reaper on every host (RQ's own code reads ``datetime.now()`` here).
    ``index``: the worker's execution index (:func:`executions_index`)."""
    stamp, epoch = utcformat(at), calendar.timegm(at.utctimetuple())
    pipe.hset(worker_key, "last_heartbeat", stamp)
    pipe.expire(worker_key, ttl + 60)
    if index:  # RQ 3's maintain_heartbeats: the heartbeat TTL (rq/worker/base.py)
        pipe.expire(index, ttl)
    for job, execution in jobs:
        execution.last_heartbeat = job.last_heartbeat = at
        pipe.hset(execution.key, "last_heartbeat", at.timestamp())
        pipe.expire(execution.key, ttl)
        pipe.zadd(job.started_job_registry.key, {execution.composite_key: epoch + ttl}, xx=True)
        pipe.zadd(EXECUTIONS.format(job.id), {execution.id: epoch + ttl + 60}, xx=INDEXED)
        pipe.expire(EXECUTIONS.format(job.id), ttl + 60)
        pipe.hset(job.key, "last_heartbeat", stamp)


def finish(
    pipe: Pipeline, worker_key: str, index: str, jobs: list[tuple[Job, Execution]], ended_at: datetime
) -> None:
    """What ``handle_job_success`` writes for each job (rq/worker/base.py), into ``pipe`` (run as
    one step by :func:`apply`): the job finished and kept for its result_ttl in the finished
    registry, its execution gone from the started registry and the worker's execution index
    (``index``, RQ 3), and the worker's counters."""
    by_queue: dict[str, list[tuple[Job, Execution]]] = defaultdict(list)
    for job, execution in jobs:
        by_queue[job.origin].append((job, execution))
    stamp, epoch = utcformat(ended_at), calendar.timegm(ended_at.utctimetuple())
    for started in by_queue.values():
        first = started[0][0]
        pipe.zrem(first.started_job_registry.key, *(e.composite_key for _, e in started))
        kept = {job.id: epoch + job.get_result_ttl(DEFAULT_RESULT_TTL) for job, _ in started}
        pipe.zadd(first.finished_job_registry.key, kept)
    for job, execution in jobs:
        pipe.hset(job.key, mapping={"status": JobStatus.FINISHED, "ended_at": stamp})
        pipe.expire(job.key, job.get_result_ttl(DEFAULT_RESULT_TTL))
        pipe.delete(execution.key)
        pipe.zrem(EXECUTIONS.format(job.id), execution.id)
    if index and jobs:
        pipe.srem(index, *(e.composite_key for _, e in jobs))
    working = sum(((ended_at - job.started_at).total_seconds() for job, _ in jobs if job.started_at), 0.0)
    pipe.hincrby(worker_key, "successful_job_count", len(jobs))
    pipe.hincrbyfloat(worker_key, "total_working_time", working)
    if not INDEXED:
        pipe.hdel(worker_key, "current_job")


def fail(pipe: Pipeline, worker: BaseWorker, job: Job, execution: Execution, exc_string: str) -> None:
    """What ``handle_job_failure`` writes for a job that is not retried (rq/worker/base.py), by
    RQ's own calls, into ``pipe``: RQ's method executes its own pipeline twice, so a crash between
    those and the error's stream entry would leave the job half ended. ``job`` is read whole
    (``Job.refresh``: RQ saves the whole hash), with ``retries_left`` 0 and ``ended_at`` set."""
    job.set_status(JobStatus.FAILED, pipeline=pipe)
    if INDEXED:  # RQ 3's cleanup_execution (rq/executions.py): the execution and its index entry
        executions.cleanup_execution(worker, job, pipe, execution)
    else:  # RQ 2's (rq/worker/base.py), for this job's execution instead of the worker's one
        worker.set_current_job_id(None, pipeline=pipe)
        execution.delete(job=job, pipeline=pipe)
    job._handle_failure(
        exc_string,
        pipeline=pipe,
        worker_name=worker.name,
        execution_id=execution.id,
        execution_started_at=execution.created_at,
        execution_ended_at=job.ended_at,
    )
    worker.increment_failed_job_count(pipe)
    if job.started_at and job.ended_at:
        worker.increment_total_working_time(job.ended_at - job.started_at, pipe)


# KEYS: the worker's last-commit hash (keys.committed), the attempts hash. ARGV: the commit's
# token, the hash's TTL, how many sends are charged, their job ids, then each command as its number
# of words and the words. One script, so a group of endings is written whole or not at all (a MULTI
# would be too), and applied once: a commit sent again after its reply was lost finds its token and
# answers what it charged the first time, without writing anything again. One token suffices: a
# worker sends its next group only once the last one has landed (worker/commits.py). A command has
# at most 2 × --max-concurrency + 2 words, under Lua's unpack limit (8,000).
APPLY = """
local last_commit, attempts_hash = KEYS[1], KEYS[2]
local token, ttl, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
local FIRST_CHARGE = 4  -- ARGV from here: the n jobs charged, then the commands
if redis.call('HGET', last_commit, 'token') == token then
  return {1, redis.call('HGET', last_commit, 'attempts')}
end
local attempts = {}
for i = FIRST_CHARGE, FIRST_CHARGE + n - 1 do
  table.insert(attempts, redis.call('HINCRBY', attempts_hash, ARGV[i], 1))
end
local i = FIRST_CHARGE + n
while i <= #ARGV do
  local words = tonumber(ARGV[i])
  redis.call(unpack(ARGV, i + 1, i + words))
  i = i + 1 + words
end
local charged = table.concat(attempts, ',')
redis.call('HSET', last_commit, 'token', token, 'attempts', charged)
redis.call('EXPIRE', last_commit, ttl)
return {0, charged}
"""
COMMITTED_TTL_S = 86_400  # past any Redis outage a worker rides out while resending its commit


def apply(script: Script, keys: tuple[str, str], token: str, charges: list[str], pipe: Pipeline) -> list[int]:
    """Charge a send to each job of ``charges`` and run the commands queued in ``pipe`` (which is
    never executed), in one call of :data:`APPLY` (registered on the connection), once per
    ``token``. ``keys``: the worker's last-commit hash and the attempts hash. Returns the charged
    jobs' attempt numbers (the first call's, when the commit was applied already)."""
    words: list = []
    for args, _ in pipe.command_stack:
        words += [len(args), *args]
    pipe.reset()
    _, charged = script(keys=list(keys), args=[token, COMMITTED_TTL_S, len(charges), *charges, *words])
    return [int(n) for n in charged.split(b",")] if charged else []
