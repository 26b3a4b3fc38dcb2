"""The cluster ceiling: CPU per job of each role (worker, collector, Redis), beside a bare client.

    python bench/ceiling.py                   # 2,000 prompts, 128 in flight, ~1 minute
    python bench/ceiling.py --prompts 5000 --enqueue 100000
    python bench/ceiling.py --soak 100000     # the long run: two workers, --max-queued, flat memory

One simulated SGLang server with a continuous-batching latency model (a step of 16 tokens costs
30 ms + 0.1 ms per running sequence), pre-tokenized prompts, at most 256 new tokens. First a bare
aiohttp client (bench/bare_client.py) sends every prompt (128 in flight) and waits for all
answers, in this process and then as a process of its own timed from spawn to exit; then genq does
the same work end to end: a private redis-server, the queue prefilled by `genq enqueue`, one `genq
worker --burst` and one `genq collect --burst`, timed from the worker's spawn until both
processes have exited. Against the bare client in process, genq's wall time also holds Python's
start-up and imports; against the bare process both sides pay them. CPU per job is counted per
process from the moment it was ready (its imports and start-up are not per-job costs); Redis's
from its own /proc counters.

Also measured: the enqueue rate (``--enqueue`` prompts through ``enqueue_dataset``, in process, so
Python's start-up is not in it), the Redis memory of a queued job beyond its prompt ids, and the
ceiling: the jobs/s one Redis core and one collector process can carry at the measured CPU per
job. Results go to bench/results/ceiling.json (or ceiling-soak.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

import orjson
from redis import Redis
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bare_client import send_all  # noqa: E402
from bench.common import cpu_s, kill_children, machine, write_prompts  # noqa: E402
from genq.commands.embedded import EmbeddedRedis  # noqa: E402
from genq.commands.processes import genq_command, spawn, wait_for_line  # noqa: E402
from genq.connection import HASH_VALUE_LIMIT  # noqa: E402
from genq.keys import Keys  # noqa: E402

# 16 tokens per step at 30 ms + 0.1 ms per running sequence: 1.875 ms a token, knee at 300.
SIM = ("--latency", "realistic", "--decode-step-ms", "1.875", "--batch-knee", "300")
SIM_TICK = ("--tokens-per-tick", "16", "--min-len", "32", "--max-len", "256")
ZERO = ("--latency", "zero", "--min-len", "16", "--max-len", "64")
TIMEOUT_S = 900.0
console = Console(width=132)


def bare(url: str, prompts: list[list[int]], max_new: int, concurrency: int) -> tuple[float, float]:
    """The bare client in this process (its imports already paid): (wall s, CPU s)."""
    cpu0, t0 = time.process_time(), time.monotonic()
    asyncio.run(send_all(url, prompts, max_new, concurrency))
    return time.monotonic() - t0, time.process_time() - cpu0


def bare_process(url: str, data: Path, max_new: int, concurrency: int) -> tuple[float, float]:
    """The bare client as a process of its own, timed like genq's from spawn to exit (Python's
    start-up and aiohttp's import included): (wall s, CPU s)."""
    script = ROOT / "bench" / "bare_client.py"
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(script), url, str(data), str(max_new), str(concurrency)])
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait again
    if proc.returncode:
        raise RuntimeError(f"the bare client exited with {proc.returncode}")
    return wall, usage.ru_utime + usage.ru_stime


