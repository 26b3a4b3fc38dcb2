"""Recovery times of genq: how long each failure takes to heal, with real processes.

Run it from the repository root with the project's venv (about 5 minutes):

    python bench/recovery.py

Each scenario runs in its own namespace (and dataset name) on one private redis-server, against
`genq sim-server`, with the worker's default settings (heartbeat TTL 60 s, grace 60 s) unless the
setting column says otherwise: a worker SIGKILLed, a worker SIGTERMed, the inference server down
for 30 s, Redis SIGKILLed and restarted, the collector SIGKILLed mid-drain. It prints a table and
writes bench/results/recovery.json. These are the numbers the README's "What happens when..."
section quotes; every wait is bounded and every process it started is killed on the way out.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from redis import Redis
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import machine, write_prompts  # noqa: E402
from genq.commands.embedded import EmbeddedRedis, free_port  # noqa: E402
from genq.commands.processes import genq_command, spawn, wait_for_line  # noqa: E402
from genq.keys import Keys  # noqa: E402
from genq.progress import dataset_counts  # noqa: E402

TIMEOUT_S = 300.0
LONG = ("--latency", "realistic", "--min-len", "3000", "--max-len", "3100", "--decode-step-ms", "5")
SHORT = ("--latency", "zero", "--min-len", "16", "--max-len", "64")
console = Console(width=max(shutil.get_terminal_size().columns, 140))
CHILDREN: list[subprocess.Popen] = []
Row = dict[str, Any]


def wait_until(cond: Callable[[], Any], what: str, timeout: float = TIMEOUT_S, every: float = 0.05) -> float:
    """Poll ``cond`` until truthy; the monotonic time it became so. TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)
    return time.monotonic()


def sigkill(proc: subprocess.Popen) -> float:
    """SIGKILL and reap (a zombie still holds its pid, e.g. for the collector's lease check)."""
    proc.kill()
    t = time.monotonic()
    proc.wait(10)
    return t


def kill_children() -> None:
    for proc in CHILDREN:
        if proc.poll() is None:
            sigkill(proc)


def lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


