"""genq against a bare client on the same real engine: llama.cpp's llama-server, a tiny model.

    python bench/llamacpp.py [--prompts 2000] [--max-new-tokens 32] [--concurrency 16]

One llama-server (``-t 1 --parallel 8``, built by ops/llamacpp/build-server.sh) serves a tiny
random llama written for the run. First a bare aiohttp client sends every prompt (greedy, the
given number in flight) and waits for all answers; then genq does the same work end to end — a
private redis-server, `genq enqueue` (prefilled), one `genq worker --burst` and `genq collect
--burst` — until both processes exit. Side by side in one run: requests/s, generated tokens/s and
their ratio, CPU per job of genq's own processes. The two cores are shared by the server, the
client and genq, so the ratio is what to read. Results go to bench/results/llamacpp.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import cpu_s, machine  # noqa: E402
from genq.embedded import EmbeddedRedis, free_port  # noqa: E402
from tests.llama import LlamaServer, server_binary, tiny_prompts, write_model  # noqa: E402


async def bare(url: str, prompts: list[list[int]], n_predict: int, concurrency: int) -> int:
    """Every prompt through one aiohttp session, ``concurrency`` in flight; generated tokens."""
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def one(ids: list[int]) -> int:
            body = {"prompt": ids, "n_predict": n_predict, "temperature": 0.0, "return_tokens": True}
            async with gate, session.post(url + "/completion", data=orjson.dumps(body)) as resp:
                return len((await resp.json())["tokens"])

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def run_genq(url: str, data: Path, work: Path, n_predict: int, concurrency: int) -> dict:
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
                    "llamacpp",
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
        lines = (work / "out" / "llamacpp" / "raw_responses.jsonl").read_bytes().splitlines()
        tokens = sum(orjson.loads(line)["completion_tokens"] for line in lines)
        return {"wall_s": wall, "records": len(lines), "tokens": tokens, "cpu_s": sum(cpu.values())}
    finally:
        redis.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=2000)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="genq-bench-llama-") as tmp:
        work = Path(tmp)
        model, _ = write_model(work)
        server = LlamaServer(server_binary(), model, work / "llama.log").start()
        try:
            prompts = tiny_prompts(args.prompts, seed=7)
            data = work / "llamacpp.jsonl"
            data.write_bytes(b"".join(orjson.dumps({"input_ids": p}) + b"\n" for p in prompts))
            asyncio.run(bare(server.url, prompts[:50], args.max_new_tokens, args.concurrency))  # warm up
            started = time.monotonic()
            bare_tokens = asyncio.run(bare(server.url, prompts, args.max_new_tokens, args.concurrency))
            bare_wall = time.monotonic() - started
            result = run_genq(server.url, data, work, args.max_new_tokens, args.concurrency)
        finally:
            server.stop()
    rows = {
        "bare aiohttp": {"wall_s": bare_wall, "records": args.prompts, "tokens": bare_tokens, "cpu_s": None},
        "genq": result,
    }
    table = Table(
        title=f"llama-server, {args.prompts} prompts, {args.max_new_tokens} new tokens, "
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
            f"{bare_wall / r['wall_s']:.2f}",
            f"{1000 * r['cpu_s'] / r['records']:.2f}" if r["cpu_s"] is not None else "-",
        )
    Console().print(table)
    out = ROOT / "bench" / "results" / "llamacpp.json"
    out.write_text(json.dumps({"machine": machine(), "args": vars(args), "rows": rows}, indent=2) + "\n")
    print(f"written to {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