class Cluster:
    """A private redis-server and a simulator; genq's processes started against them."""

    def __init__(self, work: Path, sim_flags: tuple[str, ...]):
        self.work = work
        self.redis = EmbeddedRedis(work / "redis")
        self.redis.start()
        self.conn = Redis.from_url(self.redis.url)
        self.children: list[subprocess.Popen] = []
        self.sim = self.start("sim", "sim-server", "--port", "0", *sim_flags, stdout=subprocess.PIPE)
        self.server = wait_for_line(self.sim, "sim-server listening on ", 30).rsplit(" ", 1)[1]

    def env(self, ns: str) -> dict[str, str]:
        return {"GENQ_REDIS_URL": self.redis.url, "GENQ_NAMESPACE": ns}

    def start(self, name: str, *args: str, ns: str = "bench", stdout: int | None = None) -> subprocess.Popen:
        log = open(self.work / f"{name}.log", "ab")  # noqa: SIM115 - the child holds it
        proc = spawn(genq_command(*args), env=self.env(ns), stdout=stdout or log, stderr=log)
        self.children.append(proc)
        return proc

    def redis_cpu(self) -> float:
        assert self.redis.proc is not None
        return cpu_s(self.redis.proc.pid)

    def close(self) -> None:
        kill_children(self.children)
        self.redis.stop()


def ready_cpu(proc: subprocess.Popen, log: Path, line: str, deadline: float) -> float:
    """The process's CPU seconds when ``line`` appears in its log: its start-up, not per job."""
    while line not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args} never logged {line!r}; see {log}")
        time.sleep(0.01)
    return cpu_s(proc.pid)


def reaped(procs: list[subprocess.Popen], ended: dict[int, tuple[float, float]]) -> bool:
    """Collect the processes that exited since the last call: (exit time, CPU seconds from
    os.wait4) of each into ``ended``; whether all have."""
    for p in procs:
        if p.pid not in ended:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                p.returncode = os.waitstatus_to_exitcode(status)  # Popen must not wait again
                ended[p.pid] = (time.monotonic(), ru.ru_utime + ru.ru_stime)
    return len(ended) == len(procs)


