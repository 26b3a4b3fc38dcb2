"""`genq slurm`: a genq run as Slurm jobs (docs/cluster.md, "Run on Slurm").

``submit`` renders the package's sbatch templates (node.sbatch: one array task per inference
server; collector.sbatch) and hands them to ``sbatch``. Each node task runs ``genq slurm node``: it
starts the user's server command on a free port, waits for its /health, runs ``genq worker`` against
it in this same process (Slurm's warning signal reaches only the batch script, which ``exec``s
into this command, so the worker itself gets it and drains), then stops the server. A task that
drained on the time-limit warning with work left requeues itself. ``status`` joins squeue's view of
the run with the genq workers each Slurm job runs.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from importlib import resources
from pathlib import Path
from string import Template

import click
import redis
from rich.console import Console
from rich.table import Table

from genq.allocation import slurm_job
from genq.clock import redis_time
from genq.commands.processes import genq_command
from genq.commands.status import workers
from genq.connection import connect, redact
from genq.keys import Keys
from genq.progress import dataset_counts, finished
from genq.settings import option, redis_options

# slurmctld checks time limits about every 30 s, so a --signal=@N warning comes within about 30 s of
# N (measured: 31-51 s before the limit for N=40); the margin beyond the grace covers a late one
# and the server's stop (SERVER_STOP_S).
SIGNAL_MARGIN_S = 60
SERVER_STOP_S = 30  # SIGTERM to the server's process group, then SIGKILL


class Interrupted(Exception):
    """SIGTERM before the worker started: stop the server and exit."""


@click.group("slurm")
def slurm_command() -> None:
    """Run genq as Slurm jobs: node jobs (server + worker) and a collector job."""


@slurm_command.command("submit", context_settings={"ignore_unknown_options": True})
@option("--name", default="genq", help="Job name of the node jobs (the collector's adds '-collect').")
@option("--servers", type=click.IntRange(min=1), default=1, help="Node jobs: one array task per server.")
@option("--gpus-per-server", type=click.IntRange(min=0), default=1, help="GPUs (gres gpu) per server.")
@option(
    "--server-cmd",
    default=None,
    help="Command starting the inference server; {port} is replaced by the task's port.",
)
@option("--server", "server_url", default=None, help="Attach to this server instead of starting one.")
@option("--health-timeout", type=click.FloatRange(min=1), default=1800.0, help="Seconds to wait for /health.")
@option(
    "--out", type=click.Path(file_okay=False, path_type=Path), default=None, help="The collector's --out."
)
@option("--collector/--no-collector", default=True, help="Submit the collector job too (needs --out).")
@option("--time", "time_limit", default=None, help="sbatch --time of the node jobs, e.g. 12:00:00.")
@option("--partition", default=None, help="sbatch --partition (node and collector jobs).")
@option(
    "--grace",
    type=click.FloatRange(min=0),
    default=60.0,
    help="The worker's drain on Slurm's warning: in-flight jobs finish, the rest go back uncharged.",
)
@option(
    "--signal-margin",
    type=click.IntRange(min=0),
    default=SIGNAL_MARGIN_S,
    help="Seconds beyond --grace that the warning comes before the time limit (Slurm checks ~30 s).",
)
@option(
    "--requeue/--no-requeue",
    default=True,
    help="A node job warned of its time limit requeues itself while work is left; preempted ones come back.",
)
@option("--burst/--no-burst", default=True, help="Node jobs exit once the queues are empty.")
@option(
    "--logs",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("genq-slurm-logs"),
    help="Folder for the jobs' logs (node-JOB_TASK.log, server-JOB_TASK.log, collector-JOB.log).",
)
@option(
    "--genq",
    "genq_cmd",
    default=None,
    help="Command running genq on the nodes (default: this Python with -m genq).",
)
@option("--sbatch-arg", "sbatch_args", multiple=True, help="Extra #SBATCH option, e.g. --account=x (repeat).")
@option("--dry-run", is_flag=True, help="Print the scripts instead of submitting them.")
@click.argument("worker_args", nargs=-1, type=click.UNPROCESSED)
def submit_command(
    name: str,
    servers: int,
    gpus_per_server: int,
    server_cmd: str | None,
    server_url: str | None,
    health_timeout: float,
    out: Path | None,
    collector: bool,
    time_limit: str | None,
    partition: str | None,
    grace: float,
    signal_margin: int,
    requeue: bool,
    burst: bool,
    logs: Path,
    genq_cmd: str | None,
    sbatch_args: tuple[str, ...],
    dry_run: bool,
    worker_args: tuple[str, ...],
) -> None:
    """Submit the node jobs and the collector job. Arguments after -- go to each `genq worker`.

    Redis and every other setting reach the jobs through GENQ_* variables of this shell (sbatch
    --export=ALL), never their command lines. Enqueue first: node jobs exit when the queues are empty.
    """
    if (server_cmd is None) == (server_url is None):
        raise click.UsageError("say which server: --server-cmd 'CMD ... {port}' or --server URL")
    if collector and out is None:
        raise click.UsageError("the collector needs --out DIR (or --no-collector)")
    logs = logs.resolve()
    genq = genq_cmd or shlex.join(genq_command())
    common = [f"--partition={partition}"] if partition else []
    node_args = [
        *(["--server-cmd", server_cmd] if server_cmd else ["--server", server_url]),
        f"--health-timeout={health_timeout:g}",
        f"--logs={logs}",
        "--requeue" if requeue else "--no-requeue",
        "--",
        f"--grace={grace:g}",
        *(["--burst"] if burst else []),
        *worker_args,
    ]
    node = _render(
        "node.sbatch",
        name=name,
        last_task=servers - 1,
        logs=logs,
        warn_s=int(grace) + signal_margin,
        requeue="--requeue" if requeue else "--no-requeue",
        sbatch_lines=_lines(
            [
                *([f"--gres=gpu:{gpus_per_server}"] if gpus_per_server else []),
                *common,
                *([f"--time={time_limit}"] if time_limit else []),
                *sbatch_args,
            ]
        ),
        genq=genq,
        node_args=shlex.join(node_args),
    )
    scripts = [("node", node)]
    if collector:
        scripts.append(
            (
                "collector",
                _render(
                    "collector.sbatch",
                    name=f"{name}-collect",
                    logs=logs,
                    sbatch_lines=_lines([*common, *sbatch_args]),
                    genq=genq,
                    out=shlex.quote(str(out.resolve())),
                ),
            )
        )
    if dry_run:
        for _, script in scripts:
            click.echo(script)
        return
    logs.mkdir(parents=True, exist_ok=True)
    for role, script in scripts:
        job_id = _sbatch(script)
        what = f"{servers} node task(s), array {job_id}_[0-{servers - 1}]" if role == "node" else "collector"
        click.echo(f"submitted {role} job {job_id}: {what}")


def _render(template: str, **values: object) -> str:
    text = resources.files("genq.commands").joinpath(template).read_text()
    return Template(text).substitute({k: str(v) for k, v in values.items()})


def _lines(sbatch_args: list[str]) -> str:
    return "\n".join(f"#SBATCH {shlex.quote(a)}" for a in sbatch_args)


def _sbatch(script: str) -> str:
    """Submit on stdin; sbatch --parsable prints ``JOBID`` (``JOBID;CLUSTER`` on a federation)."""
    return _slurm(["sbatch", "--parsable"], script).strip().split(";")[0]


def _slurm(argv: list[str], stdin: str | None = None) -> str:
    """A Slurm client command's output; its failure as one line."""
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60)
    except FileNotFoundError as exc:
        raise click.ClickException(f"{argv[0]} not found: run this where Slurm's commands are") from exc
    if done.returncode != 0:
        raise click.ClickException(f"{argv[0]} failed: {_last_line(done.stderr)}")
    return done.stdout


