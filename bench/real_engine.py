"""genq against a bare client on the same real engine, a tiny model made for the run.

    python bench/real_engine.py [--engine sglang|vllm|llamacpp] [--prompts 2000] [--max-new-tokens 32]
                                [--concurrency 16,64] [--rounds 2] [--auto] [--n-vocab N]
                                [--bare-body] [--beside]

One real server: SGLang or vLLM on the CPU (their venvs from ops/engines/, the tiny Hugging Face
llama of ops/engines/tiny_model.py) or llama.cpp's llama-server (``-t 1``, built by
ops/llamacpp/build-server.sh, a tiny GGUF; ``--n-vocab`` gives it a real model's vocabulary size,
which is what the server's sampler pays for), its batch as large as the most in flight. For each
number in flight, ``--rounds`` rounds of: a bare aiohttp client sending every prompt (greedy, the
engine's own token-id API) and waiting for every answer; then genq doing the same work end to end
— a private redis-server, `genq enqueue` (prefilled), one `genq worker --burst` and `genq collect
--burst` — until both exit; with ``--auto`` also genq at ``--concurrency auto``. Two controls
tell a server that works harder for genq's requests from one that has less CPU left: with
``--bare-body`` the bare client also sends the bodies (and headers) genq's backend builds, and with
``--beside`` it also runs while genq serves the simulator beside it. Alternating
(ABAB), so a server that speeds up or slows down as it runs favours neither, and the spread over
rounds is reported.

Side by side: requests/s and tokens/s, the ratio to the bare client of the same round, the
server's own CPU per request (its whole process tree: the engine-side evidence — a server that
works harder for genq's requests than for the bare client's shows it here), and genq's CPU per
job by process (worker, collector, Redis) once each is ready, beside their start-up CPU (Python,
imports, the server probe: paid once per process, so its share per job falls as a run grows) and
the whole per job. The two cores are shared by the server, the client and genq, so the ratios are
what to read. Results go to bench/results/<engine>.json (<engine>-vocab-<N>.json with
``--n-vocab``, <engine>-<N>.json with ``--prompts N`` other than 2,000).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import cpu_s, machine, tree_cpu_s  # noqa: E402
from genq.backends import BACKENDS, Http  # noqa: E402
from genq.commands.embedded import EmbeddedRedis, free_port  # noqa: E402
from genq.schema import JobSpec  # noqa: E402
from tests.engines import (  # noqa: E402
    EngineServer,
    engine_python,
    hf_prompts,
    sglang_server,
    vllm_server,
    write_tiny_model,
)
from tests.llama import TINY_MODEL, LlamaServer, server_binary, tiny_prompts  # noqa: E402

# What each process logs once it is ready to work: its CPU until then is its start-up (Python, its
# imports, the server probe), paid once per process, not per job.
READY = {"worker": "serving", "collector": "holds dataset"}
PROCS = ("worker", "collector", "redis")
DEFAULT_PROMPTS = 2000

# Each engine's token-id API: the request body, and the generated ids in its answer.
REQUESTS: dict[str, tuple[str, Callable[[list[int], int], dict], Callable[[dict], list[int]]]] = {
    "llamacpp": (
        "/completion",
        lambda ids, n: {"prompt": ids, "n_predict": n, "temperature": 0.0, "return_tokens": True},
        lambda answer: answer["tokens"],
    ),
    "sglang": (
        "/generate",
        lambda ids, n: {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0.0}},
        lambda answer: answer["output_ids"],
    ),
    "vllm": (
        "/v1/completions",
        lambda ids, n: {"prompt": ids, "max_tokens": n, "temperature": 0.0, "return_token_ids": True},
        lambda answer: answer["choices"][0]["token_ids"],
    ),
}


# A request body and headers for (prompt ids, new tokens, the prompt's number).
Request = Callable[[list[int], int, int], tuple[dict, dict[str, str]]]


def genq_request(engine: str, url: str) -> Request:
    """(body, headers) exactly as genq's backend builds them for a greedy job (``--bare-body
    genq``): the same builder the worker calls, probed once for the server's model and vocabulary."""

    async def probed():
        async with Http(url) as http:
            backend = BACKENDS[engine](http)
            await backend.probe()
            return backend

    backend = asyncio.run(probed())

    def request(ids: list[int], n: int, k: int) -> tuple[dict, dict[str, str]]:
        params = {"max_new_tokens": n, "temperature": 0.0}
        spec = JobSpec(
            dataset="bench", row=k, sample=0, id=f"bench-{k}", sampling_params=params, input_ids=ids
        )
        rid = f"genq:bench:job:{k}.1.{os.urandom(6).hex()}"  # worker/attempts.py's shape
        if engine == "sglang":
            return backend.body(spec, rid), {}  # type: ignore[call-arg]
        return backend.body(spec), ({"X-Request-Id": rid} if engine == "vllm" else {})  # type: ignore[call-arg]

    return request


