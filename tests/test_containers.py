"""compose.yaml and ops/Dockerfile, run for real (issue 16).

Podman builds the images and podman-compose runs the demo; a worker container is SIGKILLed with jobs
in flight, and every example prompt still lands in the collector's volume exactly once. No registry
is reachable from CI: the base images are local stand-ins made by ops/compose/local-images.sh
(debootstrap, cached in ~/.cache/genq). Podman 4.3 runs no health checks without systemd, so
nothing waits on `service_healthy`: each genq command waits for Redis itself (the first test), and
this file polls.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import orjson
import pytest

from genq.commands.embedded import EmbeddedRedis, free_port
from genq.sim.model import tokenize
from tests.helpers import (
    assert_adds_up,
    check_records,
    http_status,
    log_of,
    need,
    read_jsonl,
    status_json,
    stop,
    wait_until,
    write_prompts,
    written_lines,
)

REPO = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO / "compose.yaml"
LOCAL_IMAGES = REPO / "ops" / "compose" / "local-images.sh"
PROMPTS = REPO / "examples" / "prompts.jsonl"
DATASET = "prompts"  # compose.yaml's enqueue: --dataset prompts
HEARTBEAT_TTL = 10  # a SIGKILLed worker's jobs run elsewhere 8-13 s later (docs/failures.md)
SIM_MIN_LEN = 384  # the demo simulator's shortest answer (compose.yaml: GENQ_SIM_MIN_LEN)
# Where Debian keeps a host's own CAs: a TLS-inspecting proxy's is there, and pip in the build needs it.
LOCAL_CAS = Path("/usr/local/share/ca-certificates")
PROJECT_LABEL = "io.podman.compose.project"  # on every container podman-compose makes
GENQ_UID = 10001  # ops/Dockerfile's genq user


def test_roles_started_before_redis_wait_for_it(procs, start_sim, out, tmp_path):
    """Collector, worker and enqueue started while Redis is down (compose under podman starts them
    all at once) wait for it, then run the dataset to the end."""
    redis = EmbeddedRedis(tmp_path / "redis")
    env = {"GENQ_REDIS_URL": redis.url}
    sim = start_sim()
    data = tmp_path / "early.jsonl"
    prompts = write_prompts(data, 50)
    # Not --burst: whichever of them met Redis before enqueue did would find nothing to do and exit.
    collector = procs.start("collect", "--out", out, env=env)
    worker = procs.start("worker", "--server", sim, env=env)
    enqueue = procs.start("enqueue", data, "--max-new-tokens", "16", env=env)
    roles = (collector, worker, enqueue)

    def waiting() -> bool:
        assert not (gone := [log_of(p) for p in roles if p.poll() is not None]), gone
        return all("Redis unreachable" in log_of(p) for p in roles)

    wait_until(waiting, 30, "every role to say it waits for Redis")
    redis.start()
    try:
        assert enqueue.wait(60) == 0, log_of(enqueue)
        raw = out / "early" / "raw_responses.jsonl"
        wait_until(lambda: len(written_lines(raw)) == len(prompts), 60, "every record on disk")
        for proc in (worker, collector):
            assert stop(proc) == 0, log_of(proc)
        check_records(out, "early", prompts, {"max_new_tokens": 16})
        assert_adds_up(status_json(procs, env))
    finally:
        redis.stop()


# -- podman -------------------------------------------------------------------------------------------


def cannot(reason: str) -> NoReturn:
    """This machine cannot run the containers: skip, except in CI, where .ci/run set podman up."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def run(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def podman_compose() -> str:
    """podman-compose >= 1.1: Debian bookworm's 1.0.3 has no --profile (.ci/run installs 1.6.0)."""
    path = need("podman-compose")
    found = re.search(r"podman-compose version (\d+)\.(\d+)", run([path, "--version"], 60).stdout)
    if not found or (int(found[1]), int(found[2])) < (1, 1):
        cannot(f"{path} is older than 1.1, which --profile needs (.ci/run installs 1.6.0 from PyPI)")
    return path


