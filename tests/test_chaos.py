"""The chaos test: thousands of prompts through faults and kills; then every invariant on disk.

During one run: the simulator injects 5 % 500s, 1 % connection resets, 1 % HTTP-200 aborts,
0.5 % truncated bodies and 0.3 % hangs; some prompts are too long for the context; workers are
SIGKILLed twice and SIGTERMed once, the collector SIGKILLed twice, Redis SIGKILLed and restarted
once (AOF on). Afterwards every normal prompt is in raw_responses.jsonl exactly once with the
server's output_ids, every too-long one is in errors.jsonl with the server's reason, no line is
torn, the stream is empty and `genq status` adds up.
"""

from __future__ import annotations

import time

import orjson
import pytest
import redis

from genq import progress
from genq.commands.embedded import EmbeddedRedis
from genq.keys import Keys
from genq.sim.model import generate, render_chat
from tests.helpers import Procs, log_of, read_jsonl, sigkill, sim_stats, stop, wait_until, write_jsonl

TOO_LONG_EVERY = 50  # 2 % of the prompts cannot fit the context
CONTEXT = 1024
MAX_NEW = 200
WORDS = ("sea", "sky", "wind", "rain", "stone", "tree", "road", "fire", "song", "light")

# backend -> (the simulator's API, prompts): SGLang's full run, and a shorter one for each other
# engine API (the same faults and kills; their error paths differ, not the bookkeeping).
BACKENDS = {"sglang": ("sglang", 3000), "vllm": ("vllm", 1500), "openai-chat": ("openai-chat", 1500)}
# The simulator's names of the faults injected below (--fail-500, -reset, -abort, -truncate, -hang).
FAULTS = ("error_500", "reset", "abort", "truncate", "hang")

# Wait budgets, in seconds. RUN_S is shared by every wait for progress of the run (a minute for
# SGLang's 3,000 prompts on two busy cores); the rest bound one step each.
RUN_S = 480
STEPS_S = sum(
    (
        120,  # the enqueue
        2 * 20,  # Redis started twice
        30,  # the workers find Redis gone
        5 * 10 + 30,  # five SIGKILLs and a SIGTERM
        4 * 60,  # the workers and the collector stopped at the end
        10 + 120,  # the simulator's counters, `genq status`
    )
)


