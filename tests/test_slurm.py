"""genq on a real Slurm cluster (tests/slurm_cluster.py: two nodes with two fake GPUs each), through
the project's own path, `genq slurm submit`, with the simulator as the server command. Mid-run a
node job gets its warning signal and drains, one is scancelled, one requeued, and a job with a
one-minute --time reaches its limit; every prompt still ends on disk exactly once."""

from __future__ import annotations

import contextlib
import re
import shlex
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import (
    assert_verified,
    check_records,
    read_jsonl,
    sim_stats,
    status_json,
    wait_until,
    write_prompts,
)
from tests.slurm_cluster import SlurmCluster, slurm_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(600)]

N = 2000
CONCURRENCY = 8
GRACE = 15  # the worker's drain; a generation here takes about 1 s (64 tokens of 20 ms at most)
SIM = {"min_len": 16, "max_len": 64}
PARAMS = {"max_new_tokens": 200}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[SlurmCluster]:
    c = slurm_cluster(tmp_path_factory.mktemp("slurm"))
    yield c
    c.stop()


def _server_cmd() -> str:
    """The simulator, run by this test's Python (the jobs get PYTHONPATH through --export=ALL)."""
    argv = [sys.executable, "-m", "genq", "sim-server", "--port", "{port}", "--latency", "realistic"]
    argv += ["--min-len", str(SIM["min_len"]), "--max-len", str(SIM["max_len"])]
    return shlex.join(argv).replace("'{port}'", "{port}")


