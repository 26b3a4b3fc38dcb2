"""Nothing read from Redis is trusted (docs/security.md): entries in a dataset's result stream that
are not a worker's are quarantined and named, never a crash, never a line on disk."""

from __future__ import annotations

import http.client
import http.server
import re
import threading
import urllib.parse
from pathlib import Path

import orjson
from rq import Queue
from rq.job import Job
from rq.webhook import Webhook

from genq.entries import KEPT_BYTES
from genq.keys import Keys
from tests.helpers import (
    check_records,
    finish_run,
    log_of,
    read_jsonl,
    sim_stats,
    wait_for_records,
    wait_until,
    write_prompts,
)

PARAMS = {"max_new_tokens": 32}


def _garbage(real: dict[bytes, bytes]) -> list[tuple[str, dict]]:
    """Entries a worker never writes, each with words genq's reason for it must hold."""
    data = orjson.loads(real[b"data"])
    rid = data["id"].encode()  # whichever record reached the stream first
    other = f"good-{(data['row'] + 1) % 30}"

    def entry(**changed) -> dict:
        return {"kind": b"record", "id": rid, "data": orjson.dumps({**data, **changed})}

    return [
        ("no field 'data'", {"kind": b"record"}),
        ("field 'kind' is None", {"id": rid, "data": real[b"data"]}),
        ("field 'kind' is 'weird'", {**real, b"kind": b"weird"}),
        ("field 'data' is not JSON", {"kind": b"record", "id": rid, "data": b"not json"}),
        ("field 'data' is not JSON", {"kind": b"record", "id": rid, "data": b"x" * (10 << 20)}),
        ("is a JSON list", {"kind": b"record", "id": rid, "data": b"[1, 2]"}),
        ("data field 'row' is None", {"kind": b"record", "id": rid, "data": b'{"id": "' + rid + b'"}'}),
        ("data field 'row' is '3'", entry(row="3")),
        ("data field 'row' is -5", entry(row=-5)),
        ("past the last job", entry(row=1 << 40)),
        (f"not both {data['id']!r}", entry(id=other)),
        ("no job of id 'good-1000000' was ever enqueued", {
            "kind": b"record", "id": b"good-1000000",
            "data": orjson.dumps({**data, "row": 1_000_000, "id": "good-1000000"}),
        }),
    ]  # fmt: skip


def test_stream_entries_that_are_not_a_workers_are_quarantined(
    procs, start_sim, conn, namespace, out, tmp_path
):
    """Garbage XADDed to a dataset's stream beside its real results: the collector writes every
    real record once, moves each bad entry (its bytes kept, cut) to the dataset's dead letter with
    a reason naming the field, logs each once by its entry id, and exits 0; verify, status and
    `genq failed` say so, before and after; no bitmap grows to a forged row."""
    sim = start_sim()
    prompts = write_prompts(tmp_path / "good.jsonl", 30)
    assert procs.run("enqueue", tmp_path / "good.jsonl", "--max-new-tokens", "32").returncode == 0
    keys = Keys(namespace)
    worker = procs.start("worker", "--server", sim, "--burst")
    assert worker.wait(120) == 0, log_of(worker)
    real = conn.xrange(keys.results("good"), count=1)[0][1]
    garbage = _garbage(real)
    ids = [(why, conn.xadd(keys.results("good"), fields)) for why, fields in garbage]

    # Before the collector: verify counts them in the stream, no traceback.
    res = procs.run("verify", "--out", out, "--json")
    audit = orjson.loads(res.stdout)[0]
    assert audit["bad_entries_in_stream"] == len(garbage), res.stdout + res.stderr

    collector = procs.start("collect", "--out", out, "--burst")
    assert collector.wait(120) == 0, log_of(collector)
    check_records(out, "good", prompts, PARAMS)
    assert conn.xlen(keys.results("good")) == 0, "every entry acknowledged"
    assert conn.strlen(keys.done("good")) < 64, "a forged row grew the bitmap"
    log = log_of(collector)
    letters = {f[b"entry"]: f for _, f in conn.xrange(keys.dead_letter("good"))}
    assert set(letters) == {entry_id for _, entry_id in ids}
    for why, entry_id in ids:
        assert why in letters[entry_id][b"reason"].decode(), (why, letters[entry_id])
        assert sum(entry_id.decode() in line for line in log.splitlines()) == 1, (why, log)
    big = letters[ids[4][1]]
    assert len(big[b"field:data"]) == KEPT_BYTES and big[b"size:data"] == str(10 << 20).encode()

    res = procs.run("failed", "--json")
    shown = orjson.loads(res.stdout)["quarantined"]
    assert sorted(q["entry"] for q in shown) == sorted(i.decode() for _, i in ids)
    status = orjson.loads(procs.run("status", "--json").stdout)
    assert status["quarantined"] == {"good": len(garbage)}
    assert any("quarantined" in w for w in status["warnings"])
    res = procs.run("monitor", "--once", "--width", "120")
    assert f"quarantined stream entries: {len(garbage)}" in res.stdout, res.stdout
    res = procs.run("verify", "--out", out)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{len(garbage)} stream entries that were not a worker's result quarantined" in res.stderr


