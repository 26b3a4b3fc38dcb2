"""genq on a real Slurm cluster (tests/slurm_cluster.py: two nodes with two fake GPUs each), through
the project's own path, `genq slurm submit`, with the simulator as the server command. Mid-run a
node job gets its warning signal and drains, one is scancelled, one requeued, and a job with a
one-minute --time reaches its limit; every prompt still ends on disk exactly once."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import (
    assert_verified,
    check_records,
    log_of,
    need,
    read_jsonl,
    sim_stats,
    started_jobs,
    status_json,
    stop,
    wait_until,
    write_prompts,
)
from tests.slurm_cluster import SlurmCluster, slurm_cluster

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


def test_submit_renders_scripts_that_shellcheck_clean_and_hold_no_secret(procs, tmp_path):
    shellcheck = need("shellcheck")
    res = procs.run(
        "slurm", "submit", "--servers", "3", "--gpus-per-server", "2", "--server-cmd", _server_cmd(),
        "--out", tmp_path / "out", "--time", "2:00:00", "--grace", "90", "--sbatch-arg=--account=x y",
        "--dry-run", "--", "--concurrency", "64",
        env={"GENQ_REDIS_URL": "redis://:hunter2@10.0.0.2:6379"},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    node, collector = ("#!" + part for part in res.stdout.split("#!")[1:])
    for script in (node, collector):
        done = subprocess.run([shellcheck, "-s", "bash", "-"], input=script, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout
        assert "hunter2" not in script and "--export=ALL" in script
    assert "#SBATCH --array=0-2" in node and "#SBATCH --gres=gpu:2" in node
    assert "#SBATCH --signal=B:TERM@150" in node  # the grace + the 60 s margin
    assert "#SBATCH '--account=x y'" in node and "#SBATCH --time=2:00:00" in node
    exec_line = node.strip().splitlines()[-1]
    assert exec_line.startswith("exec ") and "--concurrency 64" in exec_line and "--grace=90" in exec_line
    assert collector.strip().splitlines()[-1].endswith(f"collect --burst --out {tmp_path / 'out'}")


def test_node_job_outside_slurm_stops_its_worker_when_the_server_dies_and_drains_on_sigterm(
    procs, conn, namespace, tmp_path
):
    data = tmp_path / "d.jsonl"
    write_prompts(data, 200)
    assert procs.run("enqueue", data, "--max-new-tokens", "200").returncode == 0

    def node() -> subprocess.Popen:
        return procs.start(
            "slurm", "node", "--server-cmd", _server_cmd(), "--logs", tmp_path, "--", "--concurrency", "4",
            "--grace", "5",
        )  # fmt: skip

    def in_flight() -> int:
        return status_json(procs)["datasets"]["d"]["in_flight"]

    # The server dies under the worker: the worker drains (its jobs wait for the server through the
    # grace, then go back to the queue), exit 1.
    proc = node()
    pid = int(wait_until(lambda: re.search(r"\(pid (\d+)", log_of(proc)), 60, "the server started").group(1))
    wait_until(lambda: in_flight() > 0, 60, "jobs in flight")
    os.killpg(pid, signal.SIGKILL)
    assert proc.wait(60) == 1, log_of(proc)
    assert "the server exited" in log_of(proc) and "grace over, put 4 jobs back" in log_of(proc)
    assert not started_jobs(conn, namespace, "d"), "its jobs are back in the queue"

    # SIGTERM (the warning): the worker drains, then the server is stopped; exit 0.
    proc = node()
    pid = int(wait_until(lambda: re.search(r"\(pid (\d+)", log_of(proc)), 60, "the server started").group(1))
    wait_until(lambda: in_flight() > 0, 60, "jobs in flight")
    assert stop(proc) == 0, log_of(proc)
    assert "server stopped" in log_of(proc)
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)
    assert "grace over" not in log_of(proc), "the jobs in flight finished within the grace"


@pytest.mark.slurm
@pytest.mark.timeout(600)
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

    def worker_of(job: str) -> dict | None:
        return next((w for w in status_json(procs)["workers"] if w["slurm_job"] == job), None)

    def serving(job: str) -> bool:
        w = worker_of(job)
        return bool(w and w["in_flight"])

    def start_now(job: str) -> None:
        """A requeued job waits 121 s (BeginTime) before it may start again; start it now."""
        wait_until(lambda: state(job) == "PENDING", 60, f"{job} pending again", interval=0.3)
        # slurmd revoked the last life's credential as it killed it, and refuses a credential made
        # in the same second ("Job credential revoked", the job FAILED: src/common/slurm_cred.c
        # compares whole seconds): started again within that second, the job fails for good.
        pending_at = int(time.time())
        wait_until(lambda: int(time.time()) > pending_at, 2, "the next second", interval=0.05)
        cluster.run("scontrol", "update", f"jobid={job}", "StartTime=now")
        # The scheduler passes every 2 s here (tests/slurm_cluster.py); the node may still be
        # completing the job's last life (the server's process group stopping).
        try:
            wait_until(lambda: running(job), 90, f"{job} running again", interval=0.3)
        except AssertionError as exc:
            shown = cluster.job(job)
            nodes = cluster.run("sinfo", "-N", "-h", "-o", "%N %T").stdout.replace("\n", "; ")
            why = f"{shown.get('JobState')} ({shown.get('Reason')}); nodes {nodes}"
            raise AssertionError(f"{exc}: {why}") from None

    def new_worker(job: str) -> str:
        """The worker a requeued job runs when it is back (a new one: the old drained and left)."""

        def named() -> str | None:
            w = worker_of(job)
            return w["name"] if w and w["name"] != first[job] else None

        return wait_until(named, 60, f"{job}'s worker back", interval=0.5)

    gens = Generations(logs)
    array, collector = submit("--name", "gen", "--servers", "4", "--out", str(out))
    tasks = [f"{array}_{i}" for i in range(4)]
    wait_until(lambda: all(map(serving, tasks)), 120, "four node jobs serving", interval=0.5)
    first = {job: worker_of(job)["name"] for job in tasks}
    assert running(collector)
    shown = procs.run("slurm", "status", "--name", "gen", env={"COLUMNS": "200"})
    assert shown.returncode == 0, shown.stderr
    for job in tasks:  # each Slurm job beside the genq worker it runs
        assert re.search(rf"{job} .*RUNNING.*{re.escape(first[job])}", shown.stdout), shown.stdout
    nodes = {cluster.job(t)["NodeList"] for t in tasks}
    assert nodes == {"gpu1", "gpu2"}, nodes  # two servers per node, side by side

    # 1. The time-limit warning (delivered now, as Slurm does with --signal=B:TERM@N): the worker
    # drains within the grace, the server stops, and the job requeues itself: work is left.
    warned = time.monotonic()
    cluster.run("scancel", "--batch", "--signal=TERM", tasks[0])
    wait_until(lambda: not running(tasks[0]), GRACE + 45, "the warned job to drain", interval=0.2)
    report(f"slurm: warned node job drained and left RUNNING in {time.monotonic() - warned:.1f} s")
    start_now(tasks[0])
    # Only this task came back (the first task's own job id is the array's: requeueing that id
    # would have requeued every task).
    assert [cluster.job(t).get("Restarts") for t in tasks] == ["1", "0", "0", "0"]
    back = [new_worker(tasks[0])]

    # 2. scancel outright: SIGTERM to every process of the job (worker and server), SIGKILL after
    # KillWait. The job is CANCELLED and does not come back; its jobs go back to the queue.
    killed = [worker_of(tasks[1])["in_flight"]]  # what the kill may waste: its server dies with them
    cluster.run("scancel", tasks[1])
    wait_until(lambda: state(tasks[1]) == "CANCELLED", 60, "the scancelled job gone", interval=0.3)

    # 3. Requeued by an operator (or a preemption with PreemptMode=REQUEUE): back, takes jobs again.
    killed.append(worker_of(tasks[2])["in_flight"])
    cluster.run("scontrol", "requeue", tasks[2])
    start_now(tasks[2])
    back.append(new_worker(tasks[2]))

    # 4. A job with a one-minute limit on the GPU the scancel freed: its warning comes 40 s before the
    # limit (give or take Slurm's 30 s check), it drains and requeues itself before the limit.
    (short_array,) = submit(
        "--name", "short", "--servers", "1", "--time", "1", "--signal-margin", "25", "--no-collector"
    )
    short = f"{short_array}_0"
    wait_until(lambda: running(short), 60, "the short job started", interval=0.3)
    began = time.monotonic()
    wait_until(lambda: not running(short), 120, "the short job's time-limit warning", interval=0.5)
    # Its worker drains, normally; on a slow machine the warning may come while its server still
    # starts: then it stops the server and requeues itself all the same.
    served = "worker exited" in (logs / f"node-{short}.log").read_text()
    report(
        f"slurm: the 1-minute job (worker ran: {served}) left RUNNING "
        f"{time.monotonic() - began:.0f} s after it started"
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
    assert drains and not any(d.startswith("grace over") for d in drains), "in-flight jobs finished"
    by_worker = {r["worker"] for r in records}
    assert {first[tasks[0]], first[tasks[3]], *back} <= by_worker, "the requeued jobs took jobs again"
    # Waste: generations paid for beyond one per prompt. Drains waste nothing (the grace covers a
    # generation); the scancel and the requeue kill a server with the jobs in flight there (the
    # workers' last reports before the kills; a report may be a few seconds old, so never counted
    # below a full CONCURRENCY). The servers' counts were polled, so a kill's last moments may be
    # missing: a lower bound of the generations, checked against that bound.
    report(f"slurm: {total_generations} generations seen for {N} prompts; in flight at the kills {killed}")
    assert total_generations <= N + sum(max(k, CONCURRENCY) for k in killed), (total_generations, killed)
    assert not cluster.job_processes(), "a process of a job outlived it"
