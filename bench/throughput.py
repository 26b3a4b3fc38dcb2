"""End-to-end throughput of genq: producer -> Redis -> workers -> simulator -> collector -> JSONL.

Run it from the repository root with the project's venv:

    python bench/throughput.py            # full sizes, ~6-7 minutes on 2 cores
    python bench/throughput.py --quick    # every N divided by 5
    python bench/throughput.py --repeat 3 # each configuration 3 times, medians reported

Every process is real (a private redis-server, `genq sim-server`, `genq worker`, `genq collect`),
so the numbers include Redis round trips, HTTP and fsync. Small machines are noisy: compare the
ratio column of one run rather than absolute numbers across runs. The realistic rows are bound by
the simulator's latency model (a decode step of 20 ms * (1 + batch / 64)), the zero-latency rows
by CPU. Results also go to bench/results/throughput.json.
"""

from __future__ import annotations

import argparse
import calendar
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson
from redis import Redis
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import cpu_s, kill_children, machine, write_prompts  # noqa: E402
from genq.commands.embedded import EmbeddedRedis  # noqa: E402
from genq.commands.processes import genq_command, spawn, wait_for_line  # noqa: E402
from genq.keys import Keys  # noqa: E402

TIMEOUT_S = 300.0
EARLY_S = 10  # first_seconds' window
ZERO = ("--latency", "zero", "--min-len", "16", "--max-len", "128")
REALISTIC = ("--latency", "realistic", "--min-len", "32", "--max-len", "256")
console = Console(width=max(shutil.get_terminal_size().columns, 132))


@dataclass(frozen=True)
class Engine:
    """A real server already running, for run_once instead of a simulator."""

    url: str
    pid: int | None  # its process, for the CPU column
    prompts: list[list[int]]  # token ids of its vocabulary, cycled through
    worker_flags: tuple[str, ...] = ()  # e.g. ("--backend", "sglang")


@dataclass(frozen=True)
class Config:
    name: str
    sim_flags: tuple[str, ...]
    workers: int
    concurrency: int | str  # or "auto"
    jobs: int
    max_new_tokens: int
    baseline: str  # the row the ratio column divides by


CONFIGS = [
    Config("zero-1w", ZERO, 1, 128, 5000, 128, "zero-1w"),
    Config("zero-2w", ZERO, 2, 128, 5000, 128, "zero-1w"),
    Config("real-1w", REALISTIC, 1, 128, 1500, 256, "real-1w"),
    Config("real-2w", REALISTIC, 2, 128, 1500, 256, "real-1w"),
    Config("real-1w-c16", REALISTIC, 1, 16, 500, 256, "real-1w"),
]


def reap(procs: list[subprocess.Popen], deadline: float) -> dict[int, float]:
    """Wait for every process, bounded; CPU seconds of each from os.wait4's rusage."""
    cpu: dict[int, float] = {}
    while len(cpu) < len(procs):
        for p in procs:
            if p.pid in cpu:
                continue
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                p.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait again
                cpu[p.pid] = ru.ru_utime + ru.ru_stime
        if time.monotonic() > deadline:
            raise TimeoutError(f"processes still running after {TIMEOUT_S:.0f} s")
        time.sleep(0.02)
    return cpu