@slurm_command.command("node", context_settings={"ignore_unknown_options": True})
@option("--server-cmd", default=None, help="Command starting the server; {port} is replaced.")
@option("--server", "server_url", default=None, help="Attach to this server instead.")
@option("--health-timeout", type=click.FloatRange(min=1), default=1800.0, help="Seconds to wait for /health.")
@option(
    "--logs", type=click.Path(file_okay=False, path_type=Path), default=Path("."), help="Server log folder."
)
@option(
    "--requeue/--no-requeue", default=False, help="Requeue this job after a warning drain with work left."
)
@click.argument("worker_args", nargs=-1, type=click.UNPROCESSED)
@redis_options
def node_command(
    server_cmd: str | None,
    server_url: str | None,
    health_timeout: float,
    logs: Path,
    requeue: bool,
    worker_args: tuple[str, ...],
    redis_url: str,
    namespace: str,
) -> None:
    """One node job (run by node.sbatch): the server, a worker against it, then the server stopped.

    Arguments after -- go to `genq worker`. Exits with the worker's code.
    """
    if (server_cmd is None) == (server_url is None):
        raise click.UsageError("say which server: --server-cmd 'CMD ... {port}' or --server URL")
    job = slurm_job() or f"local-{os.getpid()}"
    signal.signal(signal.SIGTERM, _interrupt)
    server: subprocess.Popen | None = None
    worker_done = threading.Event()
    code = 0
    try:
        if server_cmd is not None:
            port = _free_port()
            server_url = f"http://127.0.0.1:{port}"
            server = _start_server(server_cmd.replace("{port}", str(port)), logs / f"server-{job}.log")
            _echo(f"server starting at {server_url} (pid {server.pid}, log {logs}/server-{job}.log)")
            _wait_healthy(server, server_url, health_timeout)
            _echo(f"server ready at {server_url}")
            watch = threading.Thread(target=_watch, args=(server, worker_done), daemon=True)
            watch.start()
        code = _run_worker([*worker_args, "--server", server_url])
        _echo(f"worker exited {code}")
    except Interrupted:
        _echo("SIGTERM before the worker started")
    finally:
        # Stopping the server is bounded (SERVER_STOP_S); a signal meanwhile must not cut it short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        worker_done.set()
        if server is not None:
            if server.poll() is not None and code == 0:
                code = 1  # the server died under the worker: say so to Slurm, do not requeue
            _stop_server(server)
    if requeue and code == 0 and slurm_job() and _work_left(redis_url, namespace) and _still_running(job):
        # The worker drained on a signal while work is left, and Slurm did not cancel the job:
        # the time-limit warning (or `scancel --batch --signal=TERM`). Come back later.
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        _echo("requeued" if done.returncode == 0 else f"requeue failed: {_last_line(done.stderr)}")
    sys.exit(code)


