"""genq against SGLang as SGLang's own source says it behaves, through the simulator, which follows
the same facts (sim/versions.py and the comments in sim/request.py name the files).

Prompts that keep a server failing, fresh rids, the start-up probe, API keys, results that look
finished but are not, seeds, and what enqueue refuses before anything reaches a GPU.
"""

from __future__ import annotations

import itertools
import subprocess
import time
from pathlib import Path

import orjson
import pytest
import redis

from genq.commands.embedded import free_port
from genq.keys import Keys
from genq.sim.model import VOCAB_SIZE, generate
from tests.helpers import (
    check_records,
    genq_argv,
    log_of,
    read_jsonl,
    server_up,
    sim_get,
    sim_post,
    sim_stats,
    status_json,
    stop,
    wait_until,
    write_jsonl,
    write_prompts,
)


def write_rows(path: Path, prompts: list[list[int]]) -> None:
    write_jsonl(path, ({"id": f"src-{i}", "input_ids": ids} for i, ids in enumerate(prompts)))


def natural_length(ids: list[int], min_len: int, max_len: int) -> int:
    return generate(ids, {"max_new_tokens": max_len + 1}, min_len=min_len, max_len=max_len).completion_tokens


def ends_within(ids: list[int], limit: int, min_len: int, max_len: int) -> bool:
    """The simulator's answer to ``ids`` ends (EOS) within ``limit`` tokens; cheap for small limits."""
    gen = generate(ids, {"max_new_tokens": limit}, min_len=min_len, max_len=max_len)
    return gen.finish_reason["type"] == "stop"


# -- no prompt loops forever ------------------------------------------------------------------------


def sends_of(url: str, dataset: str, row: int) -> int:
    """How often the server was asked to generate the row, from its own list of request ids (genq's
    ``<job id>.<attempt>.<nonce>``): the server's count, not genq's. (Its 503 count would not do:
    on a loaded machine a short prompt may run past the limit too, its wall time being timed.)"""
    return sum(1 for rid in sim_get(url, "/sim/rids") if rid.split(".", 1)[0].endswith(f"--{dataset}-{row}"))


@pytest.mark.slow
def test_a_prompt_that_always_gets_503_fails_as_server_timeout_while_the_rest_finish(
    procs, start_sim, out, tmp_path
):
    """SGLANG_REQ_RUNNING_TIMEOUT answers a long generation 503 "Request running timeout reached."
    every time. The rest of the dataset is answered meanwhile, so those 503s are the prompt's own:
    charged, and once nothing else is served, charged still as /health vouches for the server."""
    lengths = (8, 2500)
    long = next(ids for i in range(5000) if not ends_within(ids := [100 + i, 7, 9], 2000, *lengths))
    short = list(
        itertools.islice((ids for i in range(40000) if ends_within(ids := [200 + i, 5], 40, *lengths)), 150)
    )
    assert len(short) == 150
    prompts = short[:75] + [long] + short[75:]
    data = tmp_path / "timeouts.jsonl"
    write_rows(data, prompts)
    url = start_sim(
        "--latency", "realistic", "--decode-step-ms", "5", "--min-len", "8", "--max-len", "2500",
        "--req-running-timeout", "3",
    )  # fmt: skip
    assert procs.run("enqueue", data, "--max-new-tokens", "3000").returncode == 0
    worker = procs.start(
        "worker",
        "--server",
        url,
        "--burst",
        "--concurrency",
        "16",
        "--max-attempts",
        "3",
        "--max-spared",
        "2",
    )
    assert worker.wait(180) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    errors = read_jsonl(out / "timeouts" / "errors.jsonl")
    assert [(e["row"], e["error"], e["status"], e["source_id"]) for e in errors] == [
        (75, "server_timeout", 503, "src-75")
    ]
    assert "Request running timeout reached." in errors[0]["message"]
    check_records(
        out, "timeouts", prompts, {"max_new_tokens": 3000}, skip_rows=frozenset({75}), min_len=8, max_len=2500
    )
    sends = sends_of(url, "timeouts", 75)
    assert sends == 3, f"{sends} sends of the prompt: its sends are --max-attempts, each charged"


