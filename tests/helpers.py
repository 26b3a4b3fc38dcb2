"""Shared test helpers: real processes, bounded waits, and the invariant checks of docs/design.md."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis

from genq import progress
from genq.backends import BACKENDS, Http
from genq.backends.load import Load
from genq.commands.processes import genq_command
from genq.keys import Keys
from genq.sim.model import generate


def need(tool: str) -> str:
    """The tool's path; a missing tool skips the test, except in CI (.ci/run installs them), where
    it fails saying which tool is missing."""
    path = shutil.which(tool)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{tool} is not installed (.ci/run installs it)")
        pytest.skip(f"{tool} is not installed")
    return path


def pinned_env(package: str, version: str) -> dict[str, str]:
    """The environment that runs this suite with ``package`` at ``version`` in place of the one
    installed: that version installed once (its wheel alone, no dependencies) under ~/.cache/genq
    and put first on the path; the installed one when it is that version. pyproject.toml admits a
    range; the oldest and newest of it are both checked this way. Without PyPI the test skips, in
    CI it fails."""
    from importlib.metadata import version as installed

    if installed(package) == version:
        return dict(os.environ)
    root = Path(os.environ.get("GENQ_ENGINE_CACHE") or Path.home() / ".cache" / "genq")
    target = root / f"{package}-{version}-py{sys.version_info[0]}.{sys.version_info[1]}"
    if not (target / package).is_dir():
        building = root / f"{target.name}.{os.getpid()}.tmp"
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(building)]
        res = subprocess.run([*pip, f"{package}=={version}"], capture_output=True, text=True, timeout=240)
        if res.returncode != 0:
            if os.environ.get("CI"):
                pytest.fail(f"pip could not install {package}=={version}: {res.stderr}")
            pytest.skip(f"pip could not install {package}=={version}")
        with contextlib.suppress(OSError):  # another run finished it first
            building.rename(target)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}
    probe = f"from importlib.metadata import version; print(version({package!r}))"
    got = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert got.stdout.strip() == version, got.stderr
    return env


def run_tests_in(env: dict[str, str], tmp_path: Path, module: str, select: str) -> None:
    """The fast tests of ``module`` that ``select`` (pytest -k) picks, run in ``env``; they pass."""
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", module]
        + ["-k", select, "--basetemp", str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]  # 5: none collected


def dump_dom(url: str, profile) -> str:
    """The page as headless Chromium shows it, after its JavaScript (if any) has run: the DOM
    serialized, for a URL (http:// or file://)."""
    res = subprocess.run(
        [
            need("chromium"),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=5000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def wait_until(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll ``cond`` until it is truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def genq_argv(*args: str) -> list[str]:
    return genq_command(*map(str, args))


class StillRunning(subprocess.TimeoutExpired):
    """A genq process that did not exit in time, with what it was doing: its log's last lines,
    `genq status` of its namespace (a worker's jobs in flight, its queues), and its threads'
    stacks where py-spy is installed. A rare hang is diagnosed from the run it happened in."""

    def __init__(self, cmd: Any, timeout: float, diagnosis: str):
        super().__init__(cmd, timeout)
        self.diagnosis = diagnosis

    def __str__(self) -> str:
        return f"{super().__str__()}\n{self.diagnosis}"


class GenqProcess(subprocess.Popen):
    """A genq command started by :class:`Procs`: its log's path, and a wait that says why it is
    still running when it times out."""

    log_path: Path
    env_of: dict[str, str]

    def wait(self, timeout: float | None = None) -> int:
        try:
            return super().wait(timeout)
        except subprocess.TimeoutExpired as exc:
            raise StillRunning(exc.cmd, exc.timeout, self.diagnosis()) from None

    def diagnosis(self) -> str:
        lines = Path(self.log_path).read_text(errors="replace").splitlines()[-30:]
        parts = ["--- its log's last lines", *lines]
        looks = [("genq status --json", genq_argv("status", "--json"))]
        if spy := shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy"):
            looks.append(("py-spy dump", [spy, "dump", "--pid", str(self.pid)]))
        for title, argv in looks:
            try:
                out = subprocess.run(argv, env=self.env_of, capture_output=True, text=True, timeout=60)
                parts += [f"--- {title}", out.stdout.strip() or out.stderr.strip()]
            except subprocess.TimeoutExpired:
                parts += [f"--- {title}: no answer in 60 s"]
        return "\n".join(parts)


class Procs:
    """Processes a test started; all killed at teardown, whatever happened."""

    def __init__(self, env: dict[str, str], logs: Path):
        self.env = env
        self.logs = logs
        self.procs: list[subprocess.Popen] = []

    def start(
        self, *args: str, name: str | None = None, env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> GenqProcess:
        log = self.logs / f"{name or args[0]}-{len(self.procs)}.log"
        full_env = {**self.env, **(env or {})}
        with open(log, "wb") as fh:
            proc = GenqProcess(genq_argv(*args), env=full_env, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd)
        proc.log_path, proc.env_of = log, full_env
        self.procs.append(proc)
        return proc

    def run(
        self, *args: str, timeout: float = 120, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            genq_argv(*args), env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout
        )

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def log_of(proc: subprocess.Popen) -> str:
    return Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
    proc.send_signal(sig)
    return proc.wait(timeout)


def write_prompts(path: Path, n: int, start: int = 0, length: tuple[int, int] = (4, 40)) -> list[list[int]]:
    """``n`` pre-tokenized prompts of varied length; returns their input_ids."""
    rows = []
    with path.open("wb") as fh:
        for i in range(start, start + n):
            ids = [100 + (i * 7 + j * 13) % 30000 for j in range(length[0] + i % (length[1] - length[0]))]
            rows.append(ids)
            fh.write(orjson.dumps({"id": f"src-{i}", "input_ids": ids}) + b"\n")
    return rows


def write_ids(path: Path, prompts: list[list[int]]) -> Path:
    """A dataset of pre-tokenized prompts, one row each (ids s0, s1, ...)."""
    rows = (orjson.dumps({"id": f"s{i}", "input_ids": p}) + b"\n" for i, p in enumerate(prompts))
    path.write_bytes(b"".join(rows))
    return path


def write_jsonl(path: Path, rows: Iterable[Any]) -> Path:
    """One JSON value per line (a dict, a list, or a str written as it is: a bad line on purpose)."""
    lines = (r.encode() if isinstance(r, str) else orjson.dumps(r) for r in rows)
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def written_lines(path: Path) -> list[dict]:
    """The complete lines of a file being written, parsed: a collector's buffered writes reach the
    file mid-batch, so its last line may be unfinished until the batch's flush (or for good, after a
    SIGKILL, until the next collector cuts it). For polling; read_jsonl for the final check."""
    if not path.exists():
        return []
    data = path.read_bytes()
    return [orjson.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines() if line.strip()]


def read_jsonl(path: Path) -> list[dict]:
    """Every line parsed; a torn (unterminated) or unparsable line fails the test."""
    if not path.exists():
        return []
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), f"{path}: torn last line"
    return [orjson.loads(line) for line in data.splitlines() if line.strip()]


def check_records(
    out: Path,
    dataset: str,
    prompts: list[list[int]],
    params: dict,
    samples: int = 1,
    skip_rows: frozenset[int] = frozenset(),
    **model: int,
) -> list[dict]:
    """docs/design.md invariants on disk: each job exactly once, output_ids the server's for its prompt.

    ``skip_rows``: rows expected in errors.jsonl instead. ``model`` passes the simulator's
    --min-len/--max-len, when a test changed them.
    """
    records = read_jsonl(out / dataset / "raw_responses.jsonl")
    ids = Counter(r["id"] for r in records)
    dupes = [i for i, c in ids.items() if c > 1]
    assert not dupes, f"duplicated ids: {dupes[:10]}"
    expected = {
        (f"{dataset}-{row}-{k}" if samples > 1 else f"{dataset}-{row}")
        for row in range(len(prompts))
        if row not in skip_rows
        for k in range(samples)
    }
    assert set(ids) == expected, (
        f"missing {sorted(expected - set(ids))[:10]}, extra {sorted(set(ids) - expected)[:10]}"
    )
    for r in records:
        p = dict(params)
        if samples > 1:
            p["sampling_seed"] = p.get("sampling_seed", 0) + r["sample"]
        gen = generate(prompts[r["row"]], p, **model)
        assert r["output_ids"] == gen.output_ids, f"{r['id']}: output_ids are not the server's for its prompt"
        assert r["completion_tokens"] == len(r["output_ids"])
        assert r["prompt_tokens"] == len(prompts[r["row"]])
    return records


def status_json(procs: Procs, env: dict[str, str] | None = None) -> dict:
    res = procs.run("status", "--json", timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    return orjson.loads(res.stdout)


def run_burst(
    procs: Procs, out: Path, url: str, *workers: tuple[str, ...], timeout: float = 300
) -> list[str]:
    """Burst workers on ``url`` (one per tuple of extra flags) until the queue is empty, then a burst
    collect; the workers' logs."""
    started = [procs.start("worker", "--server", url, "--burst", *flags) for flags in workers]
    assert [w.wait(timeout) for w in started] == [0] * len(started), [log_of(w) for w in started]
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    return [log_of(w) for w in started]


def one_failure(procs: Procs, sim_url: str, out: Path, tmp_path: Path) -> None:
    """Dataset ``rq`` run to the end on a sim started with ``--context-length 256``: ``rq-0`` done,
    ``rq-1`` (too long for the context) failed and in errors.jsonl."""
    data = write_jsonl(tmp_path / "rq.jsonl", [{"input_ids": [101] * 10}, {"input_ids": [101] * 200}])
    assert procs.run("enqueue", data, "--max-new-tokens", "100").returncode == 0
    run_burst(procs, out, sim_url, ())
    assert [e["id"] for e in read_jsonl(out / "rq" / "errors.jsonl")] == ["rq-1"]


def assert_verified(procs: Procs, out: Path, data: Path) -> None:
    """`genq verify` of the dataset ``data`` finds every row on disk once and nothing else, and the
    ledger Redis keeps (status) is the one the files give (stats)."""
    res = procs.run("verify", "--out", out, data, "--json")
    (audit,) = orjson.loads(res.stdout)
    assert res.returncode == 0 and audit["ok"], audit
    status = status_json(procs)
    assert_adds_up(status)
    book = status["datasets"][audit["dataset"]]["ledger"]
    files = orjson.loads(procs.run("stats", out, "--json").stdout)["datasets"][audit["dataset"]]["ledger"]
    mine = ("stopped", "continued", "cut", "failed")
    assert {k: book[k] for k in mine} == {k: files[k] for k in mine}, f"status {book}, stats {files}"


def assert_adds_up(status: dict) -> None:
    """The five states sum to the total, and the ledger (where known) to the rows read."""
    for name, c in status["datasets"].items():
        parts = c["queued"] + c["in_flight"] + c["retrying"] + c["done"] + c["failed"]
        assert parts == c["total"], f"{name}: {c} does not add up"
        book = c["ledger"]
        if book is not None:
            assert min(book.values()) >= 0 and book["read"] == c["total"] + c["rejected"], f"{name}: {book}"
            assert sum(v for k, v in book.items() if k != "read") == book["read"], f"{name}: {book}"


def sigkill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


def sim_get(url: str, path: str) -> Any:
    with urllib.request.urlopen(url + path, timeout=10) as resp:
        return orjson.loads(resp.read())


def sim_post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, data=orjson.dumps(body), method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return orjson.loads(resp.read())


def server_load(url: str, backend: str) -> Load | None:
    """What a backend's load() reads of the server at ``url`` (genq/backends/load.py)."""

    async def run() -> Load | None:
        async with Http(url) as http:
            return await BACKENDS[backend](http).load()

    return asyncio.run(run())


def load_shape(load: Load | None) -> dict[str, Any] | None:
    """Which of a Load's fields the server fills, and from which endpoints: what must agree between
    a real engine and the simulator (the values differ: their batches do)."""
    if load is None:
        return None
    return {k: v if k == "source" else v is not None for k, v in dataclasses.asdict(load).items()}


def sim_stats(url: str) -> dict:
    return sim_get(url, "/sim/stats")


def server_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5):
            return True
    except OSError:
        return False


def http(url: str, method: str = "GET", auth: tuple[str, str] | None = None) -> tuple[int, bytes]:
    """Status and body of one request; 0 and no body when nothing listens (yet)."""
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    if auth:
        token = base64.b64encode(":".join(auth).encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except urllib.error.URLError:
        return 0, b""


def http_status(url: str, method: str = "GET", auth: tuple[str, str] | None = None) -> int:
    return http(url, method, auth)[0]


def snapshot(conn) -> None:
    """BGSAVE, and wait until Redis has written the RDB file."""
    conn.bgsave()
    wait_until(lambda: conn.info("persistence")["rdb_bgsave_in_progress"] == 0, 30, "the snapshot")


def kill_collector_mid_write(
    procs: Procs,
    out: Path,
    raw: Path,
    total: int,
    times: int = 3,
    batch: int = 10,
    env: dict[str, str] | None = None,
    timeout: float = 60,
) -> list[int]:
    """Start `genq collect --out OUT --batch BATCH` ``times`` times, SIGKILL each one as soon as it
    has appended to ``raw`` (the records file it drains into), and fail unless each kill came
    mid-drain: fewer than ``total`` complete lines on disk after it (the stream should hold
    ``total`` results, all produced before, so the collector has a backlog to write). Returns the
    complete lines on disk after each kill."""
    size = lambda: raw.stat().st_size if raw.exists() else 0  # noqa: E731
    after = []
    for n in range(1, times + 1):
        before = size()
        collector = procs.start("collect", "--out", out, "--batch", str(batch), env=env)
        wait_until(lambda b=before: size() > b, timeout, f"collector {n} to write to {raw.name}", 0.005)
        sigkill(collector)
        after.append(len(written_lines(raw)))
        assert after[-1] < total, (
            f"kill {n} of the collector came after all {total} lines were on disk, not mid-drain "
            f"(lines after each kill: {after})"
        )
    return after


def started_jobs(conn, namespace: str, dataset: str) -> dict[str, str]:
    """Job id -> the worker running it, for every execution in RQ's started registry of
    ``dataset`` (a lapsed one stays there until a reaper takes it out)."""
    from rq import Queue
    from rq.job import Job

    queue = Queue(Keys(namespace).queue_name(dataset), connection=conn, serializer="json")
    ids = [m.decode().split(":")[0] for m in conn.zrange(queue.started_job_registry.key, 0, -1)]
    with conn.pipeline(transaction=False) as pipe:
        for job_id in ids:
            pipe.hget(Job.key_for(job_id), "worker_name")
        names = pipe.execute()
    return {i: (n or b"").decode() for i, n in zip(ids, names, strict=True)}


def worker_name(procs: Procs, proc: subprocess.Popen, timeout: float = 60) -> str:
    """The RQ name of a `genq worker` process, once it has registered (status shows it by pid)."""

    def named() -> str | None:
        return next((w["name"] for w in status_json(procs)["workers"] if w["pid"] == proc.pid), None)

    return wait_until(named, timeout, f"worker {proc.pid} to register")


def wait_all(started: Iterable[subprocess.Popen], timeout: float) -> list[int]:
    """The exit codes of processes that run side by side, all within one ``timeout`` (not one each:
    a test's wait budgets must add up below its pytest timeout)."""
    deadline = time.monotonic() + timeout
    return [proc.wait(max(deadline - time.monotonic(), 0)) for proc in started]


def wait_for_records(procs: Procs, dataset: str, n: int, stall: float, *, in_flight: bool = False) -> dict:
    """Wait until ``n`` records of ``dataset`` are on disk (and, with ``in_flight``, jobs still in
    flight, so that what comes next meets work under way); return its counts. Fails when no record
    has reached disk for ``stall`` seconds: a machine loaded by other tests slows a run without
    stopping it, so the bound is on a stall, and pytest's timeout bounds the whole. The counts are
    genq's own query (genq/progress.py) read in this process, every 50 ms: a `genq status` process
    per look is slow enough on a loaded machine to miss a fast run's middle."""
    conn = redis.Redis.from_url(procs.env["GENQ_REDIS_URL"])
    keys = Keys(procs.env["GENQ_NAMESPACE"])
    last, moved = -1, time.monotonic()
    while True:
        counts = progress.dataset_counts(conn, keys)[dataset]
        if counts["done"] >= n and (counts["in_flight"] > 0 or not in_flight):
            return counts
        if in_flight and counts["done"] + counts["failed"] == counts["total"]:
            raise AssertionError(f"{dataset}: the run ended before {n} records with jobs still in flight")
        if counts["done"] != last:
            last, moved = counts["done"], time.monotonic()
        elif time.monotonic() - moved > stall:
            raise AssertionError(f"{dataset}: no record on disk for {stall:.0f} s, {last} of the {n} awaited")
        time.sleep(0.05)


def check_settled(procs: Procs, dataset: str, timeout: float) -> dict:
    """Wait until every job of the checked ``dataset`` drawn so far is on disk and none is on its way
    (the check stage draws more as it judges, so the total moves until then); its counts, with
    what the check stage filed by status."""
    conn = redis.Redis.from_url(procs.env["GENQ_REDIS_URL"])
    keys = Keys(procs.env["GENQ_NAMESPACE"])
    deadline = time.monotonic() + timeout
    while True:
        counts = progress.dataset_counts(conn, keys)[dataset]
        if (
            counts["total"]
            and counts["done"] + counts["failed"] == counts["total"]
            and not counts["in_flight"]
        ):
            return {**counts, "verdicts": progress.check_counts(conn, keys, dataset)}
        assert time.monotonic() < deadline, f"{dataset} not settled in {timeout:.0f} s: {counts}"
        time.sleep(0.1)


def finish_run(procs: Procs, dataset: str, total: int, stall: float, *roles: subprocess.Popen) -> None:
    """Wait until all ``total`` records of ``dataset`` are on disk (failing on a ``stall`` of that
    many seconds), then SIGTERM each role (workers, collectors): each must exit 0."""
    wait_for_records(procs, dataset, total, stall)
    for proc in roles:
        assert stop(proc, timeout=60) == 0, log_of(proc)