async def bare(
    engine: str,
    url: str,
    prompts: list[list[int]],
    n_predict: int,
    concurrency: int,
    request: Request | None = None,
) -> int:
    """Every prompt through one aiohttp session, ``concurrency`` in flight; generated tokens. The
    body is the engine's plainest (REQUESTS), or what ``request`` makes (genq's own)."""
    path, body, output = REQUESTS[engine]
    gate = asyncio.Semaphore(concurrency)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def one(k: int, ids: list[int]) -> int:
            sent, extra = request(ids, n_predict, k) if request else (body(ids, n_predict), {})
            async with (
                gate,
                session.post(url + path, data=orjson.dumps(sent), headers={**headers, **extra}) as resp,
            ):
                assert resp.status == 200, await resp.text()
                return len(output(await resp.json()))

        return sum(await asyncio.gather(*(one(k, p) for k, p in enumerate(prompts))))


def run_bare(*args: Any) -> dict:
    """The bare client (:func:`bare`'s arguments) in this process (its imports paid already): wall
    time, and its CPU, the floor genq's worker is measured against."""
    prompts = args[2]
    started, cpu = time.monotonic(), time.process_time()
    tokens = asyncio.run(bare(*args))
    return {
        "wall_s": time.monotonic() - started,
        "records": len(prompts),
        "tokens": tokens,
        "cpu_s": {"client": time.process_time() - cpu},
    }


def run_genq(engine: str, url: str, data: Path, work: Path, n_predict: int, concurrency: str) -> dict:
    """genq end to end, timed from the worker's spawn to the last process's exit; each process's CPU."""
    work.mkdir(parents=True)
    redis = EmbeddedRedis(work / "redis", port=free_port())
    env = {**os.environ, "GENQ_REDIS_URL": redis.start(), "GENQ_NAMESPACE": "bench"}
    genq = [sys.executable, "-P", "-m", "genq"]
    try:
        subprocess.run(
            [*genq, "enqueue", str(data), "--max-new-tokens", str(n_predict), "--temperature", "0"],
            env=env,
            check=True,
            capture_output=True,
        )
        assert redis.proc is not None
        redis_pid = redis.proc.pid
        redis_before = cpu_s(redis_pid)
        started = time.monotonic()
        worker = [
            *genq,
            "worker",
            "--server",
            url,
            "--backend",
            engine,
            "--burst",
            "--concurrency",
            concurrency,
        ]
        commands = {"worker": worker, "collector": [*genq, "collect", "--out", str(work / "out"), "--burst"]}
        logs = {name: work / f"{name}.log" for name in commands}
        procs = {
            name: subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=logs[name].open("wb"))
            for name, command in commands.items()
        }
        cpu = dict.fromkeys(procs, 0.0)
        startup: dict[str, float] = {}
        while any(p.poll() is None for p in procs.values()):
            for name, p in procs.items():
                if p.poll() is None:
                    cpu[name] = cpu_s(p.pid)  # read while it runs: a reaped process has none
                    if name not in startup and READY[name] in logs[name].read_text(errors="replace"):
                        startup[name] = cpu[name]
            time.sleep(0.05)
        wall = time.monotonic() - started
        cpu["redis"] = cpu_s(redis_pid) - redis_before
        assert all(p.returncode == 0 for p in procs.values()), {n: p.returncode for n, p in procs.items()}
        lines = (work / "out" / "bench" / "raw_responses.jsonl").read_bytes().splitlines()
        tokens = sum(orjson.loads(line)["completion_tokens"] for line in lines)
        return {
            "wall_s": wall,
            "records": len(lines),
            "tokens": tokens,
            "cpu_s": cpu,
            "startup_cpu_s": startup,
        }
    finally:
        redis.stop()


# The simulator genq serves beside the bare client (--beside): a decode step this long puts 16
# requests in flight at about 50 a second, genq's pace against these engines.
BESIDE_STEP_MS = "10"