@pytest.mark.slow
def test_a_prompt_that_always_gets_503_ends_after_max_attempts_even_as_the_last_job(
    procs, start_sim, out, tmp_path
):
    """The poison tail: the prompt that always gets "Request running timeout reached." is the last
    job of the run, so no other answer tells whose fault its 503s are. The worker asks the server
    (/health, a one-token generation on SGLang): healthy, so every send is charged and the prompt
    is in errors.jsonl after --max-attempts sends, however many --max-spared would allow."""
    lengths = (8, 2500)
    long = next(ids for i in range(5000) if not ends_within(ids := [100 + i, 7, 9], 2000, *lengths))
    short = list(
        itertools.islice((ids for i in range(40000) if ends_within(ids := [200 + i, 5], 40, *lengths)), 6)
    )
    prompts = [*short, long]
    data = tmp_path / "tail.jsonl"
    write_rows(data, prompts)
    url = start_sim(
        "--latency", "realistic", "--decode-step-ms", "5", "--min-len", "8", "--max-len", "2500",
        "--req-running-timeout", "1",
    )  # fmt: skip
    assert procs.run("enqueue", data, "--max-new-tokens", "3000").returncode == 0
    worker = procs.start(
        "worker", "--server", url, "--burst", "--concurrency", "2", "--max-attempts", "3",
        "--max-spared", "20",
    )  # fmt: skip
    # docs/failures.md: 3 sends of at most the 1 s running timeout, a /health after each, backoffs
    # of at most 1 + 2 s; spared instead, its 23 sends would back off for minutes.
    assert worker.wait(60) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    errors = read_jsonl(out / "tail" / "errors.jsonl")
    assert [(e["row"], e["error"], e["status"], e["attempts"]) for e in errors] == [
        (6, "server_timeout", 503, 3)
    ]
    assert "Request running timeout reached." in errors[0]["message"]
    check_records(
        out, "tail", prompts, {"max_new_tokens": 3000}, skip_rows=frozenset({6}), min_len=8, max_len=2500
    )
    assert sends_of(url, "tail", 6) == 3, "its sends: exactly --max-attempts, none spared"


@pytest.mark.timeout(420)  # the run's 240 s and the simulator's starts (30 s each)
@pytest.mark.slow
def test_a_prompt_that_crashes_the_server_fails_as_suspect_crash_after_max_crashes(procs, out, tmp_path):
    """SGLang does not check input ids against the vocabulary: this prompt kills the server on
    arrival. The test restarts the server each time; the suspects of a crash are resent one at a
    time, so only the culprit reaches --max-crashes and every other prompt finishes."""
    prompts = write_prompts(tmp_path / "unused.jsonl", 120)
    poison = 57
    prompts[poison] = [101, VOCAB_SIZE + 5, 102]
    data = tmp_path / "poison.jsonl"
    write_rows(data, prompts)
    port = free_port()
    argv = genq_argv(
        "sim-server", "--port", port, "--latency", "realistic", "--decode-step-ms", "5", "--min-len", "20",
        "--max-len", "200",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: server_up(url), 30, "the simulator to listen")
        return proc

    conn = redis.Redis.from_url(procs.env["GENQ_REDIS_URL"])
    crashes_key = Keys(procs.env["GENQ_NAMESPACE"]).crashes

    def seen(crashes: int) -> bool:
        """The worker counted the poison's crashes, failed it, or ended."""
        counted = max(map(int, conn.hvals(crashes_key)), default=0) >= crashes
        return counted or "failing it as the suspect" in log_of(worker) or worker.poll() is not None

    sim = start()
    try:
        assert procs.run("enqueue", data, "--max-new-tokens", "300").returncode == 0
        worker = procs.start(
            "worker", "--server", url, "--burst", "--concurrency", "16", "--max-crashes", "3"
        )
        crashes = 0
        deadline = time.monotonic() + 240
        while worker.poll() is None:
            assert time.monotonic() < deadline, "the run did not end"
            if sim.poll() is not None:
                assert sim.returncode == 134, "the simulator died of something else than the poison"
                crashes += 1
                assert crashes <= 3, "the poison crashed the server more often than --max-crashes"
                # A supervisor restarting the server before the worker has seen it down would make
                # the crash a dropped send to a healthy server (docs/failures.md): real engines
                # take seconds to restart, a starved worker on a loaded 2-core machine may take
                # more than the simulator's 0.5 s to look, so restart once the crash is counted.
                wait_until(
                    lambda n=crashes: seen(n),
                    30,
                    "the worker to count the crash",
                )
                sim = start()
            time.sleep(0.05)
        assert worker.returncode == 0, log_of(worker)
    finally:
        sim.kill()
    assert crashes == 3
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    errors = read_jsonl(out / "poison" / "errors.jsonl")
    assert [(e["row"], e["error"], e["source_id"]) for e in errors] == [
        (poison, "suspect_crash", f"src-{poison}")
    ]
    check_records(
        out,
        "poison",
        prompts,
        {"max_new_tokens": 300},
        skip_rows=frozenset({poison}),
        min_len=20,
        max_len=200,
    )