class Run:
    """One scenario: a namespace and unique dataset name, a log folder, real processes."""

    def __init__(self, work: Path, name: str, redis_url: str):
        # A unique dataset name too: no RQ job id (global to a Redis) is shared with another run.
        self.dataset = f"{name}-{uuid.uuid4().hex[:6]}"
        self.keys = Keys(f"rec-{self.dataset}")
        self.dir = work / self.dataset
        self.logs, self.out = self.dir / "logs", self.dir / "out"
        self.logs.mkdir(parents=True)
        self.env = {"GENQ_REDIS_URL": redis_url, "GENQ_NAMESPACE": self.keys.namespace}
        self.conn = Redis.from_url(redis_url)
        self.raw = self.out / self.dataset / "raw_responses.jsonl"

    def start(self, name: str, *args: str) -> subprocess.Popen:
        with open(self.logs / f"{name}.log", "ab") as fh:
            proc = spawn(genq_command(*args), env=self.env, stdout=fh, stderr=subprocess.STDOUT)
        CHILDREN.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def sim(self, *flags: str, port: int = 0) -> tuple[subprocess.Popen, str]:
        with open(self.logs / "sim.log", "ab") as fh:
            proc = spawn(
                genq_command("sim-server", "--port", str(port), *flags), stdout=subprocess.PIPE, stderr=fh
            )
        CHILDREN.append(proc)
        return proc, wait_for_line(proc, "sim-server listening on ", 30).rsplit(" ", 1)[1]

    def enqueue(self, n: int, max_new_tokens: int) -> None:
        prompts = self.dir / "prompts.jsonl"
        write_prompts(prompts, n)
        argv = genq_command(
            "enqueue", str(prompts), "--dataset", self.dataset, "--max-new-tokens", str(max_new_tokens)
        )
        res = subprocess.run(argv, env={**os.environ, **self.env}, capture_output=True, timeout=120)
        if res.returncode != 0:
            raise RuntimeError(f"enqueue failed: {res.stderr.decode()[-2000:]}")

    def counts(self) -> dict[str, int]:
        return dataset_counts(self.conn, self.keys)[self.dataset]

    def handed_over(self) -> int:
        """Jobs a worker finished: on disk, or in the stream on their way there."""
        return self.counts()["done"] + int(self.conn.hget(self.keys.in_stream, self.dataset) or 0)

    def started(self) -> set[bytes]:
        """RQ's started-job registry of the dataset's queue: ``job_id:execution_id`` entries."""
        return set(self.conn.zrange(f"rq:wip:{self.keys.queue_name(self.dataset)}", 0, -1))

    def ids_once(self, n: int) -> tuple[bool, str]:
        """Every id on disk exactly once; a summary with the records that needed a 2nd attempt."""
        records = [orjson.loads(line) for line in self.raw.read_bytes().splitlines()]
        ids = Counter(r["id"] for r in records)
        dupes = sum(1 for c in ids.values() if c > 1)
        retried = sum(1 for r in records if r["attempts"] > 1)
        summary = f"{len(records)} lines, {len(ids)}/{n} ids, {dupes} dupes, {retried} with attempts>1"
        return len(ids) == n and not dupes, summary

    def issues(self) -> str:
        """ERROR/CRITICAL/Traceback lines in the logs: the first one, and how many."""
        found = [
            f"{log.stem}: {line.strip()[:160]}"
            for log in sorted(self.logs.glob("*.log"))
            for line in log.read_text(errors="replace").splitlines()
            if any(w in line for w in ("ERROR", "CRITICAL", "Traceback"))
        ]
        return f"; log errors: {len(found)}" + (f" (first: {found[0]})" if found else "")


def row(scenario: str, setting: str, seconds: float | None, bound: float, ok: bool, detail: str) -> Row:
    """One result; ``ok`` only if the checks passed and the time is within ``bound``."""
    ok = ok and seconds is not None and seconds <= bound
    secs = None if seconds is None else round(seconds, 2)
    return dict(scenario=scenario, setting=setting, seconds=secs, bound_s=bound, ok=ok, detail=detail)


def worker_sigkill(work: Path, url: str, ttl: int) -> list[Row]:
    """20 long jobs in flight on A (40 enqueued); SIGKILL A, then start B: A's jobs must run on B."""
    run = Run(work, f"kill{ttl}", url)
    _, server = run.sim(*LONG)
    run.enqueue(40, 4000)
    flags = ("--concurrency", "20") if ttl == 60 else ("--concurrency", "20", "--heartbeat-ttl", str(ttl))
    a = run.start("worker-a", "worker", "--server", server, *flags)
    wait_until(lambda: len(run.started()) == 20, "20 jobs in flight on A", 60)
    a_entries = run.started()
    a_ids = {e.split(b":")[0] for e in a_entries}
    t0 = sigkill(a)
    run.start("worker-b", "worker", "--server", server, *flags)
    back = wait_until(lambda: not run.started() & a_entries, "A's jobs to leave A's executions")
    rerun = wait_until(
        lambda: a_ids <= {e.split(b":")[0] for e in run.started() - a_entries}, "B to run them"
    )
    c = run.counts()
    ok, setting = c["failed"] == c["unaccounted"] == 0, f"heartbeat TTL {ttl} s"
    detail = f"failed {c['failed']}, unaccounted {c['unaccounted']}" + run.issues()
    on_b = "B (concurrency 20) took the 20 queued jobs first (~20 s each)"
    return [
        row("worker SIGKILLed: its 20 jobs back in queue", setting, back - t0, ttl * 1.25 + 5, ok, detail),
        row("worker SIGKILLed: its 20 jobs running on B", setting, rerun - t0, ttl * 1.25 + 30, ok, on_b),
    ]