@contextlib.contextmanager
def genq_beside(data: Path, work: Path, n_predict: int, concurrency: int) -> Iterator[None]:
    """genq's worker, collector and Redis busy beside the bare client, serving the simulator
    (whose own CPU comes with it): their CPU on the engine's cores without their requests."""
    port = free_port()
    argv = [sys.executable, "-P", "-m", "genq", "sim-server", "--port", str(port), "--latency", "realistic"]
    sim = subprocess.Popen(
        [*argv, "--decode-step-ms", BESIDE_STEP_MS], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert sim.stdout is not None
        assert b"listening on" in sim.stdout.readline(), "the simulator did not start"
        url = f"http://127.0.0.1:{port}"
        job = threading.Thread(target=run_genq, args=("sglang", url, data, work, n_predict, str(concurrency)))
        job.start()
        log, deadline = work / "worker.log", time.monotonic() + 60
        while READY["worker"] not in (log.read_text(errors="replace") if log.exists() else ""):
            assert job.is_alive() and time.monotonic() < deadline, "genq beside did not start serving"
            time.sleep(0.05)
        yield
        job.join()
    finally:
        sim.terminate()
        sim.wait()


@contextlib.contextmanager
def engine_server(
    engine: str, work: Path, batch: int, n_vocab: int | None, *extra: str
) -> Iterator[tuple[str, int, Callable[[int], list[list[int]]]]]:
    """(the server's URL, its pid, prompts of its tiny vocabulary) while the server runs, started
    with the tests' flags, room for ``batch`` requests running at once, and ``extra`` flags."""
    if engine == "llamacpp":
        model = work / "model.gguf"
        vocab = ["--n-vocab", str(n_vocab)] if n_vocab else []
        subprocess.run([sys.executable, str(TINY_MODEL), str(model), *vocab], check=True, capture_output=True)
        # --cache-ram 0: llama-server keeps every finished prompt's state in a host-RAM cache (8 GiB by
        # default, llama.cpp PR 16391) and grows slower as it fills: 200 requests/s over the first
        # 2,000 distinct prompts, 148 over the fourth, 28 on average over 20,000 (16 in flight). The
        # benchmark measures the client, so the server does not drift under it (232-276/s without).
        flags = ("--parallel", str(batch), "-c", str(512 * batch), "--cache-ram", "0", *extra)
        server: LlamaServer | EngineServer = LlamaServer(server_binary(), model, work / "server.log", *flags)
        prompts = partial(tiny_prompts, seed=7)
    else:
        python = engine_python(engine)
        model = write_tiny_model(python, work / "model")
        log = work / "server.log"
        if engine == "sglang":
            server = sglang_server(python, model, log, "--max-running-requests", str(batch), *extra)
        else:
            server = vllm_server(python, model, log, "--max-num-seqs", str(batch), *extra)
        prompts = partial(hf_prompts, seed=7)
    server.start()
    try:
        assert server.proc is not None
        yield server.url, server.proc.pid, prompts
    finally:
        server.stop()


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=sorted(REQUESTS), default="sglang")
    ap.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--concurrency", default="16,64", help="in flight, comma-separated (default 16,64)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of bare, genq (ABAB) per setting")
    ap.add_argument("--auto", action="store_true", help="also genq at --concurrency auto, each round")
    ap.add_argument("--n-vocab", type=int, default=None, help="llamacpp: the tiny model's vocabulary size")
    ap.add_argument(
        "--bare-body", action="store_true", help="also the bare client sending genq's own request bodies"
    )
    ap.add_argument(
        "--beside", action="store_true", help="also the bare client with genq serving the simulator beside it"
    )
    args = ap.parse_args()
    engine = args.engine
    settings = [int(c) for c in args.concurrency.split(",")]
    controls = [
        *(["bare, genq's body"] if args.bare_body else []),
        *(["bare, genq beside"] if args.beside else []),
    ]
    clients = ["bare", *controls, "genq", *(["genq auto"] if args.auto else [])]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix=f"genq-bench-{engine}-") as tmp:
        work = Path(tmp)
        with engine_server(engine, work, max(settings), args.n_vocab) as (url, server_pid, make_prompts):
            prompts = make_prompts(args.prompts)
            data = work / "bench.jsonl"
            data.write_bytes(b"".join(orjson.dumps({"input_ids": p}) + b"\n" for p in prompts))
            asyncio.run(bare(engine, url, prompts[:50], args.max_new_tokens, max(settings)))  # warm up
            genq_body = genq_request(engine, url) if args.bare_body else None
            for concurrency in settings:
                for round_ in range(1, args.rounds + 1):
                    for client in clients:
                        before = tree_cpu_s(server_pid)
                        if client == "bare":
                            row = run_bare(engine, url, prompts, args.max_new_tokens, concurrency)
                        elif client == "bare, genq's body":
                            row = run_bare(engine, url, prompts, args.max_new_tokens, concurrency, genq_body)
                        elif client == "bare, genq beside":
                            with genq_beside(
                                data, work / f"beside-{len(runs)}", args.max_new_tokens, concurrency
                            ):
                                row = run_bare(engine, url, prompts, args.max_new_tokens, concurrency)
                        else:
                            flight = "auto" if client == "genq auto" else str(concurrency)
                            folder = work / f"genq-{len(runs)}"
                            row = run_genq(engine, url, data, folder, args.max_new_tokens, flight)
                        row["server_cpu_s"] = tree_cpu_s(server_pid) - before
                        runs.append({"client": client, "concurrency": concurrency, "round": round_, **row})
                        print(json.dumps(runs[-1]), flush=True)
    table = Table(
        title=f"{engine} (tiny model{f', {args.n_vocab:,}-id vocabulary' if args.n_vocab else ''}, CPU), "
        f"{args.prompts} prompts, {args.max_new_tokens} new tokens; {args.rounds} rounds each, alternating"
    )
    columns = ("in flight", "client", "requests/s", "tokens/s", "vs bare", "server CPU ms/request")
    genq_columns = (
        "CPU ms/job once ready: worker (bare: the client)",
        "collector",
        "Redis",
        "all",
        "start-up CPU s",
        "all, per job",
    )
    for col in (*columns, *genq_columns):
        table.add_column(col, justify="right")
    summary: dict[str, dict[str, float]] = {}
    for concurrency in settings:
        mine = [r for r in runs if r["concurrency"] == concurrency]
        bare_wall = {r["round"]: r["wall_s"] for r in mine if r["client"] == "bare"}
        for client in clients:
            rows = [r for r in mine if r["client"] == client]
            ratios = [bare_wall[r["round"]] / r["wall_s"] for r in rows]
            genq_cells = ["-"] * len(genq_columns)
            if client.startswith("bare"):  # the client's own CPU, in the worker's column
                genq_cells[0] = spread([1000 * r["cpu_s"]["client"] / r["records"] for r in rows])
            else:
                ready = [
                    {**r["cpu_s"], **{n: r["cpu_s"][n] - s for n, s in r["startup_cpu_s"].items()}}
                    for r in rows
                ]
                ready_ms = [1000 * sum(c.values()) / r["records"] for c, r in zip(ready, rows, strict=True)]
                total = [1000 * sum(r["cpu_s"].values()) / r["records"] for r in rows]
                genq_cells = [
                    *(
                        spread([1000 * c[n] / r["records"] for c, r in zip(ready, rows, strict=True)])
                        for n in PROCS
                    ),
                    spread(ready_ms),
                    spread([sum(r["startup_cpu_s"].values()) for r in rows]),
                    spread(total),
                ]
            table.add_row(
                str(concurrency),
                client,
                spread([r["records"] / r["wall_s"] for r in rows]),
                spread([r["tokens"] / r["wall_s"] for r in rows]),
                spread(ratios),
                spread([1000 * r["server_cpu_s"] / r["records"] for r in rows]),
                *genq_cells,
            )
            if client.startswith("bare,"):
                summary[f"{client} at {concurrency}"] = {"vs_bare_mean": statistics.mean(ratios)}
            elif client != "bare":
                summary[f"{client} at {concurrency}"] = {
                    "vs_bare_mean": statistics.mean(ratios),
                    "cpu_ms_per_job_mean": statistics.mean(total),
                    "cpu_ms_per_job_once_ready_mean": statistics.mean(ready_ms),
                }
    Console(width=200).print(table)
    vocab = f"-vocab-{args.n_vocab}" if args.n_vocab else ""
    size = f"-{args.prompts}" if args.prompts != DEFAULT_PROMPTS else ""
    out = ROOT / "bench" / "results" / f"{engine}{vocab}{size}.json"
    result = {"machine": machine(), "args": vars(args), "runs": runs, "summary": summary}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
