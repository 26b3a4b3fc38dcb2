"""`genq run`: the whole pipeline on one machine, in one command, resumable.

It starts (unless --redis is given) a private redis-server persisted in OUT/.redis, the
simulator (with --simulate), the collector, the enqueue, and N workers, each a child process
that dies with it; prints progress; and exits once every job is on disk. Run it again after a
kill and it continues: the enqueue skips what is queued or done, and jobs the dead workers had
started go back to the front of their queues.
"""

from __future__ import annotations

import copy
import fcntl
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import click

from genq import progress, provenance, sources
from genq.backends import NAMES, split_credentials
from genq.checker.cli import check_command  # the check stage's own flags, forwarded as typed
from genq.clock import redis_time
from genq.commands import verify
from genq.commands.embedded import EmbeddedRedis
from genq.commands.processes import ChildFailed, genq_command, spawn, stop, wait_for_line
from genq.commands.run_redis import record_namespace
from genq.commands.status import totals, with_tokens
from genq.connection import connect, redact, split_password
from genq.keys import Keys, validate_name
from genq.producer.cli import EXIT_REJECTED, enqueue_command  # `genq run` is the roles together, as genq is
from genq.reaper import requeue_orphans
from genq.redis_errors import Outage, patiently
from genq.schema import REJECTS
from genq.settings import DEFAULT_NAMESPACE, option, redis_options
from genq.terminal import duration
from genq.worker.config import AUTO, ConcurrencyParam

STOP_S = 30.0  # how long the workers may take to stop (their drain) before they are killed
# The workers' --grace: in-flight generations finish within it, the rest go back to the queue, all
# before STOP_S (with Redis out of reach a worker gives up at grace + 15 s: killed at STOP_S).
WORKER_GRACE_S = 20


class Interrupted(Exception):
    pass


# Every `genq enqueue` option that `genq run` does not set itself, copied without its callback:
# run forwards what was typed to enqueue, which converts and checks it (one place does that).
# How often `genq run` looks at the progress: the end is noticed at most this late.
FOLLOW_EVERY_S = 0.1
SERVE_EVERY_S = 0.5  # how often `genq run --serve` looks for a worker or collector that died
# `genq run --serve`'s line on stdout once it takes datasets: then the server's URL and its API.
SERVING = "genq run: serving "
COLLECTOR_READY_S = 60  # an enqueue waits this long for the collector to take its dataset
# The APIs `genq sim-server` speaks (its --api); auto means SGLang's.
SIMULATED = ("auto", "sglang", "vllm", "openai-chat")
_RUN_OWN = {
    "files",
    "dataset",
    "server",
    "backend",
    "redis_url",
    "namespace",
    "register_only",  # run's enqueues register each dataset and wait for its collector
    "wait_collector",
    "rejects",  # run writes them to OUT/<dataset>/rejected.jsonl
    # a stage follows a dataset of the run from another process (genq enqueue --from-dataset)
    "from_dataset",
    "from_out",
    "only_accepted",
    "only_stopped",
}
# The check stage (enqueue --checked, --accept K --max-samples M): run starts `genq check` with the
# checker this command line names, the running host's own consent (never Redis's).
CHECK_FLAGS = ("target", "check_options", "check_cmd", "max_check_attempts")


def _raw(param: click.Parameter) -> click.Parameter:
    raw = copy.copy(param)
    raw.callback = None
    return raw


ENQUEUE_PARAMS = [_raw(p) for p in enqueue_command.params if p.name not in _RUN_OWN]
CHECK_PARAMS = [_raw(p) for p in check_command.params if p.name in CHECK_FLAGS]


