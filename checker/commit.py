"""A verdict's commit: one script call moves an ending from the unchecked stream to the results
stream with its verdict and, under ``--accept K``, draws the prompt's next sample in the same step.

Why one script: the count of a prompt's accepted samples, the decision to draw another, the new
job and the acknowledgement must land together, or a crash between them would draw twice (two
checkers) or never (a lost draw), or move an ending twice. The script is idempotent: the job's bit
in ``ds:<d>:checked`` is set in it, and an ending whose bit is set already (a checker that died
after the commit, before it knew; a reply lost) is only acknowledged.

Exactly K: a prompt starts with K samples drawn, and each one not accepted is replaced by one new
draw while fewer than K are accepted and fewer than M were drawn; so accepted + still to judge
never exceed K, and an accepted sample beyond K (which this order never makes) would be filed as
``surplus``, not accepted. The new job's id and payload are built in Python from the draw count
read just before (its sample number and seed follow from it); the script applies them only if the
count is still that one, else answers ``stale`` and the caller builds them again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis
from rq import Queue

from genq import rq_jobs
from genq.datasets import DatasetSettings
from genq.entries import ENTRY_DATA, ENTRY_ID, ENTRY_KIND, ENTRY_LOGPROBS, ENTRY_SPEC, ENTRY_VERDICT, Entry
from genq.keys import Keys
from genq.queues import rq_queue
from genq.schema import JobSpec, bit_index, dumps, record_id

# KEYS and ARGV are read into named locals first, in the order apply() passes them.
VERDICT = f"""
local unchecked, results, checked, draws = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local in_check, in_stream, check_tries, enqueued = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local queue, queues, new_job_key, verdicts = KEYS[9], KEYS[10], KEYS[11], KEYS[12]
local check_failed = KEYS[13]
local group, entry_id, dataset, index, row = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local accept, most, status = ARGV[6], ARGV[7], ARGV[8]  -- accept '': no redraws
local verdict_json, kind, record_id, data = ARGV[9], ARGV[10], ARGV[11], ARGV[12]
local logprobs, expected_extra = ARGV[13], ARGV[14]  -- logprobs '': none
local new_job_id, new_index, seconds = ARGV[15], ARGV[16], ARGV[17]  -- new_job_id '': no draw
local spec = ARGV[18]  -- the job's payload as the ending carried it ('': none)
local NEW_JOB_FIELDS = 19  -- ARGV from here on: the new job's hash as field, value pairs

local function acknowledge()
  redis.call('XACK', unchecked, group, entry_id)
  redis.call('XDEL', unchecked, entry_id)
  redis.call('HDEL', check_tries, entry_id)
end
if redis.call('GETBIT', checked, index) == 1 then
  acknowledge()
  return {{'again', 0}}
end
local drawn = 0
if accept ~= '' then
  local k, m = tonumber(accept), tonumber(most)
  local accepted = tonumber(redis.call('HGET', draws, 'a' .. row) or '0')
  local extra = tonumber(redis.call('HGET', draws, 'd' .. row) or '0')
  if status == 'accepted' then
    if accepted >= k then
      status = 'surplus'
    else
      redis.call('HINCRBY', draws, 'a' .. row, 1)
    end
  elseif status ~= 'check_failed' and accepted < k and k + extra < m then  -- a failed check is no rejection
    if tonumber(expected_extra) ~= extra then
      return {{'stale', extra}}
    end
    if new_job_id ~= '' then
      redis.call('HINCRBY', draws, 'd' .. row, 1)
      local job = {{}}
      for i = NEW_JOB_FIELDS, #ARGV do job[#job + 1] = ARGV[i] end
      redis.call('HSET', new_job_key, unpack(job))
      redis.call('SADD', queues, queue)
      redis.call('RPUSH', queue, new_job_id)
      redis.call('SETBIT', enqueued, new_index, 1)
      drawn = 1
    end
  end
end
redis.call('SETBIT', checked, index, 1)
local verdict = cjson.decode(verdict_json)
verdict['status'] = status
local entry = {{'{ENTRY_KIND}', kind, '{ENTRY_ID}', record_id, '{ENTRY_DATA}', data,
               '{ENTRY_VERDICT}', cjson.encode(verdict)}}
