"""A real inference engine for tests: llama.cpp's ``llama-server`` on a tiny model made at test time.

The server is built once by ``ops/llamacpp/build-server.sh`` (cached outside the clone; `.ci/run`
and `make test` build it first). Without it, or without the build tools, the real-engine tests
skip, except in CI, where they fail saying why.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from genq.commands.embedded import free_port
from tests.helpers import server_up, wait_until

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "ops" / "llamacpp" / "build-server.sh"
TINY_MODEL = ROOT / "ops" / "llamacpp" / "tiny_model.py"
SLOTS = 8
CONTEXT = 4096  # per slot: 4096 / 8 = 512


def server_binary() -> str:
    """The cached llama-server (the build script prints its path; a cache hit takes milliseconds)."""
    res = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, timeout=1200)
    path = res.stdout.strip().splitlines()[-1] if res.returncode == 0 and res.stdout.strip() else ""
    if not path or not os.access(path, os.X_OK):
        why = f"llama-server could not be built: {res.stderr.strip().splitlines()[-1:] or res.returncode}"
        if os.environ.get("CI"):
            pytest.fail(why + " (.ci/run installs cmake and g++ and builds it)")
        pytest.skip(why)
    return path


def write_model(folder: Path) -> tuple[Path, Path]:
    """The tiny model (GGUF) and its Hugging Face tokenizer (the same ids as the server's)."""
    model, tokenizer = folder / "model.gguf", folder / "tokenizer"
    subprocess.run(
        [sys.executable, str(TINY_MODEL), str(model), "--hf-tokenizer", str(tokenizer)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return model, tokenizer


class LlamaServer:
    """One llama-server process on a fixed port, which tests may kill, stop and restart."""

    def __init__(self, binary: str, model: Path, log: Path, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [
            binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
            "-t", "1", "--parallel", str(SLOTS), "-c", str(CONTEXT), *flags,
        ]  # fmt: skip
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> LlamaServer:
        with self.log.open("ab") as fh:
            proc = self.proc = subprocess.Popen(self.argv, stdout=fh, stderr=subprocess.STDOUT)

        def up() -> bool:
            assert proc.poll() is None, (
                f"llama-server exited ({proc.returncode}): {self.log.read_text()[-2000:]}"
            )
            return server_up(self.url)

        wait_until(up, 60, "llama-server to load its model")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="session")
def llama_model(tmp_path_factory) -> tuple[str, Path, Path]:
    """(server binary, model, tokenizer folder), made once per test session."""
    binary = server_binary()
    model, tokenizer = write_model(tmp_path_factory.mktemp("llama"))
    return binary, model, tokenizer


@pytest.fixture
def llama(llama_model, tmp_path) -> Iterator[LlamaServer]:
    binary, model, _ = llama_model
    server = LlamaServer(binary, model, tmp_path / "llama-server.log").start()
    yield server
    server.stop()


def direct(url: str, prompts: list[list[int]], n_predict: int, field: str = "tokens") -> list[Any]:
    """Each prompt's greedy output (its ``field``: the tokens, or the ``content``), asked of the
    server directly (16 at a time), for comparison."""
    import asyncio

    import aiohttp

    async def run() -> list[Any]:
        gate = asyncio.Semaphore(16)
        async with aiohttp.ClientSession() as session:

            async def one(ids: list[int]) -> Any:
                body = {"prompt": ids, "n_predict": n_predict, "temperature": 0.0, "return_tokens": True}
                async with gate, session.post(url + "/completion", data=orjson.dumps(body)) as resp:
                    assert resp.status == 200, await resp.text()
                    return (await resp.json())[field]

            return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(run())


def tiny_prompts(
    n: int, seed: int = 0, length: tuple[int, int] = (4, 40), ids: tuple[int, int] = (259, 2048)
) -> list[list[int]]:
    """Prompts of ordinary pieces of a tiny vocabulary (by default the GGUF's, ids 259..2047), no
    BOS, as a tokenizer would have made them."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(*ids) for _ in range(rng.randint(*length))] for _ in range(n)]