def enqueue_argv(ctx: click.Context, params: list[click.Parameter] = ENQUEUE_PARAMS) -> list[str]:
    """The options of ``params`` (enqueue's, by default; genq check's) given on run's command line,
    as that command's flags (the ones from GENQ_* variables reach it through the environment)."""
    out: list[str] = []
    for p in params:
        if ctx.get_parameter_source(p.name) != click.core.ParameterSource.COMMANDLINE:
            continue
        value = ctx.params[p.name]
        assert isinstance(p, click.Option)
        if p.is_flag:
            out.append(p.opts[-1] if value else p.secondary_opts[0])
        elif p.multiple:
            for v in value:
                out += [max(p.opts, key=len), str(v)]
        else:
            out += [max(p.opts, key=len), str(value)]
    return out


@click.command("run")
@click.argument("files", nargs=-1)
@option(
    "--serve",
    is_flag=True,
    help="Stay up once FILES (if any) are on disk: Redis, server, workers and the collector take the "
    "datasets enqueued into its Redis later (Python's genq.LocalRun runs it so), until SIGTERM or Ctrl-C.",
)
@option("--out", required=True, type=click.Path(file_okay=False, path_type=Path), help="Output folder.")
@option("--server", default=None, help="SGLang server URL (or --simulate).")
@option("--simulate", is_flag=True, help="Start the bundled simulator (of --backend's API) and use it.")
@option(
    "--backend",
    type=click.Choice(NAMES),
    default="auto",
    help="The server's API (genq worker --backend); with --simulate, the API the simulator speaks.",
)
@option(
    "--sim-latency",
    type=click.Choice(["zero", "realistic"]),
    default="realistic",
    help="Latency model of the simulator.",
)
@option("--workers", type=click.IntRange(min=1), default=2, help="Worker processes.")
@option(
    "--concurrency",
    type=ConcurrencyParam(),
    default=AUTO,
    help="Jobs in flight per worker; auto: each steers by the server's load (worker --max-concurrency).",
)
@option(
    "--dataset", default=None, help="One dataset name for all FILES (default: one dataset per file stem)."
)
@redis_options
def run_command(
    files,
    serve,
    out,
    server,
    simulate,
    backend,
    sim_latency,
    workers,
    concurrency,
    dataset,
    redis_url,
    namespace,
    **enqueue_options,
):
    """Run FILES (files, dataset folders, globs) end to end on this machine; exit when every result is
    on disk.

    Takes every `genq enqueue` option too (sampling, --format, --tokenizer, ...), for the enqueue.
    """
    if not files and not serve:
        raise click.UsageError("give FILES to run (or --serve, to take datasets enqueued from elsewhere)")
    if bool(server) == bool(simulate):
        raise click.UsageError("give exactly one of --server URL or --simulate")
    if simulate and backend not in SIMULATED:
        raise click.UsageError(
            f"--simulate speaks {', '.join(SIMULATED)}, not {backend}: for llama.cpp start llama-server "
            "and pass --server URL (`make real-engine` runs the example on one)"
        )
    try:  # files, dataset folders and globs, as enqueue takes them (one reader: genq/sources.py)
        paths = sources.expand(list(files), enqueue_options.get("config"))
    except sources.SourceError as exc:
        raise click.ClickException(str(exc)) from exc
    groups = [(dataset, paths)] if dataset else [(p.stem, [p]) for p in paths]
    ctx = click.get_current_context()
    checking = _check_stage(ctx, enqueue_options)
    if enqueue_options.get("dry_run"):  # what each enqueue would do; nothing is started
        for name, group in groups:
            argv = genq_command("enqueue", *map(str, group), "--dataset", name, *enqueue_argv(ctx))
            if subprocess.run(argv).returncode not in (0, EXIT_REJECTED):
                raise click.ClickException(f"the dry run of {name} failed (said above)")
        return
    embedded = ctx.get_parameter_source("redis_url") == click.core.ParameterSource.DEFAULT
    out.mkdir(parents=True, exist_ok=True)
    held = _hold(out)  # noqa: F841 - held for as long as this run lives
    run = Run(out, backend, namespace, enqueue_argv(ctx), embedded)

    def interrupted(signum, frame):
        raise Interrupted()

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    try:
        run.connect(redis_url, ctx.get_parameter_source("redis_url"))
        run.env["GENQ_SERVER"] = run.simulator(sim_latency) if simulate else server  # out of argv
        run.register(groups)
        if checking:
            run.checker(enqueue_argv(ctx, CHECK_PARAMS))
        rejected = run.enqueue_all(groups)
        trust = bool(enqueue_options.get("trust_remote_code"))
        if serve:
            run.serve(workers, concurrency, trust)  # until SIGTERM or Ctrl-C
        run.work(workers, concurrency, trust)
        run.report(groups, rejected, bool(enqueue_options.get("allow_rejects")))
    except Interrupted:
        if serve:
            click.echo("genq run: stopping: what is in flight finishes or goes back to the queue", err=True)
            return  # close() stops the workers first, while the server and Redis still answer them
        run.interrupted()
    finally:
        run.close()