def worker_sigterm(work: Path, url: str) -> list[Row]:
    run = Run(work, "term", url)
    _, server = run.sim(*LONG)
    run.enqueue(20, 4000)
    w = run.start("worker", "worker", "--server", server, "--concurrency", "20", "--grace", "5")
    wait_until(lambda: run.counts()["in_flight"] == 20, "20 jobs in flight", 60)
    time.sleep(1)
    t0 = time.monotonic()
    w.send_signal(signal.SIGTERM)
    t1 = wait_until(lambda: w.poll() is not None, "the worker to exit", 120, every=0.01)
    c = run.counts()
    ok = w.returncode == 0 and c["queued"] == 20 and c["in_flight"] == 0
    detail = f"exit {w.returncode}; at exit queued {c['queued']}, in flight {c['in_flight']}" + run.issues()
    return [row("worker SIGTERMed, 20 long jobs in flight", "--grace 5", t1 - t0, 5 + 5, ok, detail)]


def server_down(work: Path, url: str, down_s: float) -> list[Row]:
    """The simulator SIGKILLed for ``down_s`` and restarted on its port while a worker runs."""
    run, port, n = Run(work, f"down{down_s:.0f}", url), free_port(), 3000
    sim, server = run.sim(*SHORT, port=port)
    run.enqueue(n, 64)
    collector = run.start("collector", "collect", "--out", str(run.out), "--burst")
    worker = run.start("worker", "worker", "--server", server, "--max-attempts", "2", "--burst")
    wait_until(lambda: run.handed_over() >= 100, "100 jobs done", 60)
    sigkill(sim)
    time.sleep(down_s)
    before, failed_while_down = run.handed_over(), run.counts()["failed"]
    run.sim(*SHORT, port=port)
    t0 = time.monotonic()  # it printed its line once its socket was bound: it answers
    t1 = wait_until(lambda: run.handed_over() > before, "a job done after the server came back", 120)
    wait_until(lambda: worker.poll() is not None and collector.poll() is not None, "worker and collector")
    c, (once, ids) = run.counts(), run.ids_once(n)
    saw = "looks down" in run.log("worker") and "is up again" in run.log("worker")
    ok = once and saw and c["failed"] == failed_while_down == 0 and worker.returncode == 0
    detail = f"failed {c['failed']}; {ids}; 'looks down', 'is up again' logged: {saw}" + run.issues()
    scenario = f"server down {down_s:.0f} s: back to first job done"
    return [row(scenario, "--max-attempts 2", t1 - t0, 35, ok, detail)]


def redis_restart(work: Path) -> list[Row]:
    """Redis SIGKILLed mid-run and started again on the same port and folder after 5 s."""
    server = EmbeddedRedis(work / "redis-restart")
    try:
        run, n = Run(work, "redis", server.start()), 3000
        _, sim = run.sim(*SHORT)
        run.enqueue(n, 64)
        collector = run.start("collector", "collect", "--out", str(run.out), "--burst")
        worker = run.start("worker", "worker", "--server", sim, "--burst")
        wait_until(lambda: lines(run.raw) >= 300, "300 lines on disk", 60)
        assert server.proc is not None
        sigkill(server.proc)
        time.sleep(5)
        server = EmbeddedRedis(work / "redis-restart", port=server.port)
        server.start()
        t0, before = time.monotonic(), lines(run.raw)
        t1 = wait_until(lambda: lines(run.raw) > before, "lines written after the restart", 120)
        t2 = wait_until(lambda: worker.poll() is not None and collector.poll() is not None, "both to exit")
        once, ids = run.ids_once(n)
        saw = "Redis unreachable" in run.log("worker") + run.log("collector")
        ok = once and saw and worker.returncode == collector.returncode == 0
        detail = f"{before} lines at restart; all on disk {t2 - t0:.1f} s after; {ids}" + run.issues()
        return [
            row("Redis SIGKILLed, back after 5 s: writing again", "AOF everysec", t1 - t0, 35, ok, detail)
        ]
    finally:
        server.stop()