if logprobs ~= '' then
  entry[#entry + 1] = '{ENTRY_LOGPROBS}'
  entry[#entry + 1] = logprobs
end
redis.call('XADD', results, '*', unpack(entry))
if status == 'check_failed' then  -- kept as it came, for genq failed and genq retry --check-failed
  local kept = {{'{ENTRY_KIND}', kind, '{ENTRY_ID}', record_id, '{ENTRY_DATA}', data,
                '{ENTRY_VERDICT}', cjson.encode(verdict)}}
  if logprobs ~= '' then
    kept[#kept + 1] = '{ENTRY_LOGPROBS}'
    kept[#kept + 1] = logprobs
  end
  if spec ~= '' then
    kept[#kept + 1] = '{ENTRY_SPEC}'
    kept[#kept + 1] = spec
  end
  redis.call('XADD', check_failed, '*', unpack(kept))
end
redis.call('HINCRBY', verdicts, status, 1)
if type(verdict['checker']) == 'string' then
  redis.call('HINCRBY', verdicts, 'by:' .. verdict['checker'], 1)
end
redis.call('HINCRBYFLOAT', verdicts, 'seconds', seconds)
redis.call('HINCRBY', in_stream, dataset, 1)
redis.call('HINCRBY', in_check, dataset, -1)
acknowledge()
return {{status, drawn}}
"""
STALE_TRIES = 10  # a prompt's draw count changed under this many builds in a row: a bug, said so


@dataclass(frozen=True)
class Applied:
    """What the commit did: the status filed (``again``: the verdict was in already) and whether it
    drew the prompt's next sample."""

    status: str
    drew: bool


class VerdictCommit:
    """Applies verdicts of one namespace's checked datasets."""

    def __init__(self, conn: redis.Redis, keys: Keys) -> None:
        self.conn, self.keys = conn, keys
        self._script = conn.register_script(VERDICT)
        self._queues: dict[str, Queue] = {}

    def apply(
        self,
        settings: DatasetSettings,
        entry_id: bytes,
        entry: Entry,
        spec: JobSpec | None,
        status: str,
        verdict: dict[str, Any],
        seconds: float = 0.0,
        spec_raw: bytes | None = None,
    ) -> Applied:
        """File ``entry`` with ``verdict`` (``status``: accepted, rejected, check_failed, unjudged);
        ``spec`` is the job's payload, from which the next sample is drawn (None: no draw);
        ``seconds``: the checker's time on it, summed per dataset for the views; ``spec_raw``: the
        payload as the ending carried it, kept with a check_failed ending to judge it again."""
        name, row = settings.name, entry.data["row"]
        accept = settings.check.get("accept")
        queue = self._queue(name)
        k = self.keys
        keys = [
            k.unchecked(name), k.results(name), k.checked(name), k.draws(name), k.in_check, k.in_stream,
            k.check_tries(name), k.enqueued(name), queue.key, queue.redis_queues_keys,
        ]  # fmt: skip
        head = [
            k.checkers_group, entry_id, name, entry.index, row, accept or "", settings.samples, status,
            dumps(verdict), entry.kind, entry.record_id, dumps(entry.data), entry.logprobs or b"",
        ]  # fmt: skip
        for _ in range(STALE_TRIES):
            extra = int(self.conn.hget(self.keys.draws(name), f"d{row}") or 0)
            draw = self._draw(settings, spec, queue, extra) if accept and spec is not None else None
            job_key = draw[0] if draw else self.keys.draws(name)  # a key the script leaves alone
            tail = [
                extra,
                *(draw[1:3] if draw else ("", "")),
                seconds,
                spec_raw or b"",
                *(draw[3] if draw else ()),
            ]
            found = self._script(
                keys=[*keys, job_key, k.verdicts(name), k.check_failed(name)], args=[*head, *tail]
            )
            status_now, drew = found[0].decode(), bool(found[1])
            if status_now != "stale":
                return Applied(status_now, drew)
        raise RuntimeError(f"{name} row {row}: its draw count kept changing ({STALE_TRIES} builds)")

    def _queue(self, name: str) -> Queue:
        if name not in self._queues:
            self._queues[name] = rq_queue(self.conn, self.keys, name)
        return self._queues[name]

    def _draw(
        self, settings: DatasetSettings, spec: JobSpec, queue: Queue, extra: int
    ) -> tuple[str, str, int, list[Any]] | None:
        """(job hash key, job id, its index, its hash as a flat list) of the prompt's next sample,
        the (K + extra)-th; None when M are drawn. Its seed follows the sample, as enqueue's do."""
        sample = (settings.check.get("accept") or settings.samples) + extra
        if sample >= settings.samples:
            return None
        params = dict(spec.sampling_params)
        if "sampling_seed" in params:
            params["sampling_seed"] = params["sampling_seed"] - spec.sample + sample
        rid = record_id(settings.name, spec.row, sample, settings.samples)
        kwargs = {**spec.to_kwargs(), "sample": sample, "id": rid, "sampling_params": params}
        job_id = self.keys.job_id(rid)
        fields = rq_jobs.job_fields(
            rq_jobs.shared_fields(queue, rq_jobs.JOBS),
            kwargs,
            f"{settings.name} row {spec.row} sample {sample}",
        )
        flat = [x for pair in fields.items() for x in pair]
        return rq_jobs.job_key(queue, job_id), job_id, bit_index(spec.row, sample, settings.samples), flat