# -- a fresh rid on every send --------------------------------------------------------------------


@pytest.mark.slow
def test_every_send_has_a_fresh_rid_and_none_is_a_prefix_of_another(procs, start_sim, out, tmp_path):
    """SGLang refuses a rid it still holds (0.5.15+) and silently overwrites it before; it aborts
    every rid that starts with the one given. Refunded sends (503 queue full), drops and aborts all
    resend, and a stray 400 "Duplicate request ID detected" is retried, not a verdict."""
    url = start_sim(
        "--fail-503", "0.25", "--fail-reset", "0.05", "--fail-abort", "0.05", "--fail-duplicate", "0.05"
    )
    data = tmp_path / "rids.jsonl"
    prompts = write_prompts(data, 200)
    assert procs.run("enqueue", data, "--max-new-tokens", "50").returncode == 0
    worker = procs.start("worker", "--server", url, "--burst", "--max-attempts", "20", "--concurrency", "32")
    assert worker.wait(180) == 0, log_of(worker)
    faults = sim_stats(url)["faults"]
    unfired = [kind for kind in ("error_503", "reset", "abort", "duplicate") if not faults[kind]]
    assert not unfired, f"faults that never fired: {unfired} ({faults})"
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    check_records(out, "rids", prompts, {"max_new_tokens": 50})
    assert not read_jsonl(out / "rids" / "errors.jsonl")
    rids = [r for r in sim_get(url, "/sim/rids") if not r.startswith("genq-probe")]
    assert len(rids) > 200 and len(set(rids)) == len(rids), "a rid was sent twice"
    ordered = sorted(rids)
    prefixes = [(a, b) for a, b in zip(ordered, ordered[1:], strict=False) if b.startswith(a)]
    assert not prefixes, f"rids that are prefixes of others: {prefixes[:3]}"


# -- know the server before the first job -------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "why"),
    [("0.4.6", "without output_ids"), ("0.5.1", "output_ids are not the completion's")],
)
def test_a_server_genq_cannot_use_is_refused_at_start_in_one_line(procs, start_sim, tmp_path, version, why):
    url = start_sim("--sglang-version", version)
    data = tmp_path / "old.jsonl"
    write_prompts(data, 10)
    assert procs.run("enqueue", data, "--max-new-tokens", "50").returncode == 0
    worker = procs.start("worker", "--server", url, "--burst")
    assert worker.wait(60) == 78
    lines = [line for line in log_of(worker).splitlines() if "ERROR" in line]
    assert len(lines) == 1 and why in lines[0] and ">= 0.5.5" in lines[0], log_of(worker)
    assert sim_stats(url)["requests"] == 1, "only the probe reached the server"
    assert status_json(procs)["datasets"]["old"]["queued"] == 10


