"""The bare client genq is measured against: every prompt to SGLang's /generate through one aiohttp
session, ``concurrency`` in flight, each answer read and parsed. Nothing else.

    python bench/bare_client.py URL PROMPTS.jsonl MAX_NEW_TOKENS CONCURRENCY

Run as a script it is a process like genq's, timed from its start to its exit: Python's start-up
and aiohttp's import are paid by both sides. It imports nothing but aiohttp and orjson for that.
"""

from __future__ import annotations

import asyncio
import sys

import aiohttp
import orjson


async def send_all(url: str, prompts: list[list[int]], max_new: int, concurrency: int) -> None:
    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(ids: list[int]) -> None:
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new}}
            async with gate, session.post(url + "/generate", data=orjson.dumps(body)) as resp:
                answer = orjson.loads(await resp.read())
                assert resp.status == 200 and answer["meta_info"]["completion_tokens"] > 0, answer

        await asyncio.gather(*(one(p) for p in prompts))


if __name__ == "__main__":
    url, path, max_new, concurrency = sys.argv[1:]
    with open(path, "rb") as fh:
        prompts = [orjson.loads(line)["input_ids"] for line in fh]
    asyncio.run(send_all(url, prompts, int(max_new), int(concurrency)))