def local_images(env: dict[str, str]) -> dict[str, str]:
    """PYTHON_IMAGE and REDIS_IMAGE: the stand-ins made (or found cached) by local-images.sh."""
    if os.geteuid() != 0:
        cannot("debootstrap and podman's containers.conf set-up need root")
    need("debootstrap")
    result = run(["bash", str(LOCAL_IMAGES)], 900, env)
    if result.returncode != 0:
        cannot(f"podman cannot build images here: {result.stderr[-2000:]}")
    return dict(re.findall(r"^export (\w+)=(\S+)$", result.stdout, re.M))


def extra_ca_certs() -> str:
    """This host's own CAs, for EXTRA_CA_CERTS: where a proxy inspects TLS (as in CI), pip in the
    build fails without them."""
    return "".join(p.read_text() for p in sorted(LOCAL_CAS.rglob("*.crt")))


class Project:
    """One compose project, named uniquely, with its own genq image; gone after down()."""

    def __init__(self, compose: str, env: dict[str, str], empty_env_file: Path, timings: dict[str, float]):
        self.timings = timings  # seconds per step, for the run's summary
        self.name = "genqtest" + uuid.uuid4().hex[:8]
        self.image = f"localhost/{self.name}:latest"
        self.env = {**env, "GENQ_IMAGE": self.image}
        self.argv = [compose, "--env-file", str(empty_env_file), "-p", self.name, "--profile", "demo"]
        self.redis_url: str | None = None  # Redis's address on the project's network, once known

    def compose(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        result = run([*self.argv, *args], timeout, self.env)
        assert result.returncode == 0, f"podman-compose {' '.join(args)}: {result.stderr[-3000:]}"
        return result

    def containers(self, service: str | None = None, all_states: bool = False) -> list[dict]:
        argv = ["podman", "ps", "--format", "json", "--filter", f"label={PROJECT_LABEL}={self.name}"]
        if service:
            argv += ["--filter", f"label=com.docker.compose.service={service}"]
        return json.loads(run(argv + ["--all"] * all_states, 60).stdout or "[]")

    def one(self, service: str) -> str:
        (container,) = self.containers(service)
        return container["Names"][0]

    def status(self) -> dict:
        """`genq status --json`, run in the collector's container against Redis's address.

        Not its name: podman 4.3's aardvark-dns tears its sockets down and sets them up again on
        every reload (a container joining or leaving the network: enqueue's exit, the SIGKILLed
        worker; containers/aardvark-dns#389), and a lookup meanwhile fails as "Name or service not
        known" or "Temporary failure in name resolution". genq's long-lived roles ride that out by
        reconnecting; a one-shot `genq status` says it in one line and exits 1, which is right for a
        user and no test of genq.
        """
        if self.redis_url is None:
            address = "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}"
            found = run(["podman", "inspect", "--format", address, self.one("redis")], 60)
            assert found.returncode == 0 and found.stdout.strip(), found.stderr
            self.redis_url = f"redis://{found.stdout.strip()}:6379/0"
        argv = ["podman", "exec", "--env", f"GENQ_REDIS_URL={self.redis_url}", self.one("collector")]
        result = run([*argv, "genq", "status", "--json"], 60)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def output(self) -> Path:
        """The dataset's folder in the collector's volume, as it is on this host's disk."""
        volume = f"{self.name}_genq-out"
        mount = run(["podman", "volume", "inspect", "--format", "{{.Mountpoint}}", volume], 60)
        assert mount.returncode == 0, mount.stderr
        return Path(mount.stdout.strip()) / DATASET

    def logs(self) -> str:
        """The last lines of every container, for a failure's message."""
        out = []
        for c in self.containers(all_states=True):
            name = c["Names"][0]
            log = run(["podman", "logs", "--tail", "15", name], 60)
            out.append(f"--- {name} ({c['State']}, exit {c['ExitCode']})\n{log.stdout}{log.stderr}")
        return "\n".join(out)

    def wait(self, cond, timeout: float, what: str):
        try:
            return wait_until(cond, timeout, what, interval=1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.logs()}") from None

    def leftovers(self, image: bool = True) -> list[str]:
        """Containers, volumes, networks and pods of this project, and its image, still there."""
        found = [c["Names"][0] for c in self.containers(all_states=True)]
        for kind in ("volume", "network", "pod"):
            listing = run(["podman", kind, "ls", "--format", "{{.Name}}"], 60).stdout.split()
            found += [f"{kind} {n}" for n in listing if self.name in n]
        if image and run(["podman", "image", "exists", self.image], 60).returncode == 0:
            found.append(f"image {self.image}")
        return found


@pytest.fixture
def project(tmp_path) -> Iterator[Project]:
    need("podman")
    compose = podman_compose()
    # Only what this test sets reaches compose: no GENQ_* or other compose variable of the caller's.
    variables = set(re.findall(r"\$\{(\w+)", COMPOSE_FILE.read_text()))
    env = {k: v for k, v in os.environ.items() if k not in variables}
    started = time.monotonic()
    images = local_images(env)
    timings = {"base images": time.monotonic() - started}
    env.update(
        images,
        EXTRA_CA_CERTS=extra_ca_certs(),
        DASHBOARD_PORT=str(free_port()),
        GENQ_HEARTBEAT_TTL=str(HEARTBEAT_TTL),
        # Every answer 384-512 tokens: with all 200 in flight, none is done for ~30 s, however
        # fast genq is and however slow `podman exec` is on a loaded machine.
        GENQ_SIM_MIN_LEN=str(SIM_MIN_LEN),
    )
    secrets = tmp_path / "secrets"
    make = [REPO / "ops/compose/make-secrets.sh", secrets]  # no password is in the repository
    subprocess.run(make, check=True, capture_output=True, timeout=30)
    env.update(
        REDIS_PASSWORD_FILE=str(secrets / "redis-password"),
        DASHBOARD_PASSWORD_FILE=str(secrets / "dashboard-password"),
    )
    empty = tmp_path / "empty.env"
    empty.touch()
    proj = Project(compose, env, empty, timings)
    yield proj
    # The test's own `down` did this, unless it failed before: then the simulator may still be
    # paused: unpaused first, since after a failed test whose simulator was paused CI found `down`
    # had left the project's pod and network behind.
    if proj.leftovers(image=False):
        for c in proj.containers(all_states=True):
            if c["State"] == "paused":
                run(["podman", "unpause", c["Names"][0]], 60)
        run([*proj.argv, "down", "--volumes", "--timeout", "20"], 300, proj.env)
        for kind in ("pod", "network"):  # what `down` still left: removed by force
            for name in proj.leftovers(image=False):
                if name.startswith(f"{kind} "):
                    run(["podman", kind, "rm", "--force", name.split(" ", 1)[1]], 120)
    run(["podman", "rmi", "--force", proj.image], 120)
    assert not proj.leftovers(), f"left behind: {proj.leftovers()}"


# Its budgets: the base images (900 s when not cached), the build (600 s), `up` (300 s), 120 + 60 + 240 +
# 60 s of waits, `stop` and `down` (300 s each), and the fixture's clean-up (300 + 120 s).
@pytest.mark.containers
@pytest.mark.timeout(3600)
def test_compose_demo_in_containers(project, report):
    """Build, `up` with the demo profile, SIGKILL a worker container with jobs in flight, and
    every prompt of examples/prompts.jsonl in the collector's volume exactly once."""
    timings = project.timings
    started = time.monotonic()
    # One build (layers off: nothing left behind but the image), then up: every service shares it.
    project.compose("--podman-build-args=--layers=false", "build", "collector", timeout=600)
    timings["build"] = time.monotonic() - started
    project.compose("up", "-d")
    timings["up"] = time.monotonic() - started - timings["build"]
    workers = project.containers("worker")
    assert len(workers) == 2, "GENQ_WORKERS defaults to 2 worker containers (deploy.replicas)"
    rows = [orjson.loads(line) for line in PROMPTS.read_bytes().splitlines() if line.strip()]
    total = len(rows)

    # A worker with jobs in flight, as its last report says; its container is the one of its host.
    # The simulator is paused (cgroup freezer) once both workers serve it: their requests are sent
    # and stay in flight, so no look, however slow `podman exec` is, comes after the run's end.
    def serving() -> bool:
        logs = [run(["podman", "logs", c["Names"][0]], 60) for c in workers]
        return all(" serving http://sim-server" in log.stdout + log.stderr for log in logs)

    project.wait(serving, 120, "both workers serving the simulator")
    sim_server = project.one("sim-server")
    assert run(["podman", "pause", sim_server], 60).returncode == 0

    def busy() -> dict | None:
        status = project.status()
        done = status["datasets"].get(DATASET, {}).get("done", 0)
        assert done < total, "the run ended before a worker could be killed with jobs in flight"
        return next((w for w in status["workers"] if w["in_flight"]), None)

    victim = project.wait(busy, 120, "a worker with jobs in flight")
    (container,) = [c["Names"][0] for c in workers if c["Id"].startswith(victim["host"])]
    assert run(["podman", "kill", "--signal", "KILL", container], 60).returncode == 0
    assert run(["podman", "unpause", sim_server], 60).returncode == 0
    killed_at = time.monotonic()

    # The dashboard on its published loopback port, with its password only.
    base = f"http://127.0.0.1:{project.env['DASHBOARD_PORT']}/"
    project.wait(lambda: http_status(base) == 401, 60, "the dashboard")
    password = Path(project.env["DASHBOARD_PASSWORD_FILE"]).read_text().strip()
    assert http_status(base, auth=("genq", password)) == 200

    # The CAs given with EXTRA_CA_CERTS (pip needed them to build: see extra_ca_certs) stayed in the
    # build stage.
    certs = "/usr/local/share/ca-certificates", "/etc/ssl/certs"
    found = run(["podman", "exec", project.one("collector"), "find", *certs, "-name", "build-extra-*"], 60)
    assert found.returncode == 0 and not found.stdout, f"in the image: {found.stdout}{found.stderr}"

    def finished() -> bool:
        counts = project.status()["datasets"][DATASET]
        return counts["done"] == total and counts["in_flight"] == counts["queued"] == 0

    project.wait(finished, 240, f"every prompt done after {victim['in_flight']} in flight were killed")
    timings["recovery"] = time.monotonic() - killed_at
    status = project.status()
    assert_adds_up(status)
    assert status["datasets"][DATASET]["failed"] == 0
    folder = project.output()
    raw = folder / "raw_responses.jsonl"
    project.wait(lambda: len(written_lines(raw)) >= total, 60, "every record in the collector's volume")

    # `compose stop` drains: the collector and the live workers exit 0 on SIGTERM (through the init).
    # Named, so Redis outlives them: podman-compose stops all it stops at once, in no order.
    project.compose("stop", "worker", "collector", timeout=300)
    drained = [
        c
        for service in ("collector", "worker")
        for c in project.containers(service, all_states=True)
        if c["Names"][0] != container
    ]
    assert len(drained) == 2, f"the collector and the live worker: {[c['Names'][0] for c in drained]}"
    for c in drained:
        assert c["ExitCode"] == 0, f"{c['Names'][0]} exited {c['ExitCode']}\n{project.logs()}"

    # On disk, the collector gone: every prompt exactly once, each with the server's answer (the
    # simulator's model, as compose.yaml runs it: text prompts, --max-new-tokens 512, answers of
    # SIM_MIN_LEN to 512 tokens), written by the image's unprivileged user; nothing in errors.jsonl.
    prompts = [tokenize(row["prompt"]) for row in rows]
    records = check_records(folder.parent, DATASET, prompts, {"max_new_tokens": 512}, min_len=SIM_MIN_LEN)
    for r in records:
        assert r["id"] == f"{DATASET}-{r['row']}", r
    assert not read_jsonl(folder / "errors.jsonl")
    assert raw.stat().st_uid == GENQ_UID, f"{raw} owned by uid {raw.stat().st_uid}"
    timings["build to stop"] = time.monotonic() - started

    # `down` takes every container, volume, network and pod of the project with it.
    project.compose("down", "--volumes", "--timeout", "20", timeout=300)
    assert not (left := project.leftovers(image=False)), f"left behind by down: {left}"
    timings["down"] = time.monotonic() - started - timings["build to stop"]
    report("containers: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