def _prompts(n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        # Too long: past the context even without output (vLLM clamps what only overflows with it).
        length = 1100 if i % TOO_LONG_EVERY == 7 else 4 + i % 60
        prompts.append([100 + (i * 31 + j * 17) % 30000 for j in range(length)])
    return prompts


def _text(ids: list[int]) -> str:
    return " ".join(WORDS[i % len(WORDS)] + str(i % 97) for i in ids)


@pytest.mark.chaos
@pytest.mark.timeout(RUN_S + STEPS_S + 60)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_chaos(procs: Procs, start_sim, tmp_path, namespace, report, backend):
    api, N = BACKENDS[backend]
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    env = {"GENQ_REDIS_URL": url}
    out = tmp_path / "out"
    sim = start_sim(
        "--latency",
        "realistic",
        "--decode-step-ms",
        "6",
        "--min-len",
        "16",
        "--max-len",
        "160",
        "--context-length",
        str(CONTEXT),
        "--fail-500",
        "0.05",
        "--fail-reset",
        "0.01",
        "--fail-abort",
        "0.01",
        "--fail-truncate",
        "0.005",
        "--fail-hang",
        "0.003",
        "--api",
        api,
    )
    prompts = _prompts(N)
    data = tmp_path / "chaos.jsonl"
    if backend == "openai-chat":  # conversations the server renders; prompt ids are its own
        texts = [_text(p) for p in prompts]
        write_jsonl(data, [{"prompt": t} for t in texts])
        prompts = [render_chat([{"role": "user", "content": t}]) for t in texts]
    else:
        write_jsonl(data, [{"input_ids": p} for p in prompts])
    worker_args = (
        "worker",
        "--server",
        sim,
        "--backend",
        backend,
        "--concurrency",
        "48",
        "--heartbeat-ttl",
        "5",
        "--grace",
        "3",
        "--request-timeout",
        "10",
        "--max-attempts",
        "8",
    )
    conn = redis.Redis.from_url(url)
    keys = Keys(namespace)
    deadline = time.monotonic() + RUN_S

    def counts() -> dict | None:
        try:
            return progress.dataset_counts(conn, keys).get("chaos")
        except redis.ConnectionError:
            return None

    def at(fraction: float) -> None:
        """Wait, within the run's budget, until ``fraction`` of the jobs are on disk."""
        wait_until(
            lambda: (c := counts()) and c["done"] + c["failed"] >= fraction * N,
            max(deadline - time.monotonic(), 0),
            f"{fraction:.0%} on disk (all such waits share {RUN_S} s)",
            interval=0.2,
        )

    def kill_point(fraction: float) -> None:
        """``at(fraction)``, and the kill that follows lands mid-run: jobs in flight, jobs left."""
        at(fraction)
        c = counts()
        assert c and c["in_flight"] > 0 and c["done"] + c["failed"] < N, (
            f"at {fraction:.0%}: no work in progress for the kill to interrupt: {c}"
        )

    def outages_seen() -> int:
        return sum(log_of(w).count("Redis unreachable") for w in workers)

    try:
        enqueue = procs.run("enqueue", data, "--max-new-tokens", str(MAX_NEW), "--backend", backend, env=env)
        assert enqueue.returncode == 0, enqueue.stderr
        collector = procs.start("collect", "--out", out, env=env)
        workers = [procs.start(*worker_args, env=env) for _ in range(3)]
        kill_point(0.10)
        sigkill(workers[0])
        workers[0] = procs.start(*worker_args, env=env)
        kill_point(0.20)
        sigkill(collector)
        collector = procs.start("collect", "--out", out, env=env)
        kill_point(0.30)
        seen = outages_seen()
        server.proc.kill()  # Redis dies hard; AOF brings it back
        server.proc.wait()
        wait_until(lambda: outages_seen() > seen, 30, "the workers to find Redis gone")
        server = EmbeddedRedis(tmp_path / "redis", port=server.port)
        server.start()
        kill_point(0.45)
        assert stop(workers[1], timeout=30) == 0, log_of(workers[1])  # SIGTERM: drains
        workers[1] = procs.start(*worker_args, env=env)
        kill_point(0.60)
        sigkill(collector)
        collector = procs.start("collect", "--out", out, env=env)
        kill_point(0.70)
        sigkill(workers[2])
        workers[2] = procs.start(*worker_args, env=env)
        at(1.0)
        for w in workers:
            assert stop(w, timeout=60) == 0, log_of(w)
        assert stop(collector, timeout=60) == 0, log_of(collector)
        server_stats = sim_stats(sim)
        final_status = procs.run("status", "--json", env=env)
    finally:
        server.stop()

    records = read_jsonl(out / "chaos" / "raw_responses.jsonl")
    errors = read_jsonl(out / "chaos" / "errors.jsonl")
    retried = sum(1 for r in records if r["attempts"] > 1)
    # The scenario happened: the server injected every kind of fault, and records needed retries.
    fired = server_stats["faults"]
    assert all(fired[kind] > 0 for kind in FAULTS), (
        f"faults injected by the server: {fired}; expected {FAULTS}"
    )
    assert retried > 0, "no record needed a retry: the faults reached no job"

    # Invariants, on the files on disk.
    too_long = {row for row, p in enumerate(prompts) if len(p) >= CONTEXT}
    assert len(too_long) == N // TOO_LONG_EVERY
    assert {e["row"] for e in errors} == too_long, "only the too-long prompts failed"
    assert all(e["error"] == "bad_request" and "context length" in e["message"] for e in errors)
    assert len(errors) == len({e["id"] for e in errors})
    normal = [p if row not in too_long else None for row, p in enumerate(prompts)]
    _check_normal(out, normal, token_exact=backend != "openai-chat")
    status = orjson.loads(final_status.stdout)
    c = status["datasets"]["chaos"]
    assert (c["total"], c["done"], c["failed"], c["queued"], c["in_flight"]) == (
        N,
        N - len(too_long),
        len(too_long),
        0,
        0,
    )
    assert status["stream"]["length"] == 0

    stats = server_stats
    wasted = stats["generations"] - len(records)
    wasted_tokens = stats["tokens_generated"] - sum(r["completion_tokens"] for r in records)
    report(
        f"chaos ({backend}): {N} prompts, {len(records)} records, {len(errors)} errors; the simulator "
        f"finished {stats['generations']} generations: {wasted} ({wasted / len(records):.1%}) did not become "
        f"the record; {wasted_tokens} of {stats['tokens_generated']} decode tokens "
        f"({wasted_tokens / stats['tokens_generated']:.1%}) wasted; records that needed a retry: {retried}; "
        f"faults injected: {', '.join(f'{kind} {fired[kind]}' for kind in FAULTS)}"
    )


def _check_normal(out, normal: list[list[int] | None], token_exact: bool) -> None:
    """Each prompt that can fit exactly once, with the server's output_ids (its text, for a chat
    server that returns no ids); the others not at all."""
    rows = [i for i, p in enumerate(normal) if p is not None]
    records = read_jsonl(out / "chaos" / "raw_responses.jsonl")
    assert sorted(r["row"] for r in records) == rows, "each normal prompt exactly once"
    for r in records:
        expected = generate(normal[r["row"]], {"max_new_tokens": MAX_NEW}, min_len=16, max_len=160)
        if token_exact:
            assert r["output_ids"] == expected.output_ids, r["id"]
        else:
            assert (r["text"], r["output_ids"], r["token_exact"]) == (expected.text, None, False), r["id"]
