"""Redis key names: every key genq owns, in one place, under ``genq:<namespace>:``.

Like RQ's own registries these are plain Redis structures, readable with redis-cli:

- ``datasets``               hash   dataset name -> its fixed settings (JSON)
- ``results:<name>``         stream the dataset's records and errors on their way to disk (one stream per
                                    dataset, so each can drain through its own collector)
- ``in_stream``              hash   dataset -> entries in its stream (moves with the stream, in one MULTI)
- ``unchecked:<name>``       stream a checked dataset's endings on their way to ``genq check`` (group
                                    ``checkers``), which moves each to ``results:<name>`` with its verdict
- ``in_check``               hash   dataset -> entries in its unchecked stream
- ``ds:<name>:checked``      bitmap jobs whose verdict is in the results stream (a verdict applied twice
                                    is dropped: the check commit is idempotent)
- ``ds:<name>:draws``        hash   ``a<row>``: samples of the row accepted, ``d<row>``: samples drawn
                                    beyond the first K (``enqueue --accept K``; absent: none yet)
- ``ds:<name>:verdicts``     hash   status (accepted, rejected, surplus, check_failed, unjudged) -> endings
                                    the check stage filed so
- ``ds:<name>:check_tries``  hash   unchecked entry id -> times a checker took it up (bounded)
- ``ds:<name>:check_failed`` stream the endings filed ``check_failed``, as they came to the check stage
                                    (kind, id, data, lp, spec) with their verdict: `genq failed` lists
                                    them, `genq retry --check-failed` sends them to be judged again
- ``dead:<name>``            stream entries of its stream that were not a worker's (genq/entries.py): their
                                    fields (cut), why, when; ``quarantined`` hash: dataset -> how many ever
- ``in_source``              hash   dataset -> jobs not enqueued yet, still in its files (``enqueue
                                    --max-queued``; gone once the enqueue has read every row)
- ``enqueuing:<name>``       string the lease of the one enqueue of the dataset running (``host:pid:token``;
                                    TTL 10 s, renewed every 2 s; each push is fenced by it: producer/lease.py)
- ``enqueuing:<name>:epoch`` string how many times the dataset's enqueue lease was taken: a lease that
                                    lapsed (Redis refusing writes) is taken back only by its holder
- ``ds:<name>:enqueued``     bitmap one bit per job ever enqueued (index = row * samples + sample)
- ``ds:<name>:done``         bitmap jobs whose record is on disk (set only after fsync)
- ``ds:<name>:failed``       bitmap jobs whose error is on disk
- ``ds:<name>:extending``    bitmap records re-opened by ``genq retry --truncated`` whose longer record is not
                                    on disk yet: the collector appends that one despite the done bit, and
                                    clears this bit in the commit that marks it (the supersede rule)
- ``ds:<name>:sources``      hash   source file's position among the dataset's files -> how many of its rows
                                    were enqueued and their running blake2b (JSON ``file``, ``rows``,
                                    ``blake2b``): a later enqueue refuses another file under its name
- ``ds:<name>:rejected``     bitmap jobs whose row enqueue refused (bad input, too long): `genq verify`
                                    tells them from rows never enqueued
- ``ds:<name>:servers``      hash   server URL -> what a worker's probe read of it as it took the dataset's
                                    jobs (JSON: backend, version, model, context length, when): the
                                    dataset's provenance; two models answering one dataset are warned of
- ``ds:<name>:provenance``   hash   the last enqueue's command line (secrets redacted), host, time, and
                                    the rows it refused by reason (JSON)
- ``ds:<name>:tokens``       hash   records, prompt_tokens, completion_tokens of the records on disk (set
                                    in the MULTI that marks them done), cut (records the server
                                    capped below the max_new_tokens asked: status says ``capped``),
                                    cached_tokens, cached_records, length, continued, live_tokens,
                                    first_at, last_at
- ``ds:<name>:rate:<n>``     string completion tokens written to disk in the n-th 10 s bucket (expires in 1 h)
- ``collector:offsets``      hash   file -> byte offset up to which its ids are marked in the bitmaps
- ``collector:lease:<name>`` string the collector holding the dataset (its stream and its files)
- ``collector:ready:<name>`` string the lease of the collector that has reconciled Redis with the
                                    dataset's files
- ``attempts``               hash   job id -> sends charged to the prompt so far, across workers
- ``spared``                 hash   job id -> sends the server failed and the prompt was spared (bounded)
- ``crashes``                hash   job id -> server crashes it was in flight at (bounded: ``suspect_crash``)
- ``pieces``                 hash   job id -> the output so far of a job continued in pieces (JSON: ids,
                                    texts, attempts per piece), so a crash costs at most one piece
- ``turns``                  hash   job id -> the finished turns of a conversation job (JSON), so another
                                    worker goes on from the first unfinished one
- ``maintenance``            string when anyone last reaped abandoned jobs (Redis time): one reap per interval
- ``noted:<what>``           string a note said once to the operator (e.g. Redis's hash encoding), not again
- ``stranded:<queue>``       hash   job id -> when the reaper first saw it stranded in RQ's intermediate list
- ``worker:<name>:retrying`` hash   dataset -> this worker's jobs waiting between attempts (TTL: the
                                    heartbeat TTL, refreshed every 2 s: a dead worker's lapses with its jobs)
- ``worker:<name>:committed`` hash  the token and charged attempts of the worker's last group commit, so a
                                    commit sent again after a lost reply is applied once (TTL 1 day)

RQ's own keys (``rq:queue:<ns>.<dataset>`` and its registries) hold the jobs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,99}$")


def validate_name(value: str, what: str = "dataset") -> str:
    """Names go into job ids, which RQ restricts to ``[A-Za-z0-9_-]``."""
    if not NAME_RE.match(value or ""):
        raise ValueError(
            f"{what} name {value!r} must be 1-100 characters of letters, digits, '_' or '-', "
            "not starting with '-'"
        )
    return value


def namespaces(conn) -> list[str]:
    """The namespaces that hold datasets on this Redis (their registry hashes), for a hint to a
    command pointed at one that holds none. SCAN: a few round trips, never a blocking KEYS."""
    found = set()
    for key in conn.scan_iter(match="genq:*:datasets", count=1000, _type="hash"):
        found.add(key.decode(errors="replace")[len("genq:") : -len(":datasets")])
    return sorted(found)


@dataclass(frozen=True)
class Keys:
    """The key names of one namespace."""

    namespace: str

    @property
    def prefix(self) -> str:
        return f"genq:{self.namespace}:"

    @property
    def datasets(self) -> str:
        return self.prefix + "datasets"

    def results(self, dataset: str) -> str:
        return f"{self.prefix}results:{dataset}"

    @property
    def results_group(self) -> str:
        return "collector"

    @property
    def in_stream(self) -> str:
        return self.prefix + "in_stream"

    def dead_letter(self, dataset: str) -> str:
        return f"{self.prefix}dead:{dataset}"

    @property
    def quarantined(self) -> str:
        return self.prefix + "quarantined"

    def unchecked(self, dataset: str) -> str:
        return f"{self.prefix}unchecked:{dataset}"

    @property
    def checkers_group(self) -> str:
        return "checkers"

    @property
    def in_check(self) -> str:
        return self.prefix + "in_check"

    def checked(self, dataset: str) -> str:
        return f"{self.prefix}ds:{dataset}:checked"

    def draws(self, dataset: str) -> str:
        return f"{self.prefix}ds:{dataset}:draws"

    def verdicts(self, dataset: str) -> str:
        return f"{self.prefix}ds:{dataset}:verdicts"

    def check_failed(self, dataset: str) -> str:
        return f"{self.prefix}ds:{dataset}:check_failed"

    def check_tries(self, dataset: str) -> str:
        return f"{self.prefix}ds:{dataset}:check_tries"

    @property
    def in_source(self) -> str:
        return self.prefix + "in_source"

    @property
    def attempts(self) -> str:
        return self.prefix + "attempts"

    @property
    def spared(self) -> str:
        return self.prefix + "spared"

    @property
    def crashes(self) -> str:
        return self.prefix + "crashes"

    @property
    def turns(self) -> str:
        return self.prefix + "turns"

    @property
    def pieces(self) -> str:
        return self.prefix + "pieces"

    @property
    def job_state(self) -> tuple[str, ...]:
        """genq's per-job state (counters, finished turns and pieces): cleared when the job ends or is
        retried."""
        return (self.attempts, self.spared, self.crashes, self.turns, self.pieces)

    @property
    def collector_offsets(self) -> str:
        return self.prefix + "collector:offsets"

    def collector_lease(self, dataset: str) -> str:
        return f"{self.prefix}collector:lease:{dataset}"

    def collector_ready(self, dataset: str) -> str:
        return f"{self.prefix}collector:ready:{dataset}"

    def stranded(self, queue_name: str) -> str:
        return f"{self.prefix}stranded:{queue_name}"

    def noted(self, what: str) -> str:
        return f"{self.prefix}noted:{what}"

    @property
    def maintenance_lock(self) -> str:
        return self.prefix + "maintenance"

    def enqueued(self, dataset: str) -> str:
        return f"{self.prefix}ds:{dataset}:enqueued"

    def done(self, dataset: str) -> str:
        return f"{self.prefix}ds:{dataset}:done"

    def failed(self, dataset: str) -> str:
        return f"{self.prefix}ds:{dataset}:failed"

    def servers(self, dataset: str) -> str:
        return f"{self.prefix}ds:{dataset}:servers"

    def provenance(self, dataset: str) -> str:
        return f"{self.prefix}ds:{dataset}:provenance"

    def extending(self, dataset: str) -> str:
        return f"{self.prefix}ds:{dataset}:extending"

    def enqueuing(self, dataset: str) -> str:
        return f"{self.prefix}enqueuing:{dataset}"

    def sources(self, dataset: str) -> str:
        return f"{self.prefix}ds:{dataset}:sources"

    def enqueue_epoch(self, dataset: str) -> str:
        return f"{self.prefix}enqueuing:{dataset}:epoch"

    def rejected(self, dataset: str) -> str:
        return f"{self.prefix}ds:{dataset}:rejected"

    def tokens(self, dataset: str) -> str:
        return f"{self.prefix}ds:{dataset}:tokens"

    def rate_bucket(self, dataset: str, bucket: int) -> str:
        return f"{self.prefix}ds:{dataset}:rate:{bucket}"

    def retrying(self, worker_name: str) -> str:
        return f"{self.prefix}worker:{worker_name}:retrying"

    def committed(self, worker_name: str) -> str:
        return f"{self.prefix}worker:{worker_name}:committed"

    def job_id(self, record_id: str) -> str:
        """The RQ job id of a record id. RQ keeps every job at ``rq:job:<id>`` whatever its queue,
        so two namespaces running a dataset of the same name need different job ids."""
        return f"{self.namespace}--{record_id}"

    def record_id(self, job_id: str) -> str | None:
        head = f"{self.namespace}--"
        return job_id[len(head) :] if job_id.startswith(head) else None

    def queue_name(self, dataset: str) -> str:
        """The RQ queue of a dataset: one queue each, so rq-dashboard shows depth per dataset."""
        return f"{self.namespace}.{dataset}"

    def dataset_of_queue(self, queue_name: str) -> str | None:
        head = f"{self.namespace}."
        return queue_name[len(head) :] if queue_name.startswith(head) else None

    @property
    def worker_prefix(self) -> str:
        """RQ worker names start with this, so status can tell this namespace's workers apart."""
        return f"genq.{self.namespace}."

    def types(self, datasets: list[str]) -> dict[str, str]:
        """Each of genq's keys of the namespace and of ``datasets`` with the Redis type genq keeps
        there (as TYPE names it): what a WRONGTYPE is checked against (genq/redis_errors.py)."""
        shared = {
            self.datasets: "hash", self.in_stream: "hash", self.quarantined: "hash", self.in_source: "hash",
            self.attempts: "hash", self.spared: "hash", self.crashes: "hash", self.turns: "hash",
            self.pieces: "hash", self.in_check: "hash",
            self.collector_offsets: "hash", self.maintenance_lock: "string",
        }  # fmt: skip
        for name in datasets:
            shared.update({
                self.results(name): "stream", self.dead_letter(name): "stream", self.enqueued(name): "string",
                self.done(name): "string", self.failed(name): "string", self.rejected(name): "string",
                self.sources(name): "hash", self.tokens(name): "hash", self.collector_lease(name): "string",
                self.collector_ready(name): "string", self.enqueuing(name): "string",
                self.extending(name): "string", self.servers(name): "hash", self.provenance(name): "hash",
                self.unchecked(name): "stream", self.checked(name): "string", self.draws(name): "hash",
                self.check_tries(name): "hash", self.verdicts(name): "hash",
                self.check_failed(name): "stream",
            })  # fmt: skip
        return shared