class Run:
    """One `genq run`'s Redis and children, started in order and stopped in the reverse order."""

    def __init__(self, out: Path, backend: str, namespace: str, forwarded: list[str], embedded: bool):
        self.out, self.backend, self.namespace, self.forwarded = out, backend, namespace, forwarded
        self.embedded = embedded
        self.logs = out / ".logs"
        self.logs.mkdir(exist_ok=True)
        self.redis_server = EmbeddedRedis(out / ".redis", private=True) if embedded else None
        self.helpers: list[subprocess.Popen] = []  # the simulator, then the collector
        self.pool: list[subprocess.Popen] = []  # the workers (one that dies is replaced in this list)
        self.collector: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.started = time.monotonic()
        self.keys = Keys(namespace)

    def connect(self, redis_url: str, source: click.core.ParameterSource | None) -> None:
        """The private Redis started (or the given one reached), said in a line; jobs an earlier run
        left started put back on their queues."""
        if self.redis_server is not None:
            redis_url = self.redis_server.start()
            record_namespace(self.out, self.namespace)
            self.env = _child_env(redis_url, self.namespace, self.redis_server.password_file)
            self.conn = connect(redis_url, password=self.redis_server.password())
        else:
            self.env = _child_env(redis_url, self.namespace)
            self.conn = connect(redis_url)
        where = {
            click.core.ParameterSource.DEFAULT: f" (private, persisted in {self.out / '.redis'})",
            click.core.ParameterSource.ENVIRONMENT: " (from GENQ_REDIS_URL; unset it for a private one)",
        }.get(source, "")
        click.echo(f"genq run: Redis {redact(redis_url)}{where}", err=True)
        if self.redis_server is not None:  # its port is new each run: `--out` finds it (run_redis.py)
            ns = "" if self.namespace == DEFAULT_NAMESPACE else f" --namespace {self.namespace}"
            click.echo(
                f"genq run: watch it with genq monitor --out {shlex.quote(str(self.out))}{ns}", err=True
            )
        if self.embedded:
            back = requeue_orphans(self.conn, self.keys)
            if back:
                click.echo(
                    f"genq run: {back} jobs left started by an earlier run went back to their queues",
                    err=True,
                )

    def simulator(self, latency: str) -> str:
        """The bundled simulator of the backend's API, started; its URL."""
        argv = genq_command(
            "sim-server", "--port", "0", "--latency", latency, "--api", _sim_api(self.backend)
        )
        sim = _start(argv, self.logs / "sim.log", {}, stdout=subprocess.PIPE)
        self.helpers.append(sim)
        try:
            ready = wait_for_line(sim, "sim-server listening on ", 30, self.logs / "sim.log")
        except ChildFailed as exc:
            raise click.ClickException(f"the simulator: {exc}") from exc
        return ready.rsplit(" ", 1)[1]

    def enqueue(self, name: str, paths: list[Path], *extra: str) -> None:
        argv = genq_command(
            "enqueue", *map(str, paths), "--dataset", name, "--backend", self.backend, *self.forwarded, *extra
        )
        result = subprocess.run(argv, env={**os.environ, **self.env})
        if result.returncode not in (0, EXIT_REJECTED):
            if self.collector is not None and self.collector.poll() is not None:
                raise click.ClickException(
                    f"the collector exited ({self.collector.returncode}); see its log in OUT/.logs"
                )
            raise click.ClickException(f"enqueue of {name} failed (exit {result.returncode})")

    def register(self, groups: list[tuple[str, list[Path]]]) -> None:
        """Every dataset's name checked, then the collector started: each enqueue records its
        dataset's settings and waits for the collector to mark what OUT already holds (a resumed
        run on a fresh Redis) before it asks what is done — one process, one tokenizer load, a
        dataset."""
        for name, _ in groups:
            try:
                validate_name(name)
            except ValueError as exc:
                raise click.ClickException(f"{exc} (use --dataset NAME)") from exc
        self.collector = _start(
            genq_command("collect", "--out", str(self.out)), self.logs / "collector.log", self.env
        )
        self.helpers.append(self.collector)

    def checker(self, flags: list[str]) -> None:
        """`genq check` with this command line's checker, beside the workers: a checked dataset's
        endings are judged before the collector files them."""
        proc = _start(genq_command("check", *flags), self.logs / "checker.log", self.env)
        self.helpers.append(proc)

    def enqueue_all(self, groups: list[tuple[str, list[Path]]]) -> dict[str, int]:
        """Every dataset enqueued, its rejected rows listed in OUT/<dataset>/rejected.jsonl; how many."""
        rejected: dict[str, int] = {}
        for name, paths in groups:
            self.enqueue(
                name,
                paths,
                "--rejects",
                str(self.out / name / REJECTS),
                "--wait-collector",
                str(COLLECTOR_READY_S),
            )
            provenance.record_command(self.conn, self.keys, name, "run")  # the card's one line
            rejected[name] = _lines_in(self.out / name / REJECTS)
            if rejected[name]:
                click.echo(
                    f"genq run: {name}: {rejected[name]} rows rejected, listed in "
                    f"{self.out / name / REJECTS}; the other rows run",
                    err=True,
                )
        return rejected

    def _worker_argv(self, concurrency: object, trust_remote_code: bool) -> list[str]:
        argv = genq_command(
            "worker",
            "--backend",
            self.backend,
            "--concurrency",
            str(concurrency),
            "--grace",
            str(WORKER_GRACE_S),
        )
        if trust_remote_code:  # the one consent, for enqueue and workers alike
            argv.append("--trust-remote-code")
        return argv

    def work(self, workers: int, concurrency: object, trust_remote_code: bool) -> None:
        """The workers started and followed until every job is on disk, then stopped with the collector."""
        argv = self._worker_argv(concurrency, trust_remote_code)
        if not self.pool:
            self.pool.extend(_start(argv, self.logs / f"worker-{i}.log", self.env) for i in range(workers))
        _follow(self.conn, self.keys, self.pool, self.collector, argv, self.logs, self.env)
        stop(self.pool, 90)
        stop([self.collector], 60)

    def serve(self, workers: int, concurrency: object, trust_remote_code: bool) -> None:
        """--serve: the workers started, then kept (one that dies replaced) until SIGTERM or Ctrl-C
        (:class:`Interrupted`); the line SERVING on stdout says the run takes datasets now."""
        argv = self._worker_argv(concurrency, trust_remote_code)
        self.pool.extend(_start(argv, self.logs / f"worker-{i}.log", self.env) for i in range(workers))
        bare = split_credentials(self.env["GENQ_SERVER"])[0]  # a key in the URL stays out of the line
        click.echo(f"{SERVING}{bare} {self.backend}")
        sys.stdout.flush()
        while True:
            _restart_dead(self.pool, self.collector, argv, self.logs, self.env)
            time.sleep(SERVE_EVERY_S)

    def report(
        self, groups: list[tuple[str, list[Path]]], rejected: dict[str, int], allow_rejects: bool
    ) -> None:
        """The audit (genq verify): every job of every dataset exactly once, on disk; the counts said
        are its own, read off the files, not what Redis believes."""
        conn, keys, out = self.conn, self.keys, self.out
        per_dataset = with_tokens(conn, keys, progress.dataset_counts(conn, keys), redis_time(conn))
        audits = [verify.audit(conn, keys, out, name, paths) for name, paths in groups]
        for result in audits:
            name, done, failed = result.dataset, result.states["done"], result.states["failed"]
            of = result.expected - result.rejected  # rows refused at enqueue are listed apart
            click.echo(f"{name}: {done} done, {failed} failed of {of} -> {out / name}")
        tokens = totals(per_dataset)["completion_tokens"]
        click.echo(
            f"wall time {duration(time.monotonic() - self.started)}"
            + (f", {tokens:,} completion tokens" if tokens is not None else "")
            + f". Next: genq stats {out} · genq export {out} --format sharegpt · genq report {out}"
            + (f" · genq status --out {out}" if self.embedded else "")
        )
        for result in audits:
            verify.print_audit(result)
        if not all(r.ok for r in audits):
            raise click.ClickException("verify found jobs missing or duplicated (see above)")
        for name, n in rejected.items():
            if n:
                click.echo(f"{name}: {n} rows rejected at enqueue -> {out / name / REJECTS}")
        if any(rejected.values()) and not allow_rejects:
            click.echo(
                f"Error: rows were rejected (listed above); the rest ran. Fix them and run again, or pass "
                f"--allow-rejects (exit {EXIT_REJECTED})",
                err=True,
            )
            sys.exit(EXIT_REJECTED)

    def interrupted(self) -> None:
        """Ctrl-C (or SIGTERM): the workers drain while the simulator still answers and the collector
        still writes; a second one stops everything at once. Exit 130."""
        click.echo(
            f"\ngenq run: interrupted: the generations in flight finish or go back to the queue (up to "
            f"{STOP_S:.0f} s); Ctrl-C again to stop now. Run the same command again to resume.",
            err=True,
        )
        try:
            stop(self.pool, STOP_S)
            stop(self.helpers[::-1], STOP_S)
        except Interrupted:  # the second Ctrl-C: what is in flight runs again on resume
            click.echo("genq run: stopping now; the generations in flight run again on resume", err=True)
            for proc in self.pool + self.helpers:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if self.redis_server is not None:
            self.redis_server.stop()
        sys.exit(130)

    def close(self) -> None:
        stop(self.pool, STOP_S)
        stop(self.helpers[::-1], STOP_S)
        if self.redis_server is not None:
            self.redis_server.stop()