def test_sglang_0_5_5_works_through_its_old_routes(procs, start_sim, out, tmp_path):
    """0.5.5 has only /get_server_info; context_length is null there, max_req_input_len says it."""
    url = start_sim("--sglang-version", "0.5.5", "--model-context-length", "512")
    data = tmp_path / "v055.jsonl"
    rows = [[101] * 100, [101] * 506, [101] * 505]  # max_req_input_len = 512 - 6
    write_rows(data, rows)
    res = procs.run("enqueue", data, "--max-new-tokens", "2", "--server", url)
    assert res.returncode == 3, res.stderr  # rows rejected, the rest enqueued
    assert "enqueued 2, skipped 0, rejected 1" in res.stdout
    assert (
        f"{data}:2: field 'input_ids': 506 prompt tokens; the server takes only prompts shorter than 506"
        in res.stderr
    )
    # Not --burst: the worker is still registered when its report is read.
    worker = procs.start("worker", "--server", url)
    wait_until(lambda: _streamed(procs) == 2, 60, "both jobs done")
    (shown,) = status_json(procs)["workers"]
    assert (shown["backend"], shown["server_version"]) == ("sglang", "0.5.5"), shown
    assert stop(worker) == 0, log_of(worker)
    assert "sglang detected 0.5.5" in log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    assert sorted(r["row"] for r in read_jsonl(out / "v055" / "raw_responses.jsonl")) == [0, 2]


# -- API keys ------------------------------------------------------------------------------------------


@pytest.mark.timeout(420)  # waits of 60 + 60 + 30 + 180 s
@pytest.mark.slow
def test_api_key_from_a_file_and_a_rotated_key_burns_no_attempts(procs, start_sim, out, tmp_path):
    url = start_sim("--api-key", "k1", "--latency", "realistic", "--decode-step-ms", "5")
    data = tmp_path / "keyed.jsonl"
    prompts = write_prompts(data, 300)
    assert procs.run("enqueue", data, "--max-new-tokens", "200").returncode == 0

    keyless = procs.start("worker", "--server", url, "--burst")
    assert keyless.wait(60) == 78
    assert "refused genq's API key" in log_of(keyless) and "GENQ_SERVER_API_KEY" in log_of(keyless)

    key_file = tmp_path / "server-api-key"
    key_file.write_text("k1\n")
    env = {"GENQ_SERVER_API_KEY_FILE": str(key_file)}
    # One attempt per job: a 401 that cost one would fail the job.
    worker = procs.start(
        "worker", "--server", url, "--burst", "--max-attempts", "1", "--concurrency", "16", env=env
    )
    wait_until(
        lambda: status_json(procs)["datasets"]["keyed"]["done"] > 0 or _streamed(procs) > 20, 60, "progress"
    )
    sim_post(url, "/sim/api-key", {"api_key": "k2"})
    wait_until(lambda: "refused the API key" in log_of(worker), 30, "the worker to close its gate")
    key_file.write_text("k2\n")
    assert worker.wait(180) == 0, log_of(worker)
    assert "is up again" in log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    check_records(out, "keyed", prompts, {"max_new_tokens": 200})
    assert not read_jsonl(out / "keyed" / "errors.jsonl")


def _streamed(procs) -> int:
    return status_json(procs)["stream"]["length"]


# -- results that look finished but are not -----------------------------------------------------