def profile(proc: subprocess.Popen, prefix: Path) -> list[subprocess.Popen]:
    """py-spy sampling ``proc`` from now (its start-up is behind it) until it exits, without pausing
    it (--nonblocking): its collapsed stacks (``prefix``.txt, a stack and its sample count per line,
    what :func:`top_frames` reads; speedscope and flamegraph.pl open it) and a flame graph
    (``prefix``.svg). py-spy writes one format per run, so two samplers."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    spy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if spy is None:
        raise SystemExit("--profile needs py-spy: pip install 'genq[bench]'")
    base = [spy, "record", "--gil", "--rate", "500", "--pid", str(proc.pid)]
    return [
        subprocess.Popen([*base, "--format", fmt, "--output", f"{prefix}.{ext}"], stdout=subprocess.DEVNULL)
        for fmt, ext in (("raw", "txt"), ("flamegraph", "svg"))
    ]


def top_frames(collapsed: Path, n: int = 5) -> list[tuple[str, float, float]]:
    """The ``n`` functions with the most samples of their own (self), from py-spy's collapsed
    stacks: (function and file, self share, inclusive share: samples with it anywhere on the stack).
    Idle waiting (the event loop's select) counts as a function like any other."""
    own: dict[str, int] = defaultdict(int)
    anywhere: dict[str, int] = defaultdict(int)
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [frame.rsplit(":", 1)[0] for frame in stack.split(";")[1:]]  # the first is the thread
        if not frames:
            continue
        total += int(count)
        own[frames[-1]] += int(count)
        for frame in set(frames):
            anywhere[frame] += int(count)
    ranked = sorted(own, key=own.__getitem__, reverse=True)[:n]
    return [(frame, own[frame] / total, anywhere[frame] / total) for frame in ranked]


def records_on_disk(raw: Path) -> int:
    return raw.read_bytes().count(b"\n") if raw.exists() else 0


def run_genq(cluster: Cluster, data: Path, n: int, args: argparse.Namespace, workers: int = 1) -> dict:
    """Prefill the queue, then a collector and ``workers`` workers in --burst until they exit."""
    ns, dataset = f"b{uuid.uuid4().hex[:6]}", data.stem
    out = cluster.work / ns
    enq = ["enqueue", str(data), "--max-new-tokens", str(args.max_new_tokens)]
    if args.soak:
        enq += ["--max-queued", str(args.max_queued)]
    enqueue = cluster.start(f"{ns}-enqueue", *enq, ns=ns)
    if not args.soak and enqueue.wait(TIMEOUT_S) != 0:
        raise RuntimeError(f"enqueue failed; see {cluster.work}")
    deadline = time.monotonic() + TIMEOUT_S
    # A --burst collector started before anything is enqueued has nothing to do and exits.
    while not cluster.conn.hexists(Keys(ns).datasets, dataset):
        if enqueue.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"enqueue registered nothing; see {cluster.work}")
        time.sleep(0.05)
    collector = cluster.start(f"{ns}-collector", "collect", "--out", str(out), "--burst", ns=ns)
    collector_log = cluster.work / f"{ns}-collector.log"
    collector_cpu0 = ready_cpu(collector, collector_log, "holds dataset", deadline)
    cluster.conn.config_resetstat()
    redis_cpu0, t0 = cluster.redis_cpu(), time.monotonic()
    burst = ("--burst", "--concurrency", str(args.concurrency))
    procs = [
        cluster.start(f"{ns}-worker{i}", "worker", "--server", cluster.server, *burst, ns=ns)
        for i in range(workers)
    ]
    worker_cpu0 = [
        ready_cpu(p, cluster.work / f"{ns}-worker{i}.log", "serving", deadline) for i, p in enumerate(procs)
    ]
    started = time.monotonic() - t0
    named = {f"worker{i}": p for i, p in enumerate(procs)} | {"collector": collector}
    profilers = (
        [s for name, proc in named.items() for s in profile(proc, args.profile / name)]
        if args.profile
        else []
    )
    raw = out / dataset / "raw_responses.jsonl"
    last_record = None
    memory: list[int] = []
    ended: dict[int, tuple[float, float]] = {}
    sampled = 0.0
    while not reaped([*procs, collector], ended):
        if last_record is None and records_on_disk(raw) >= n:
            last_record = time.monotonic() - t0
        if args.soak and time.monotonic() - sampled >= 1.0:
            memory.append(int(cluster.conn.info("memory")["used_memory"]))
            sampled = time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError("genq's processes did not exit")
        time.sleep(0.005)
    redis_cpu = cluster.redis_cpu() - redis_cpu0
    for profiler in profilers:
        profiler.wait(60)  # it writes its files once the process it samples has exited
    commands = {
        name.removeprefix("cmdstat_"): {"calls_per_job": c["calls"] / n, "us_per_job": c["usec"] / n}
        for name, c in cluster.conn.info("commandstats").items()
    }
    if last_record is None:
        last_record = ended[collector.pid][0] - t0
    if any(p.returncode != 0 for p in [*procs, collector]) or (args.soak and enqueue.wait(60) != 0):
        raise RuntimeError(f"a genq process failed; see {cluster.work}")
    lines = raw.read_bytes().splitlines()
    ids = [orjson.loads(line)["id"] for line in lines]
    if len(ids) != n or len(set(ids)) != n:
        raise RuntimeError(f"{len(ids)} records, {len(set(ids))} distinct, expected {n}")
    worker_cpu = sum(ended[p.pid][1] - c for p, c in zip(procs, worker_cpu0, strict=True))
    return {
        "wall_last_record_s": last_record,
        "wall_exit_s": max(t for t, _ in ended.values()) - t0,
        "worker_exit_s": max(ended[p.pid][0] for p in procs) - t0,
        "collector_exit_s": ended[collector.pid][0] - t0,
        "worker_startup_s": started,
        "worker_cpu_ms_per_job": 1000 * worker_cpu / n,
        "collector_cpu_ms_per_job": 1000 * (ended[collector.pid][1] - collector_cpu0) / n,
        "redis_cpu_ms_per_job": 1000 * redis_cpu / n,
        "redis_commands": dict(sorted(commands.items(), key=lambda kv: -kv[1]["us_per_job"])),
        "redis_memory_mb": {
            "min": min(memory) / 2**20,
            "max": max(memory) / 2**20,
            "by_quarter": [round(memory[len(memory) * q // 4 - (q == 4)] / 2**20, 1) for q in (1, 2, 3, 4)],
        }
        if memory
        else None,
    }


def measure_enqueue(cluster: Cluster, n: int) -> dict:
    """Enqueue rate in process, and the Redis bytes a queued job costs beyond its prompt ids: with
    genq's Redis settings (docs/cluster.md), then again with Redis's default hash encoding."""
    from genq.producer.enqueue import Options, enqueue_dataset

    data = cluster.work / "enqueue.jsonl"
    ids_bytes = sum(len(orjson.dumps(ids)) for ids in write_prompts(data, n))
    out: dict = {"prompts": n}
    for setting, limit in (("", HASH_VALUE_LIMIT), ("_redis_default", 64)):
        cluster.conn.config_set("hash-max-listpack-value", limit)
        keys = Keys(f"e{uuid.uuid4().hex[:6]}")
        before = int(cluster.conn.info("memory")["used_memory"])
        t0 = time.perf_counter()
        summary = enqueue_dataset(
            cluster.conn, keys, [data], "enqueue", {"max_new_tokens": 256}, 1, Options()
        )
        seconds = time.perf_counter() - t0
        assert summary.enqueued == n, summary
        after = int(cluster.conn.info("memory")["used_memory"])
        if not setting:
            out |= {"seconds": seconds, "prompts_per_s": n / seconds}
        out |= {
            f"bytes_per_job{setting}": (after - before) / n,
            f"bytes_per_job_beyond_ids{setting}": (after - before - ids_bytes) / n,
        }
    cluster.conn.config_set("hash-max-listpack-value", HASH_VALUE_LIMIT)
    return out


def report(
    args: argparse.Namespace,
    in_process: tuple[float, float],
    process: tuple[float, float],
    genq: dict,
    enq: dict,
) -> dict:
    n = args.prompts
    (bare_wall, bare_cpu), (process_wall, process_cpu) = in_process, process
    title = f"{n} prompts, {args.concurrency} in flight, at most {args.max_new_tokens} new tokens"
    table = Table(title=title)
    columns = ("client", "wall s (last record)", "wall s (exit)", "vs bare (exit)", "vs bare process")
    for col in (*columns, "CPU ms/job"):
        table.add_column(col, justify="right")
    bare_ms = f"{1000 * bare_cpu / n:.2f}"
    table.add_row("bare aiohttp, in process", f"{bare_wall:.2f}", f"{bare_wall:.2f}", "1.00", "", bare_ms)
    table.add_row(
        "bare aiohttp, a process",
        "",
        f"{process_wall:.2f}",
        f"{bare_wall / process_wall:.2f}",
        "1.00",
        f"{1000 * process_cpu / n:.2f} (start-up included)",
    )
    per_job = {role: genq[f"{role}_cpu_ms_per_job"] for role in ("worker", "collector", "redis")}
    table.add_row(
        "genq",
        f"{genq['wall_last_record_s']:.2f}",
        f"{genq['wall_exit_s']:.2f}",
        f"{bare_wall / genq['wall_exit_s']:.2f}",
        f"{process_wall / genq['wall_exit_s']:.2f}",
        " + ".join(f"{role} {ms:.2f}" for role, ms in per_job.items()),
    )
    console.print(table)
    ceiling = {
        "redis_jobs_per_s": 1000 / per_job["redis"],
        "collector_jobs_per_s": 1000 / per_job["collector"],
    }
    console.print(
        f"enqueue: {enq['prompts_per_s']:,.0f} prompts/s; a queued job: {enq['bytes_per_job']:,.0f} B "
        f"of Redis, {enq['bytes_per_job_beyond_ids']:,.0f} B beyond its prompt ids "
        f"({enq['bytes_per_job_beyond_ids_redis_default']:,.0f} B with Redis's default "
        "hash-max-listpack-value)"
    )
    console.print(
        f"ceiling: one Redis core carries {ceiling['redis_jobs_per_s']:,.0f} jobs/s, "
        f"one collector {ceiling['collector_jobs_per_s']:,.0f} jobs/s"
    )
    return {
        "bare": {"wall_s": bare_wall, "cpu_ms_per_job": 1000 * bare_cpu / n},
        "bare_process": {"wall_s": process_wall, "cpu_ms_per_job": 1000 * process_cpu / n},
        "genq": genq,
        "wall_ratio": bare_wall / genq["wall_exit_s"],
        "wall_ratio_process": process_wall / genq["wall_exit_s"],
        "enqueue": enq,
        "ceiling": ceiling,
    }


def report_profile(folder: Path) -> dict:
    """Each sampled process's top five functions by their own samples (the flame graphs beside)."""
    out = {}
    for collapsed in sorted(folder.glob("*.txt")):
        table = Table(
            title=f"{collapsed.stem}: where its samples were (py-spy, {collapsed.with_suffix('.svg')})"
        )
        for col in ("function (file)", "self", "inclusive"):
            table.add_column(col, justify="left" if col.startswith("function") else "right")
        top = top_frames(collapsed)
        for frame, own, anywhere in top:
            table.add_row(frame, f"{own:.0%}", f"{anywhere:.0%}")
        console.print(table)
        out[collapsed.stem] = [{"function": f, "self": o, "inclusive": a} for f, o, a in top]
    return out


def soak(args: argparse.Namespace, work: Path) -> dict:
    """The long run: zero latency, two workers, --max-queued; Redis memory sampled every second."""
    cluster = Cluster(work, ZERO)
    try:
        data = work / "soak.jsonl"
        write_prompts(data, args.soak)
        args.prompts = args.soak
        result = run_genq(cluster, data, args.soak, args, workers=2)
    finally:
        cluster.close()
    mem = result["redis_memory_mb"]
    console.print(
        f"{args.soak:,} prompts, two workers, --max-queued {args.max_queued}: every id on disk once; "
        f"{args.soak / result['wall_exit_s']:,.0f} jobs/s; Redis memory {mem['min']:.1f}-{mem['max']:.1f} MB "
        f"(at each quarter of the run: {', '.join(f'{m:.0f}' for m in mem['by_quarter'])} MB)"
    )
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--enqueue", type=int, default=50_000, help="prompts for the enqueue rate")
    ap.add_argument("--soak", type=int, default=0, help="run the long soak with this many prompts instead")
    ap.add_argument("--max-queued", type=int, default=5000, help="the soak's --max-queued")
    ap.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="sample the worker and the collector with py-spy (pip install genq[bench]) into this folder",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="genq-ceiling-") as tmp:
        work = Path(tmp)
        if args.soak:
            result = {"soak": soak(args, work)}
            name = "ceiling-soak.json"
        else:
            cluster = Cluster(work, SIM + SIM_TICK)
            try:
                data = work / "ceiling.jsonl"
                prompts = write_prompts(data, args.prompts)
                bare(cluster.server, prompts[:100], args.max_new_tokens, args.concurrency)  # warm up
                bare_wall, bare_cpu = bare(cluster.server, prompts, args.max_new_tokens, args.concurrency)
                process = bare_process(cluster.server, data, args.max_new_tokens, args.concurrency)
                genq = run_genq(cluster, data, args.prompts, args)
                enq = measure_enqueue(cluster, args.enqueue)
            finally:
                cluster.close()
            result = report(args, (bare_wall, bare_cpu), process, genq, enq)
            if args.profile:
                result["profile"] = report_profile(args.profile)
            name = "ceiling.json"
    dest = ROOT / "bench" / "results" / name
    dest.write_text(
        json.dumps({"machine": machine(), "args": vars(args), **result}, indent=2, default=str) + "\n"
    )
    console.print(f"written to {dest.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
