"""genq against a bare client on the same real engine, a tiny model made for the run.

    python bench/real_engine.py [--engine sglang|vllm|llamacpp] [--prompts 2000] [--max-new-tokens 32]
                                [--concurrency 16]

One real server: SGLang or vLLM on the CPU (their venvs from ops/engines/, the tiny Hugging Face
llama of ops/engines/tiny_model.py) or llama.cpp's llama-server (``-t 1 --parallel 8``, built by
ops/llamacpp/build-server.sh, a tiny GGUF). First a bare aiohttp client sends every prompt (greedy,
the given number in flight, the engine's own token-id API) and waits for all answers; then genq
does the same work end to end — a private redis-server, `genq enqueue` (prefilled), one `genq
worker --burst` and `genq collect --burst` — until both processes exit. Side by side in one run:
requests/s, generated tokens/s and their ratio, CPU per job of genq's own processes. The two cores
are shared by the server, the client and genq, so the ratio is what to read. Results go to
bench/results/<engine>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import aiohttp
import orjson
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import cpu_s, machine  # noqa: E402
from genq.commands.embedded import EmbeddedRedis, free_port  # noqa: E402
from tests.engines import (  # noqa: E402
    EngineServer,
    engine_python,
    hf_prompts,
    sglang_server,
    vllm_server,
    write_tiny_model,
)
from tests.llama import LlamaServer, server_binary, tiny_prompts, write_model  # noqa: E402

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


async def bare(engine: str, url: str, prompts: list[list[int]], n_predict: int, concurrency: int) -> int:
    """Every prompt through one aiohttp session, ``concurrency`` in flight; generated tokens."""
    path, body, output = REQUESTS[engine]
    gate = asyncio.Semaphore(concurrency)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def one(ids: list[int]) -> int:
            async with (
                gate,
                session.post(url + path, data=orjson.dumps(body(ids, n_predict)), headers=headers) as resp,
            ):
                assert resp.status == 200, await resp.text()
                return len(output(await resp.json()))

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def run_genq(engine: str, url: str, data: Path, work: Path, n_predict: int, concurrency: int) -> dict:
    work.mkdir(parents=True)
    redis = EmbeddedRedis(work / "redis", port=free_port())
    env = {**os.environ, "GENQ_REDIS_URL": redis.start(), "GENQ_NAMESPACE": "bench"}
    genq = [sys.executable, "-m", "genq"]
    try:
        subprocess.run(
            [*genq, "enqueue", str(data), "--max-new-tokens", str(n_predict), "--temperature", "0"],
            env=env,
            check=True,
            capture_output=True,
        )
        started = time.monotonic()
        procs = [
            subprocess.Popen(
                [
                    *genq,
                    "worker",
                    "--server",
                    url,
                    "--backend",
                    engine,
                    "--burst",
                    "--concurrency",
                    str(concurrency),
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            ),
            subprocess.Popen(
                [*genq, "collect", "--out", str(work / "out"), "--burst"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            ),
        ]
        cpu = {p.pid: 0.0 for p in procs}
        while any(p.poll() is None for p in procs):
            for p in procs:
                if p.poll() is None:
                    cpu[p.pid] = cpu_s(p.pid)
            time.sleep(0.05)
        wall = time.monotonic() - started
        assert all(p.returncode == 0 for p in procs), [p.returncode for p in procs]
        lines = (work / "out" / "bench" / "raw_responses.jsonl").read_bytes().splitlines()
        tokens = sum(orjson.loads(line)["completion_tokens"] for line in lines)
        return {"wall_s": wall, "records": len(lines), "tokens": tokens, "cpu_s": sum(cpu.values())}
    finally:
        redis.stop()


@contextlib.contextmanager
def engine_server(
    engine: str, work: Path, *flags: str
) -> Iterator[tuple[str, Callable[[int], list[list[int]]]]]:
    """(the server's URL, prompts of its tiny vocabulary) while the server runs, started with the
    tests' flags and then ``flags`` (the last of a repeated flag wins in each engine)."""
    if engine == "llamacpp":
        model, _ = write_model(work)
        server: LlamaServer | EngineServer = LlamaServer(server_binary(), model, work / "server.log", *flags)
        prompts = partial(tiny_prompts, seed=7)
    else:
        python = engine_python(engine)
        model = write_tiny_model(python, work / "model")
        start = sglang_server if engine == "sglang" else vllm_server
        server = start(python, model, work / "server.log", *flags)
        prompts = partial(hf_prompts, seed=7)
    server.start()
    try:
        yield server.url, prompts
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=sorted(REQUESTS), default="sglang")
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    engine = args.engine
    with tempfile.TemporaryDirectory(prefix=f"genq-bench-{engine}-") as tmp:
        work = Path(tmp)
        with engine_server(engine, work) as (url, make_prompts):
            prompts = make_prompts(args.prompts)
            data = work / "bench.jsonl"
            data.write_bytes(b"".join(orjson.dumps({"input_ids": p}) + b"\n" for p in prompts))
            asyncio.run(bare(engine, url, prompts[:50], args.max_new_tokens, args.concurrency))  # warm up
            # ABBA: bare, genq, genq, bare, so a server that speeds up (or slows down) as it runs
            # favours neither; the ratio is of the summed wall times.
            rows = {}
            for i, client in enumerate(("bare", "genq", "genq", "bare")):
                name = f"{client} ({i + 1})"
                if client == "genq":
                    rows[name] = run_genq(
                        engine, url, data, work / f"genq-{i}", args.max_new_tokens, args.concurrency
                    )
                    continue
                started = time.monotonic()
                tokens = asyncio.run(bare(engine, url, prompts, args.max_new_tokens, args.concurrency))
                rows[name] = {"wall_s": time.monotonic() - started, "records": len(prompts), "tokens": tokens}
                rows[name]["cpu_s"] = None
    bare_wall = sum(r["wall_s"] for n, r in rows.items() if n.startswith("bare")) / 2
    table = Table(
        title=f"{engine} (tiny model, CPU), {args.prompts} prompts, {args.max_new_tokens} new tokens, "
        f"{args.concurrency} in flight"
    )
    for col in ("client", "wall s", "requests/s", "tokens/s", "vs bare", "genq CPU ms/job"):
        table.add_column(col, justify="right")
    for name, r in rows.items():
        rate = r["records"] / r["wall_s"]
        table.add_row(
            name,
            f"{r['wall_s']:.1f}",
            f"{rate:.0f}",
            f"{r['tokens'] / r['wall_s']:.0f}",
            f"{bare_wall / r['wall_s']:.2f}",  # against the mean of the two bare runs
            f"{1000 * r['cpu_s'] / r['records']:.2f}" if r["cpu_s"] is not None else "-",
        )
    Console().print(table)
    out = ROOT / "bench" / "results" / f"{engine}.json"
    genq_wall = sum(r["wall_s"] for n, r in rows.items() if n.startswith("genq")) / 2
    print(f"genq / bare, requests per second, summed over both runs each: {bare_wall / genq_wall:.2f}")
    summary = {"genq_vs_bare": bare_wall / genq_wall}
    result = {"machine": machine(), "args": vars(args), "rows": rows, **summary}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