class _Listener:
    """A local HTTP server counting the requests it receives: where a forged webhook points."""

    def __init__(self) -> None:
        hits = self.hits = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                hits.append(self.path)
                self.send_response(200)
                self.end_headers()

            do_POST = do_GET  # noqa: N815

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_forged_jobs_call_no_url_and_fail_once_with_their_reason(
    procs, start_sim, conn, namespace, out, tmp_path
):
    """Jobs written into a dataset's queue by hand, with RQ webhooks pointing at a local listener:
    one whose payload is not genq's, one without max_new_tokens, one of another dataset's name.
    The worker fails each once, naming the field, sends nothing for them to the server, and
    nothing reaches the listener; the real jobs all land, and no forged one gets a line on disk."""
    sim = start_sim()
    prompts = write_prompts(tmp_path / "good.jsonl", 12)
    assert procs.run("enqueue", tmp_path / "good.jsonl", "--max-new-tokens", "32").returncode == 0
    keys = Keys(namespace)
    listener = _Listener()
    hooks = [Webhook(listener.url, "failed", method="POST"), Webhook(listener.url, "finished")]
    queue = Queue(keys.queue_name("good"), connection=conn, serializer="json")
    real = {"dataset": "good", "sample": 0, "sampling_params": {"max_new_tokens": 8}, "input_ids": [5, 6]}
    forged = {
        "unknown field 'not_a_field'": {"not_a_field": 1},
        "sampling_params field 'max_new_tokens' is None": {
            **real,
            "row": 100,
            "id": "good-100",
            "sampling_params": {},
        },
        "field 'dataset' is 'other'": {**real, "row": 101, "id": "good-101", "dataset": "other"},
        "not the record id of job": {**real, "row": 102, "id": "good-7"},
    }
    rows = {why: 100 + n for n, why in enumerate(forged)}
    for why, kwargs in forged.items():
        job_id = keys.job_id(f"good-{rows[why]}")
        queue.enqueue_call("genq.jobs.generate", kwargs=kwargs, job_id=job_id, webhooks=hooks)

    worker = procs.start("worker", "--server", sim, "--burst")
    assert worker.wait(120) == 0, log_of(worker)
    collector = procs.start("collect", "--out", out, "--burst")
    assert collector.wait(120) == 0, log_of(collector)
    check_records(out, "good", prompts, PARAMS)
    assert not (out / "good" / "errors.jsonl").exists() or not read_jsonl(out / "good" / "errors.jsonl")
    # The prompts, and the worker's 1-token probe at start (genq/backends/sglang.py _probe_generate).
    assert sim_stats(sim)["generations"] == len(prompts) + 1, "a forged job reached the server"
    assert listener.hits == [], "a URL from Redis was called"
    assert "carries webhooks" in log_of(worker)
    failed = set(queue.failed_job_registry.get_job_ids())
    for why, row in rows.items():
        job = Job.fetch(keys.job_id(f"good-{row}"), connection=conn, serializer="json")
        assert job.id in failed and job.get_status() == "failed"
        assert why in job.latest_result().exc_string, (why, job.latest_result().exc_string)
        assert sum(job.id in line for line in log_of(worker).splitlines() if "not a genq job" in line) == 1