def _last_line(stderr: str) -> str:
    """Slurm's commands explain a failure over several lines; the last one says what went wrong."""
    lines = stderr.strip().splitlines()
    return lines[-1] if lines else "no message"


def _interrupt(signum: int, frame: object) -> None:
    raise Interrupted


def _echo(message: str) -> None:
    click.echo(f"genq slurm node: {message}", err=True)


def _free_port() -> int:
    """A port no one listens on (two tasks on one node each get their own)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(command: str, log: Path) -> subprocess.Popen:
    """The server in its own process group (stopped whole, children included); its output in
    ``log``. CUDA_VISIBLE_DEVICES comes from Slurm's gres allocation, in the environment."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        return subprocess.Popen(
            command, shell=True, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )


def _wait_healthy(server: subprocess.Popen, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if server.poll() is not None:
            raise click.ClickException(f"the server exited {server.returncode} before answering /health")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise click.ClickException(f"the server at {url} did not answer /health within {timeout:g} s")
        time.sleep(1)


def _watch(server: subprocess.Popen, worker_done: threading.Event) -> None:
    """A server that exits while its worker runs ends the worker (its drain: SIGTERM to this
    process), rather than leave the worker waiting for /health until the job's time limit. Not when
    Slurm is ending the job (scancel, requeue, preemption): it signalled every process, the worker
    too, and a second SIGTERM would cut the worker's drain short."""
    while not worker_done.wait(1):
        if server.poll() is not None:
            if slurm_job() and not _still_running(slurm_job()):
                return
            _echo(f"the server exited {server.returncode} under the worker: stopping the worker")
            os.kill(os.getpid(), signal.SIGTERM)
            return


def _stop_server(server: subprocess.Popen) -> None:
    """SIGTERM to the server's whole process group (the shell and what it started), SIGKILL to
    what is left after SERVER_STOP_S."""
    for sig, wait in ((signal.SIGTERM, SERVER_STOP_S), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, sig)
        if _group_gone(server, wait):
            break
    _echo(f"server stopped ({server.returncode})")


def _group_gone(server: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        server.poll()  # reaps the shell; the group lives on while any process of it does
        try:
            os.killpg(server.pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _run_worker(args: list[str]) -> int:
    """`genq worker` in this process: it installs its own SIGTERM handler (the drain)."""
    from genq.worker.cli import worker_command

    try:
        worker_command.main(args=args, prog_name="genq worker", standalone_mode=False)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    return 0


def _work_left(redis_url: str, namespace: str) -> bool:
    try:
        return not finished(dataset_counts(connect(redis_url), Keys(namespace)))
    except (redis.ConnectionError, redis.TimeoutError):
        return True  # Redis down: come back and wait for it rather than drop the node


def _still_running(job: str) -> bool:
    """Whether Slurm still runs this job: a scancel (outright) or a requeue has set another state."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True).stdout
    return "JobState=RUNNING" in out.split()


@slurm_command.command("status")
@option("--name", default="genq", help="Job name given to submit.")
@redis_options
def status_command(name: str, redis_url: str, namespace: str) -> None:
    """The run's Slurm jobs (squeue) beside the genq worker each one runs."""
    fmt = "%i|%j|%T|%M|%L|%R"
    listed = _slurm(["squeue", "-h", "--array", f"--name={name},{name}-collect", "-o", fmt])
    try:
        conn = connect(redis_url)
        alive = workers(conn, Keys(namespace), redis_time(conn))  # heartbeats are Redis's time
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise click.ClickException(f"Redis unreachable at {redact(redis_url)}: {exc}") from exc
    by_job = {w["slurm_job"]: w for w in alive if w["slurm_job"]}
    table = Table(title=f"Slurm jobs of {name!r}, genq namespace {namespace!r}")
    for col in ("job", "name", "state", "time", "left", "node", "worker", "flight", "done"):
        table.add_column(col)
    for line in listed.splitlines():
        job_id, job_name, state, used, left, where = line.split("|")
        w = by_job.pop(job_id, None)
        flight, ok = (str(w["in_flight"]), str(w["done"])) if w else ("", "")
        table.add_row(job_id, job_name, state, used, left, where, w["name"] if w else "", flight, ok)
    for job_id, w in by_job.items():  # a worker whose job squeue no longer lists: its last heartbeat
        table.add_row(job_id, "?", "gone", "", "", "", w["name"], str(w["in_flight"]), str(w["done"]))
    Console().print(table)