run_command.params.extend(ENQUEUE_PARAMS)
run_command.params.extend(CHECK_PARAMS)


def _check_stage(ctx: click.Context, options: dict) -> bool:
    """Whether the datasets are checked (--checked, --accept), and then that the checker is named:
    a checked dataset with nobody to judge it would never end, a checker with nothing to judge is
    a mistake. Both said in one usage line."""
    checked = bool(options.get("checked") or options.get("accept"))
    named = bool(options.get("target") or options.get("check_cmd"))
    if checked and not named:
        raise click.UsageError(
            "a checked dataset (--checked, --accept K) needs this host's checker: --check MODULE:FUNCTION "
            "or --check-cmd CMD (genq run starts `genq check` with it)"
        )
    if named and not checked:
        raise click.UsageError(
            "--check and --check-cmd judge a checked dataset: add --checked (or --accept K --max-samples M)"
        )
    return checked


def _hold(out: Path) -> IO:
    """One `genq run` per output folder: an exclusive lock on OUT/.run for as long as this process
    lives (the kernel lets go of it however the process ends), so a second run on the folder
    stops at once instead of stopping the first one's Redis."""
    fh = (out / ".run").open("a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "?"
        fh.close()
        raise click.ClickException(
            f"{out}: another genq run (pid {holder}) is writing this folder; watch it with "
            f"genq monitor --out {shlex.quote(str(out))}, or stop it before running again"
        ) from None
    fh.truncate(0)
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


def _child_env(redis_url: str, namespace: str, password_file: Path | None = None) -> dict[str, str]:
    """What the children are told of Redis, through the environment, never argv (which `ps` shows
    to every user of the host): the URL without its password, and the password beside it (the
    private Redis's: its file in OUT/.redis)."""
    bare, password = split_password(redis_url)
    env = {"GENQ_REDIS_URL": bare, "GENQ_NAMESPACE": namespace}
    if password_file is not None:
        env["GENQ_REDIS_PASSWORD_FILE"] = str(password_file)
    elif password is not None:  # the URL's password wins in connect(), so it must here too
        env.update(GENQ_REDIS_PASSWORD=password, GENQ_REDIS_PASSWORD_FILE="")
    return env


def _sim_api(backend: str) -> str:
    return "sglang" if backend == "auto" else backend


def _start(
    argv: list[str], log_path: Path, env: dict[str, str], stdout: int | None = None
) -> subprocess.Popen:
    """A child whose log goes to ``log_path`` (and stdout too, unless piped to us)."""
    with open(log_path, "ab") as log:
        return spawn(argv, env=env, stdout=stdout if stdout is not None else log, stderr=log)


def _follow(conn, keys: Keys, pool, collector, worker_argv, logs: Path, env) -> None:
    """Progress until everything is on disk; restart a worker that dies."""
    start = time.monotonic()
    first_done = None
    tty = sys.stderr.isatty()
    last_print = 0.0
    outage = Outage(logging.getLogger("genq.run"), conn, keys)
    while True:
        # A Redis restarting (LOADING), busy or unreachable for a while is waited out.
        counts = patiently(lambda: progress.dataset_counts(conn, keys), outage)
        view = totals(
            patiently(lambda counts=counts: with_tokens(conn, keys, counts, redis_time(conn)), outage)
        )
        total, done, failed = view["total"], view["done"], view["failed"]
        if first_done is None:
            first_done = done + failed
        elapsed = time.monotonic() - start
        rate = (done + failed - first_done) / elapsed if elapsed > 0 else 0.0
        line = (
            f"[{elapsed:6.0f}s] {done + failed}/{total} on disk ({failed} failed), "
            f"{view['in_flight']} in flight, {view['queued']} queued, {rate:.1f} jobs/s"
        )
        if view["tokens_per_s"]:
            line += f", {view['tokens_per_s']:,.0f} tok/s"
        if view["eta_s"] and done + failed < total and rate > 0:  # at 0 jobs/s an ETA would be a guess
            line += f", ETA {duration(view['eta_s'])}"
        if tty:
            click.echo("\r" + line.ljust(100), nl=False, err=True)
        elif time.monotonic() - last_print >= 5:
            click.echo(line, err=True)
            last_print = time.monotonic()
        if (
            progress.finished(counts)
            and patiently(lambda: progress.stream_lag(conn, keys), outage)["length"] == 0
        ):
            if tty:
                click.echo("", err=True)
            click.echo(line, err=True)
            return
        _restart_dead(pool, collector, worker_argv, logs, env)
        time.sleep(FOLLOW_EVERY_S)


def _restart_dead(pool, collector, worker_argv, logs: Path, env) -> None:
    """A worker that died is started again; a collector that died ends the run in one line."""
    for i, proc in enumerate(pool):
        if proc.poll() is not None:
            click.echo(f"\ngenq run: worker {i} exited ({proc.returncode}); restarting it", err=True)
            pool[i] = _start(worker_argv, logs / f"worker-{i}.log", env)
    if collector.poll() is not None:
        raise click.ClickException(
            f"the collector exited ({collector.returncode}); see OUT/.logs/collector.log"
        )


def _lines_in(path: Path) -> int:
    """How many rows a rejects file lists (none when the enqueue wrote none)."""
    if not path.exists():
        return 0
    with path.open("rb") as fh:
        return sum(1 for _ in fh)