class Generations:
    """The simulators' /sim/stats generations, polled while they run: a server stopped or killed
    takes its stats with it, so this keeps the last count seen of each (the URLs from the node logs)."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.seen: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.3):
            for log in self.logs.glob("node-*.log"):
                for url in re.findall(r"server ready at (\S+)", log.read_text(errors="replace")):
                    with contextlib.suppress(OSError):  # stopped
                        self.seen[url] = max(self.seen.get(url, 0), sim_stats(url)["generations"])

    def total(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return sum(self.seen.values())


def test_a_genq_run_on_slurm_survives_drains_cancels_requeues_and_time_limits(
    cluster: SlurmCluster, procs, namespace, tmp_path, out, report
):
    env = {**procs.env, **cluster.env}
    procs.env = env
    logs = tmp_path / "slurm-logs"
    data = tmp_path / "big.jsonl"
    prompts = write_prompts(data, N)
    assert procs.run("enqueue", data, "--max-new-tokens", str(PARAMS["max_new_tokens"])).returncode == 0

    def submit(*flags: str) -> list[str]:
        res = procs.run(
            "slurm", "submit", "--server-cmd", _server_cmd(), "--logs", logs, "--grace", str(GRACE),
            "--health-timeout", "60", *flags, "--", "--concurrency", str(CONCURRENCY),
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        return re.findall(r"submitted \w+ job (\d+)", res.stdout)

    def state(job: str) -> str:
        return cluster.job(job).get("JobState", "")

    def running(job: str) -> bool:
        return state(job) == "RUNNING"

    def done() -> int:
        return status_json(procs)["datasets"]["big"]["done"]

    def worker_of(job: str) -> dict | None:
        return next((w for w in status_json(procs)["workers"] if w["slurm_job"] == job), None)

    def serving(job: str) -> bool:
        w = worker_of(job)
        return bool(w and w["in_flight"])

    def start_now(job: str) -> None:
        """A requeued job waits 121 s (BeginTime) before it may start again; start it now."""
        wait_until(lambda: state(job) == "PENDING", 60, f"{job} pending again", interval=0.3)
        cluster.run("scontrol", "update", f"jobid={job}", "StartTime=now")
        wait_until(lambda: running(job), 60, f"{job} running again", interval=0.3)

    gens = Generations(logs)
    array, collector = submit("--name", "gen", "--servers", "4", "--out", str(out))
    tasks = [f"{array}_{i}" for i in range(4)]
    wait_until(lambda: all(map(serving, tasks)), 120, "four node jobs serving", interval=0.5)
    first = {job: worker_of(job)["name"] for job in tasks}
    assert running(collector)
    nodes = {cluster.job(t)["NodeList"] for t in tasks}
    assert nodes == {"gpu1", "gpu2"}, nodes  # two servers per node, side by side

    # 1. The time-limit warning (delivered now, as Slurm does with --signal=B:TERM@N): the worker
    # drains within the grace, the server stops, and the job requeues itself: work is left.
    warned = time.monotonic()
    cluster.run("scancel", "--batch", "--signal=TERM", tasks[0])
    wait_until(lambda: not running(tasks[0]), GRACE + 45, "the warned job to drain", interval=0.2)
    report(f"slurm: warned node job drained and left RUNNING in {time.monotonic() - warned:.1f} s")
    start_now(tasks[0])

    # 2. scancel outright: SIGTERM to every process of the job (worker and server), SIGKILL after
    # KillWait. The job is CANCELLED and does not come back; its jobs go back to the queue.
    cluster.run("scancel", tasks[1])
    wait_until(lambda: state(tasks[1]) == "CANCELLED", 60, "the scancelled job gone", interval=0.3)

    # 3. Requeued by an operator (or a preemption with PreemptMode=REQUEUE): back, takes jobs again.
    cluster.run("scontrol", "requeue", tasks[2])
    start_now(tasks[2])

    # 4. A job with a one-minute limit on the GPU the scancel freed: its warning comes 40 s before the
    # limit (give or take Slurm's 30 s check), it drains and requeues itself before Slurm kills it.
    (short_array,) = submit(
        "--name", "short", "--servers", "1", "--time", "1", "--signal-margin", "25", "--no-collector"
    )
    short = f"{short_array}_0"
    wait_until(lambda: serving(short), 90, "the short job serving", interval=0.5)
    began = time.monotonic()
    wait_until(lambda: not running(short), 90, "the short job's time-limit warning", interval=0.5)
    report(
        f"slurm: the 1-minute job drained on its warning and left RUNNING {time.monotonic() - began:.0f} s in"
    )
    assert state(short) != "TIMEOUT", "it drained before its limit"
    start_now(short)

    wait_until(lambda: state(collector) == "COMPLETED", 300, "the collector to finish last", interval=1)
    for job in (*tasks, short):
        if state(job) == "PENDING":  # requeued while work was left: starts, finds none, exits
            cluster.run("scontrol", "update", f"jobid={job}", "StartTime=now")
        wait_until(
            lambda job=job: state(job) in ("COMPLETED", "CANCELLED"), 90, f"{job} to end", interval=0.5
        )
    total_generations = gens.total()

    records = check_records(out, "big", prompts, PARAMS, **SIM)
    assert not read_jsonl(out / "big" / "errors.jsonl")
    assert_verified(procs, out, data)
    states = {job: (state(job), cluster.job(job).get("Restarts")) for job in (*tasks, short, collector)}
    report(f"slurm: final states {states}")
    assert [states[t][0] for t in tasks] == ["COMPLETED", "CANCELLED", "COMPLETED", "COMPLETED"], states
    assert states[tasks[0]][1] == states[tasks[2]][1] == "1", states
    assert states[short][0] == "COMPLETED" and int(states[short][1]) >= 1, states
    drains = re.findall(
        r"draining \d+ in flight.*|grace over.*|put \d+ jobs.*", (logs / f"node-{tasks[0]}.log").read_text()
    )
    report(f"slurm: the warned job's worker: {drains}")
    by_worker = {r["worker"] for r in records}
    assert first[tasks[0]] in by_worker and first[tasks[3]] in by_worker
    # Waste: generations paid for beyond one per prompt. Drains waste nothing (the grace covers a
    # generation); the scancel and the requeue kill a server with up to CONCURRENCY in flight. The
    # servers' counts were polled, so the kills' last moments may be missing: a lower bound of the
    # generations, checked against the bound of what the kills may have wasted.
    report(f"slurm: {total_generations} generations seen for {N} prompts")
    assert total_generations <= N + 2 * CONCURRENCY, total_generations
    assert not cluster.job_processes(), "a process of a job outlived it"