def first_seconds(records: list[dict], started: float) -> dict:
    """Completion tok/s and p50 latency of the records finished in the run's first EARLY_S seconds
    (``finished_at`` has a resolution of one second, so the window is whole seconds from the one
    the workers started in): how fast a run is from its start (``--concurrency auto`` ramping)."""
    start = int(started)
    early = [
        r
        for r in records
        if calendar.timegm(time.strptime(r["finished_at"], "%Y-%m-%dT%H:%M:%SZ")) < start + EARLY_S
    ]
    if not early:
        return {"early_tok_per_s": 0.0, "early_p50_s": None}
    latencies = sorted(r["latency_s"] for r in early)
    return {
        "early_tok_per_s": sum(r["completion_tokens"] for r in early) / EARLY_S,
        "early_p50_s": latencies[len(latencies) // 2],
    }


def log_issues(logs: Path) -> list[str]:
    """WARNING/ERROR/Traceback lines of every log of a run: they should be rare in a clean run."""
    found = []
    for log in sorted(logs.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if any(w in line for w in ("WARNING", "ERROR", "Traceback", "CRITICAL")):
                found.append(f"{log.name}: {line.strip()[:200]}")
    return found


def run_once(
    cfg: Config,
    redis: EmbeddedRedis,
    work: Path,
    children: list[subprocess.Popen],
    measure_sim: Callable[[str], dict] | None = None,
    engine: Engine | None = None,
) -> dict:
    """One configuration end to end in a fresh namespace and simulator (or on ``engine``, a real
    server already running); its measurements (with ``measure_sim``'s of the server's URL, taken
    when the run ends, before a simulator stops)."""
    # A unique dataset name too, not only a namespace: RQ job ids are "<dataset>-<row>" with no
    # namespace, so a second run of dataset "bench" inherits the 60 s expiry of the previous
    # run's finished job hashes and those jobs silently vanish (a genq bug).
    dataset = f"{cfg.name}-{uuid.uuid4().hex[:8]}"
    ns = f"bench-{dataset}"
    run_dir = work / ns
    logs, out = run_dir / "logs", run_dir / "out"
    logs.mkdir(parents=True)
    env = {"GENQ_REDIS_URL": redis.url, "GENQ_NAMESPACE": ns}

    def start(name: str, *args: str) -> subprocess.Popen:
        with open(logs / f"{name}.log", "wb") as fh:
            proc = spawn(genq_command(*args), env=env, stdout=fh, stderr=subprocess.STDOUT)
        children.append(proc)
        return proc

    sim: subprocess.Popen | None = None
    if engine is None:
        with open(logs / "sim.log", "wb") as fh:
            sim = spawn(
                genq_command("sim-server", "--port", "0", *cfg.sim_flags), stdout=subprocess.PIPE, stderr=fh
            )
        children.append(sim)
        server = wait_for_line(sim, "sim-server listening on ", 30).rsplit(" ", 1)[1]
    else:
        server = engine.url
    prompts = run_dir / "prompts.jsonl"
    write_prompts(prompts, cfg.jobs, None if engine is None else engine.prompts)
    argv = genq_command(
        "enqueue", str(prompts), "--dataset", dataset, "--max-new-tokens", str(cfg.max_new_tokens)
    )
    res = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=TIMEOUT_S)
    if res.returncode != 0:
        raise RuntimeError(f"enqueue failed ({res.returncode}): {res.stderr[-2000:]}")

    # The collector's start-up (imports, lease, reconcile) is not part of the measured time.
    collector = start("collector", "collect", "--out", str(out), "--burst")
    conn, keys = Redis.from_url(redis.url), Keys(ns)
    deadline = time.monotonic() + 60
    ready = (keys.collector_lease(dataset), keys.collector_ready(dataset))
    while (lease := conn.get(ready[0])) is None or lease != conn.get(ready[1]):
        if collector.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"collector not ready; see {logs / 'collector.log'}")
        time.sleep(0.05)

    assert redis.proc is not None
    server_pid = sim.pid if sim is not None else engine.pid if engine is not None else None
    sim_cpu0, redis_cpu0 = cpu_s(server_pid) if server_pid else 0.0, cpu_s(redis.proc.pid)
    worker_flags = ("--concurrency", str(cfg.concurrency), *(engine.worker_flags if engine else ()))
    t0, started = time.monotonic(), time.time()
    workers = [
        start(f"worker-{i}", "worker", "--server", server, "--burst", *worker_flags)
        for i in range(cfg.workers)
    ]
    cpu = reap([*workers, collector], t0 + TIMEOUT_S)
    wall = time.monotonic() - t0
    sim_cpu = cpu_s(server_pid) - sim_cpu0 if server_pid else 0.0
    redis_cpu = cpu_s(redis.proc.pid) - redis_cpu0
    of_sim = measure_sim(server) if measure_sim is not None else {}
    if sim is not None:
        sim.kill()
        sim.wait(10)
    bad = {f"{p.args[3]}-{p.pid}": p.returncode for p in [*workers, collector] if p.returncode != 0}
    if bad:
        raise RuntimeError(f"non-zero exits {bad}; logs in {logs}")

    raw = out / dataset / "raw_responses.jsonl"
    records = [orjson.loads(line) for line in raw.read_bytes().splitlines()] if raw.exists() else []
    unique = len({r["id"] for r in records})
    if len(records) != cfg.jobs or unique != cfg.jobs:
        raise RuntimeError(f"{len(records)} lines, {unique} unique ids, expected {cfg.jobs}; see {out}")
    tokens = sum(r["completion_tokens"] for r in records)
    latencies = sorted(r["latency_s"] for r in records)
    worker_cpu = sum(cpu[p.pid] for p in workers)
    issues = log_issues(logs)
    early = first_seconds(records, started)
    return {
        "wall_s": wall,
        "jobs_per_s": cfg.jobs / wall,
        "completion_tok_per_s": tokens / wall,
        "completion_tokens": tokens,
        "latency_p50_s": latencies[len(latencies) // 2],
        "latency_p99_s": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "worker_cpu_ms_per_job": 1000 * worker_cpu / cfg.jobs,
        "collector_cpu_s": cpu[collector.pid],
        "sim_cpu_s": sim_cpu,
        "redis_cpu_s": redis_cpu,
        "log_issues": len(issues),
        "log_issue_sample": issues[:5],
        **early,
        **of_sim,
    }


def summarize(cfg: Config, runs: list[dict]) -> dict:
    """Median of each numeric measurement over the repeats."""
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    med = {k: statistics.median(r[k] for r in runs) for k in keys}
    return {"config": cfg.__dict__, "median": med, "runs": runs}


def print_table(results: dict[str, dict]) -> None:
    table = Table(
        title="genq throughput (median over repeats)",
        caption="ratio: jobs/s over zero-1w (zero-latency rows) or real-1w (realistic rows)",
    )
    cols = ("config", "workers", "concurrency", "jobs", "wall s", "jobs/s", "completion tok/s")
    for col in (*cols, "worker CPU ms/job", "ratio"):
        table.add_column(col, justify="left" if col == "config" else "right")
    for name, res in results.items():
        cfg, m = res["config"], res["median"]
        base = results.get(cfg["baseline"])
        ratio = m["jobs_per_s"] / base["median"]["jobs_per_s"] if base else float("nan")
        counts = [str(cfg[k]) for k in ("workers", "concurrency", "jobs")]
        rates = (f"{m['jobs_per_s']:.1f}", f"{m['completion_tok_per_s']:.0f}")
        cpu = f"{m['worker_cpu_ms_per_job']:.2f}"
        table.add_row(name, *counts, f"{m['wall_s']:.2f}", *rates, cpu, f"{ratio:.2f}x")
    console.print(table)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="divide every N by 5")
    parser.add_argument("--repeat", type=int, default=1, help="runs per configuration; medians reported")
    parser.add_argument("--keep", action="store_true", help="keep logs and outputs in the temp folder")
    args = parser.parse_args()
    configs = [Config(**{**c.__dict__, "jobs": c.jobs // 5}) if args.quick else c for c in CONFIGS]

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # Explicitly, also SIGINT: a shell starts background jobs with SIGINT ignored.
    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    work = Path(tempfile.mkdtemp(prefix="genq-bench-"))
    children: list[subprocess.Popen] = []
    server = EmbeddedRedis(work / "redis")
    runs: dict[str, list[dict]] = {c.name: [] for c in configs}
    ok = False
    try:
        server.start()
        # Round-robin over the repeats: slow drift of the machine hits every configuration alike.
        for rep in range(args.repeat):
            for cfg in configs:
                console.print(f"[{rep + 1}/{args.repeat}] {cfg.name}: {cfg.jobs} jobs ...", end=" ")
                res = run_once(cfg, server, work, children)
                console.print(
                    f"{res['wall_s']:.1f} s, {res['jobs_per_s']:.0f} jobs/s, {res['log_issues']} log issues"
                )
                for line in res["log_issue_sample"]:
                    console.print(f"    [yellow]{line}[/yellow]")
                runs[cfg.name].append(res)
        ok = True
    except KeyboardInterrupt:
        console.print("\ninterrupted")
        return 130
    finally:
        kill_children(children)
        server.stop()
        if ok and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            console.print(f"logs and outputs kept in {work}")

    results = {c.name: summarize(c, runs[c.name]) for c in configs}
    print_table(results)
    dest = Path(__file__).resolve().parent / "results" / "throughput.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    meta = {"quick": args.quick, "repeat": args.repeat}
    dest.write_text(json.dumps({"machine": machine(), **meta, "results": results}, indent=2) + "\n")
    console.print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