def collector_sigkill(work: Path, url: str) -> list[Row]:
    """3000 results in the stream; the collector SIGKILLed after its first batch, then restarted."""
    run, n = Run(work, "collect", url), 3000
    _, sim = run.sim(*SHORT)
    run.enqueue(n, 64)
    worker = run.start("worker", "worker", "--server", sim, "--burst")
    wait_until(lambda: worker.poll() is not None, "the worker to finish")
    first = run.start("collector-1", "collect", "--out", str(run.out))
    wait_until(lambda: lines(run.raw) >= 500, "500 lines on disk", 60, every=0.01)
    sigkill(first)
    killed_at, t0 = lines(run.raw), time.monotonic()
    second = run.start("collector-2", "collect", "--out", str(run.out), "--burst")
    drained = lambda: run.counts()["done"] == n and run.conn.xlen(run.keys.results(run.dataset)) == 0  # noqa: E731
    t1 = wait_until(drained, "the stream drained")
    wait_until(lambda: second.poll() is not None, "the collector to exit")
    once, ids = run.ids_once(n)
    detail = f"killed at {killed_at}/{n} lines; exit {second.returncode}; {ids}" + run.issues()
    ok = once and second.returncode == 0
    return [row("collector SIGKILLed mid-drain: restart to drained", "--batch 500", t1 - t0, 30, ok, detail)]


def main() -> int:
    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    work = Path(tempfile.mkdtemp(prefix="genq-recovery-"))
    redis = EmbeddedRedis(work / "redis")
    rows: list[Row] = []
    ok = False
    try:
        url = redis.start()
        scenarios: list[tuple[str, Callable[[], list[Row]]]] = [
            ("worker SIGKILL, TTL 60", lambda: worker_sigkill(work, url, 60)),
            ("worker SIGKILL, TTL 20", lambda: worker_sigkill(work, url, 20)),
            ("worker SIGTERM", lambda: worker_sigterm(work, url)),
            ("server down 30 s", lambda: server_down(work, url, 30)),
            ("server down 20 s", lambda: server_down(work, url, 20)),
            ("Redis restart", lambda: redis_restart(work)),
            ("collector SIGKILL", lambda: collector_sigkill(work, url)),
        ]
        for name, scenario in scenarios:
            console.print(f"{name} ...", end=" ")
            t = time.monotonic()
            try:
                got = scenario()
            except Exception as exc:  # noqa: BLE001 - reported as a failed row, the others still run
                got = [row(name, "-", None, 0, False, f"{type(exc).__name__}: {exc}")]
            finally:
                kill_children()  # each scenario starts from a quiet machine
            console.print(f"{time.monotonic() - t:.0f} s, " + ", ".join(f"{r['seconds']} s" for r in got))
            rows += got
        ok = all(r["ok"] for r in rows)
    except KeyboardInterrupt:
        console.print("\ninterrupted")
        return 130
    finally:
        kill_children()
        redis.stop()
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:
            console.print(f"logs and outputs kept in {work}")

    table = Table(title="genq recovery times (default worker settings unless stated)")
    for col in ("scenario", "setting", "measured s", "bound s", "check", "detail"):
        table.add_column(col, justify="right" if col.endswith(" s") else "left", overflow="fold")
    for r in rows:
        check = "[green]pass[/green]" if r["ok"] else "[red]FAIL[/red]"
        secs = "-" if r["seconds"] is None else f"{r['seconds']:.1f}"
        table.add_row(r["scenario"], r["setting"], secs, f"{r['bound_s']:g}", check, r["detail"])
    console.print(table)
    dest = Path(__file__).resolve().parent / "results" / "recovery.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({"machine": machine(), "results": rows}, indent=2) + "\n")
    console.print(f"wrote {dest}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