def test_nan_finishes_are_failed_attempts_not_records(procs, start_sim, out, tmp_path):
    url = start_sim("--fail-nan", "0.2")
    data = tmp_path / "nan.jsonl"
    prompts = write_prompts(data, 200)
    assert procs.run("enqueue", data, "--max-new-tokens", "100").returncode == 0
    worker = procs.start("worker", "--server", url, "--burst", "--max-attempts", "10")
    assert worker.wait(120) == 0, log_of(worker)
    assert sim_stats(url)["faults"]["nan"] >= 10
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    records = check_records(out, "nan", prompts, {"max_new_tokens": 100})
    assert not any(r["matched_stop"] == "NaN happened" for r in records)
    assert sum(r["attempts"] > 1 for r in records) >= 10


def test_outputs_the_server_cut_short_are_marked_and_counted(procs, start_sim, out, tmp_path):
    """SGLANG_MAX_NEW_TOKENS_LIMIT (or the context, or the KV budget) lowers max_new_tokens without
    a word; finish_reason.length says to what."""
    url = start_sim("--max-new-tokens-limit", "40", "--min-len", "8", "--max-len", "200")
    data = tmp_path / "cut.jsonl"
    prompts = write_prompts(data, 100)
    assert procs.run("enqueue", data, "--max-new-tokens", "100").returncode == 0
    worker = procs.start("worker", "--server", url, "--burst")
    assert worker.wait(120) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    records = read_jsonl(out / "cut" / "raw_responses.jsonl")
    cut = [r for r in records if r.get("finish_length") == 40]
    expected = sum(natural_length(p, 8, 200) > 40 for p in prompts)
    assert len(cut) == expected > 10
    assert all(r["finish_reason"] == "length" and r["completion_tokens"] == 40 for r in cut)
    assert status_json(procs)["datasets"]["cut"]["capped"] == expected
    stats = orjson.loads(procs.run("stats", out, "--json").stdout)
    assert stats["datasets"]["cut"]["capped"] == expected


def test_ignored_seeds_are_said_at_start_and_in_status(procs, start_sim, out, tmp_path):
    url = start_sim("--no-deterministic-inference")
    data = tmp_path / "seeds.jsonl"
    write_prompts(data, 20)
    assert procs.run("enqueue", data, "--max-new-tokens", "20", "--samples", "2").returncode == 0
    worker = procs.start("worker", "--server", url)
    wait_until(lambda: _streamed(procs) == 40, 60, "every sample to finish")
    assert log_of(worker).count("ignores sampling_seed") == 1
    warnings = status_json(procs)["warnings"]
    assert len(warnings) == 1 and warnings[0].startswith("seeds: its samples rely on sampling_seed")
    assert "seeds: its samples rely" in procs.run("status").stdout
    assert stop(worker) == 0


# -- reject at enqueue what SGLang rejects at run time ------------------------------------------


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (("--top-p", "0"), "--top-p"),
        (("--top-p", "1.5"), "--top-p"),
        (("--top-k", "0"), "must be -1 (disable) or at least 1"),
        (("--seed", str(2**63)), "--seed"),
        (("--seed", str(2**63 - 1), "--samples", "2"), "seed + samples - 1"),
    ],
)
def test_sampling_values_sglang_refuses_are_refused_at_enqueue(procs, tmp_path, flags, why):
    data = tmp_path / "flags.jsonl"
    write_prompts(data, 3)
    res = procs.run("enqueue", data, *flags)
    assert res.returncode == 2 and why in res.stderr, res.stderr
    assert status_json(procs)["datasets"] == {}


def test_ids_outside_the_vocabulary_are_rejected_naming_the_row(procs, tmp_path):
    data = tmp_path / "vocab.jsonl"
    write_rows(data, [[1, 2, 3], [1, 999, 3], [998]])
    res = procs.run("enqueue", data, "--vocab-size", "999")
    assert res.returncode == 3, res.stderr  # rows rejected, the rest enqueued
    assert "enqueued 2, skipped 0, rejected 1" in res.stdout
    assert f"{data}:2: field 'input_ids'[1]: token id 999 is outside the vocabulary [0, 999)" in res.stderr