def test_a_genq_key_of_the_wrong_type_pauses_every_role_and_wastes_nothing(
    procs, start_sim, conn, namespace, out, tmp_path
):
    """``in_stream`` replaced by a string mid-run: the collector and the worker each name the key
    and its type in one line and wait (no exit, no crash loop); the worker starts no job while it
    cannot commit, so nothing is generated to be thrown away; with the hash put back, the run ends
    with every record once and the server did one generation per prompt."""
    sim = start_sim("--latency", "realistic", "--decode-step-ms", "2")
    prompts = write_prompts(tmp_path / "good.jsonl", 300)
    assert procs.run("enqueue", tmp_path / "good.jsonl", "--max-new-tokens", "32").returncode == 0
    keys = Keys(namespace)
    collector = procs.start("collect", "--out", out)
    worker = procs.start("worker", "--server", sim, "--concurrency", "8")
    wait_for_records(procs, "good", 40, 60, in_flight=True)
    saved = conn.hgetall(keys.in_stream)
    with conn.pipeline() as pipe:  # one MULTI: no commit lands between the two
        pipe.delete(keys.in_stream)
        pipe.set(keys.in_stream, "not a hash")
        pipe.execute()
    said = f"{keys.in_stream} is a string, genq keeps a hash there"
    wait_until(lambda: said in log_of(worker) and said in log_of(collector), 60, "both roles to name the key")
    # Jobs in flight at the break finish and wait to commit; then none starts.
    wait_until(lambda: sim_stats(sim)["in_flight"] == 0, 30, "the jobs in flight to finish")
    paused = sim_stats(sim)["generations"]
    # Redis counts each command it refused for the key's type: the roles' retries (0.5 s doubling)
    # while no job may start. Six more refusals span a few seconds of a worker free to take jobs.
    refused = _wrongtype(conn)
    wait_until(lambda: _wrongtype(conn) >= refused + 6, 60, "six more commands refused for the key's type")
    assert sim_stats(sim)["generations"] == paused, "the worker started jobs it could not commit"
    assert worker.poll() is None and collector.poll() is None, "a role exited"
    assert sum("WRONGTYPE" in line for line in log_of(worker).splitlines()) == 1, "said once, not per retry"
    with conn.pipeline() as pipe:
        pipe.delete(keys.in_stream)
        pipe.hset(keys.in_stream, mapping=saved)
        pipe.execute()
    finish_run(procs, "good", len(prompts), 60, worker, collector)
    check_records(out, "good", prompts, PARAMS)
    # The prompts and the worker's 1-token probe: nothing was generated twice.
    assert sim_stats(sim)["generations"] == len(prompts) + 1


def _wrongtype(conn) -> int:
    """Commands Redis refused with WRONGTYPE so far (INFO errorstats)."""
    return int(conn.info("errorstats").get("errorstat_WRONGTYPE", {}).get("count", 0))


