"""genq behind SGLang's router: the real ``sglang-router`` 0.3.2 from PyPI in front of two simulator
replicas (genq/backends/sglang_router.py has what the router answers).

The router is a Rust binary in a wheel (no GPU, no torch), in a venv built once by
``ops/engines/sglang-router-venv.sh`` and cached outside the clone.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
from pathlib import Path

import pytest

from genq.backends import Http, choose
from genq.commands.embedded import free_port
from tests.engines import engine_python, post
from tests.helpers import (
    check_records,
    genq_argv,
    http,
    log_of,
    read_jsonl,
    server_load,
    server_up,
    sim_stats,
    status_json,
    stop,
    wait_for_records,
    wait_until,
    write_prompts,
)

pytestmark = [pytest.mark.slow, pytest.mark.real_engine]

SIM_FLAGS = ("--latency", "realistic", "--decode-step-ms", "5", "--min-len", "20", "--max-len", "200")
MODEL = {"min_len": 20, "max_len": 200}
# Replicas whose every answer takes 8,000 decode steps (40 s): a request still runs when aborted.
LONG_FLAGS = ("--latency", "realistic", "--decode-step-ms", "5", "--min-len", "8000", "--max-len", "8000")


class Replica:
    """One `genq sim-server` on a fixed port, so the router finds it again after a restart."""

    def __init__(self, log: Path, flags: tuple[str, ...]) -> None:
        self.flags = flags
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen | None = None
        self.served_before = 0  # generations of its earlier lives (read just before each kill)

    def start(self) -> None:
        with self.log.open("ab") as fh:
            argv = genq_argv("sim-server", "--port", str(self.port), *self.flags)
            self.proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT)
        wait_until(lambda: server_up(self.url), 30, f"the replica at {self.url}")

    def kill(self) -> None:
        self.served_before += sim_stats(self.url)["generations"]
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def generations(self) -> int:
        return self.served_before + sim_stats(self.url)["generations"]


def healthy_workers(router: str) -> set[str]:
    """The replicas the router lists as healthy (``/workers``); none while it does not listen."""
    status, body = http(router + "/workers")
    if status != 200:
        return set()
    return {w["url"] for w in json.loads(body).get("workers", []) if w.get("is_healthy")}


@pytest.fixture
def replicas(request, tmp_path):
    """Two simulator replicas (their flags: the test's indirect parameter, else SIM_FLAGS)."""
    flags = getattr(request, "param", SIM_FLAGS)
    started = [Replica(tmp_path / f"replica-{i}.log", flags) for i in range(2)]
    for replica in started:
        replica.start()
    yield started
    for replica in started:
        if replica.proc is not None and replica.proc.poll() is None:
            replica.proc.kill()
            replica.proc.wait(10)


@pytest.fixture
def router(request, replicas, tmp_path):
    """The real router in front of both replicas; its URL. Health checks every 2 s, so a replica
    that comes back is used again within seconds; its Prometheus exporter (on by default, port
    29000) on a free port, so routers of tests side by side do not collide."""
    python = engine_python("sglang-router")
    flags = getattr(request, "param", ())
    port = free_port()
    log = (tmp_path / "router.log").open("wb")
    proc = subprocess.Popen(
        [
            python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *(r.url for r in replicas), "--health-check-interval-secs", "2",
            "--log-level", "warn", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()), *flags,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        # Its /health answers as soon as it listens; the replicas are registered after that, one
        # by one (a request in between goes to those already there): wait for /workers to list both.
        wait_until(
            lambda: healthy_workers(url) == {r.url for r in replicas}, 60, "the router to list both replicas"
        )
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("router", [(), ("--disable-retries",)], indirect=True, ids=["retries", "no-retries"])
def test_every_prompt_once_through_the_router_with_a_replica_killed_and_restarted(
    request, procs, replicas, router, out, tmp_path
):
    """`--backend auto` finds SGLang behind the router; one replica is SIGKILLed with work in flight
    and restarted: every prompt lands once with the replicas' ids, nothing in errors.jsonl, both
    replicas served, and the server did no more generations than the prompts plus those in flight
    at the kill. With the router's retries (its default) the kill is hidden from genq; without them
    the router's 500 reaches genq, which spares and resends those jobs (charging none)."""
    n, concurrency = 600, 16
    data = tmp_path / "routed.jsonl"
    prompts = write_prompts(data, n)
    assert procs.run("enqueue", data, "--max-new-tokens", "300").returncode == 0
    collector = procs.start("collect", "--out", out)
    worker = procs.start("worker", "--server", router, "--concurrency", str(concurrency))

    wait_for_records(procs, "routed", n // 4, 120)
    assert all(r.proc and r.proc.poll() is None for r in replicas)
    victim = replicas[0]
    assert sim_stats(victim.url)["in_flight"] > 0, "the kill must catch work in progress"
    victim.kill()
    done_at_kill = status_json(procs)["datasets"]["routed"]["done"]
    assert done_at_kill < n, "the kill came after the run"
    victim.start()

    wait_for_records(procs, "routed", n, 120)
    for proc in (worker, collector):
        assert stop(proc, timeout=60) == 0, log_of(proc)

    log = log_of(worker)
    assert "(sglang detected" in log, log[-3000:]
    assert "behind SGLang's router, 2 replicas" in log, log[-3000:]
    records = check_records(out, "routed", prompts, {"max_new_tokens": 300}, **MODEL)
    assert read_jsonl(out / "routed" / "errors.jsonl") == []
    if "--disable-retries" in request.node.callspec.params["router"]:
        assert "failed: connection 500" in log, "the router's 500 never reached genq"
    assert all(r["attempts"] == 1 for r in records), "a send the dead replica failed was charged"
    served = [r.generations() for r in replicas]
    assert all(s > 0 for s in served), f"a replica served nothing: {served}"
    # At most the prompts plus what was in flight at the kill (the worker's concurrency).
    assert sum(served) <= n + concurrency, f"{sum(served)} generations for {n} prompts"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("replicas", [LONG_FLAGS], indirect=True)
def test_an_abort_reaches_the_replica_running_the_request(replicas, router):
    """The router has no /abort_request (404): genq's abort goes to the replicas, and the request
    running behind the router ends with finish_reason abort."""
    assert post(router, "/abort_request", {"rid": "nothing"})[0] == 404
    rid = "genq-router-abort.0"
    answer: dict = {}

    def long_request() -> None:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8000}, "rid": rid}
        answer["reply"] = post(router, "/generate", body)

    thread = threading.Thread(target=long_request)
    thread.start()
    wait_until(lambda: sum(sim_stats(r.url)["in_flight"] for r in replicas) == 1, 30, "the request to run")

    async def abort() -> list[str]:
        async with Http(router) as http:
            backend = await choose("auto", http)
            info = await backend.probe()
            await backend.abort(rid)
            return info.notes

    notes = asyncio.run(abort())
    thread.join(60)
    assert not thread.is_alive(), "the request still runs"
    status, body = answer["reply"]
    assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "abort", body
    assert any("behind SGLang's router, 2 replicas" in note for note in notes), notes


@pytest.mark.timeout(300)
@pytest.mark.parametrize("replicas", [LONG_FLAGS], indirect=True, ids=["long"])
@pytest.mark.parametrize("router", [("--policy", "round_robin")], indirect=True, ids=["round-robin"])
def test_the_load_behind_the_router_is_the_sum_of_its_replicas(replicas, router):
    """The router serves no load endpoint of its own: `--concurrency auto` steers by the replicas'
    /v1/loads added up, so requests running on either replica count.

    Round robin spreads the three requests over both replicas (the default cache-aware policy sends
    identical prompts to one, where a sum is not tested); the read waits until every request is
    admitted (running, not waiting), so the sum has one answer."""
    rids = [f"genq-router-load.{i}" for i in range(3)]

    def long_request(rid: str) -> None:
        post(
            router,
            "/generate",
            {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8000}, "rid": rid},
        )

    threads = [threading.Thread(target=long_request, args=(rid,)) for rid in rids]
    for thread in threads:
        thread.start()

    def running_on_each() -> list[int]:
        return [load.running if (load := server_load(r.url, "sglang")) else 0 for r in replicas]

    wait_until(lambda: sum(running_on_each()) == 3, 30, "three requests running")
    on_each = running_on_each()
    assert all(on_each), f"round robin left a replica idle: {on_each}"

    async def read():
        async with Http(router) as http:
            backend = await choose("auto", http)
            await backend.probe()
            load = await backend.load()
            for rid in rids:
                await backend.abort(rid)
            return load

    one = server_load(replicas[0].url, "sglang")
    load = asyncio.run(read())
    for thread in threads:
        thread.join(60)
    assert load is not None and (load.running, load.waiting) == (3, 0), (load, on_each)
    assert one is not None and load.kv_tokens == 2 * one.kv_tokens and load.max_running == 2 * one.max_running