class _Corrupting:
    """An HTTP proxy in front of the simulator that spoils the first answers to /generate, one
    way each (the worker's 1-token probe passes untouched), and passes everything else."""

    SPOILS = ("too_long", "not_ids", "no_text", "huge", "huge_declared")

    def __init__(self, upstream: str, spoils: tuple[str, ...] = SPOILS, fail_first: int = 0) -> None:
        target = urllib.parse.urlsplit(upstream)
        spoils = list(spoils)
        failing = [fail_first]
        self.spoiled: list[str] = []
        lock = threading.Lock()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with lock:
                    fail, failing[0] = failing[0] > 0, failing[0] - 1
                if fail:  # a transient 500, whatever was asked
                    data = b'{"error": "transient"}'
                    self.send_response(500)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                conn.request(self.command, self.path, body or None, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                spoil = None
                if self.path == "/generate" and b"genq-probe" not in body and resp.status == 200:
                    with lock:
                        spoil = spoils.pop(0) if spoils else None
                        if spoil:
                            owner.spoiled.append(spoil)
                if spoil in ("huge", "huge_declared"):
                    self._huge(declared=spoil == "huge_declared")
                    return
                if spoil is not None:
                    answer = orjson.loads(data)
                    if spoil == "too_long":
                        answer["output_ids"] = answer["output_ids"] + [7] * 40
                    elif spoil == "not_ids":
                        answer["output_ids"] = ["a", None, -5, 1_000_000_000]
                    else:
                        del answer["text"]
                    data = orjson.dumps(answer)
                self.send_response(resp.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _huge(self, declared: bool) -> None:
                """100 MiB of an answer: chunked (its size unknown until read), or declared."""
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                if declared:
                    self.send_header("Content-Length", str(100 << 20))
                else:
                    self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                chunk = b"x" * (1 << 20)
                try:
                    for _ in range(100):
                        self.wfile.write(chunk if declared else b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    if not declared:
                        self.wfile.write(b"0\r\n\r\n")
                except OSError:
                    pass  # the worker stopped reading: what it must do
                self.close_connection = True

            do_GET = do_POST = _forward  # noqa: N815

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_wrong_answers_from_the_server_are_never_records(procs, start_sim, conn, out, tmp_path):
    """Answers with more output ids than max_new_tokens, ids that are not token ids, no text, and
    a 100 MiB body (chunked, and declared): each is a bad_response naming what is wrong, charged
    and sent again; every record is the server's true answer, once; the worker never holds the
    big body (its peak memory stays far below it)."""
    sim = start_sim()
    proxy = _Corrupting(sim)
    prompts = write_prompts(tmp_path / "good.jsonl", 40)
    assert procs.run("enqueue", tmp_path / "good.jsonl", "--max-new-tokens", "32").returncode == 0
    flags = ("--backend", "sglang", "--concurrency", "4", "--max-response-mb", "4")
    worker = procs.start("worker", "--server", proxy.url, *flags)
    collector = procs.start("collect", "--out", out)
    wait_for_records(procs, "good", len(prompts), 60)
    status = Path(f"/proc/{worker.pid}/status").read_text()
    peak_mib = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024
    assert peak_mib < 100, f"the worker peaked at {peak_mib:.0f} MiB: it read the 100 MiB body"
    finish_run(procs, "good", len(prompts), 60, worker, collector)
    check_records(out, "good", prompts, PARAMS)
    assert proxy.spoiled == list(_Corrupting.SPOILS)
    log = log_of(worker)
    assert re.search(r"\d+ output ids for a max_new_tokens of 32", log), log[-3000:]
    for words in (
        "output_ids holds 'a', not a token id",
        "the answer's text is None, not a string",
        "a body over 4,194,304 bytes",
    ):
        assert words in log, (words, log[-3000:])
    records = read_jsonl(out / "good" / "raw_responses.jsonl")
    assert sum(r["attempts"] for r in records) == len(prompts) + len(_Corrupting.SPOILS)
    assert sim_stats(sim)["generations"] == len(prompts) + 1 + len(_Corrupting.SPOILS)


def test_enqueue_waits_out_a_transient_error_of_the_limits_probe(procs, start_sim, tmp_path):
    """`enqueue --server` whose server answers its first requests with a 500 (restarting, say):
    it retries them as a worker would, says so, and enqueues; a refusal still ends it at once."""
    proxy = _Corrupting(start_sim(), spoils=(), fail_first=3)
    write_prompts(tmp_path / "p.jsonl", 5)
    res = procs.run("enqueue", tmp_path / "p.jsonl", "--max-new-tokens", "8", "--server", proxy.url)
    assert res.returncode == 0, res.stderr
    assert "failed its limits probe (unavailable 500: " in res.stderr, res.stderr
    assert "enqueued 5" in res.stdout
