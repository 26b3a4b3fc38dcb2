"""Long outputs in pieces (--continue-to, worker/pieces.py) against the simulator's autoregressive
model, where each token is a function of every id before it: an output made in pieces must equal
the one-shot output exactly, through kills of the worker and of the server, and a kill may cost at
most the piece each job had in flight."""

from __future__ import annotations

import subprocess

import orjson
import pytest
import redis

from genq.commands.embedded import free_port
from genq.keys import Keys
from genq.logprobs import FILE, frames
from genq.sim.model import generate
from genq.sim.model import logprobs as sim_logprobs
from tests.helpers import (
    finish_run,
    genq_argv,
    log_of,
    read_jsonl,
    server_up,
    sigkill,
    sim_get,
    sim_stats,
    status_json,
    wait_for_records,
    wait_until,
    write_prompts,
)

PIECE, UPTO = 16, 256
LENGTHS = (50, 300)  # the model's EOS every 175 tokens on average: most outputs need many pieces
SIM_FLAGS = ("--autoregressive", "--min-len", str(LENGTHS[0]), "--max-len", str(LENGTHS[1]))
ENQUEUE_FLAGS = ("--max-new-tokens", str(PIECE), "--continue-to", str(UPTO), "--temperature", "0")


def one_shot(prompt: list[int], record: dict, upto: int = UPTO) -> list[int]:
    """What one request for ``upto`` tokens gives, with the record's own sampling."""
    params = {**record["sampling_params"], "max_new_tokens": upto}
    return generate(prompt, params, min_len=LENGTHS[0], max_len=LENGTHS[1], autoregressive=True).output_ids


def piece_ends(prompt: int, context: int | None) -> list[int]:
    """Where each piece ends (output tokens so far) when none stops early: pieces of PIECE up to
    UPTO, none past what SGLang leaves in the context (context - 2 - input), and none sent once
    the input reaches its max_req_input_len (context - 6, as the simulator computes it)."""
    ends, done = [], 0
    while True:
        sent = prompt + done
        budget = min(PIECE, UPTO - done, (context - 2 - sent) if context else PIECE)
        if budget < 1 or (ends and context and sent >= context - 6):
            return ends
        done += budget
        ends.append(done)


def check_pieced(records: list[dict], prompts: list[list[int]], context: int | None = None) -> None:
    """Each prompt once; its output the one-shot output, its pieces and ending what they must be."""
    assert sorted(r["row"] for r in records) == list(range(len(prompts))), "each prompt exactly once"
    for r in records:
        prompt = prompts[r["row"]]
        ends = piece_ends(len(prompt), context)
        want = one_shot(prompt, r, ends[-1])
        assert r["output_ids"] == want, f"{r['id']}: the pieced output is not the one-shot output"
        assert r["completion_tokens"] == len(want) and r["prompt_tokens"] == len(prompt)
        stopped = want[-1] == 2 and len(want) <= ends[-1]
        assert r["finish_reason"] == ("stop" if stopped else "length"), r["id"]
        pieces = next(k + 1 for k, end in enumerate(ends) if end >= len(want))
        assert r["pieces"] == pieces and r["continue_to"] == UPTO, r["id"]
        assert len(r["piece_attempts"]) == r["pieces"] and r["attempts"] == sum(r["piece_attempts"])
        assert r.get("context_full", False) == (not stopped and ends[-1] < UPTO), r["id"]
        assert r["sampling_params"]["max_new_tokens"] == PIECE


def test_pieces_join_into_the_one_shot_output_and_stop_at_the_context(procs, start_sim, out, tmp_path):
    """60 prompts continued 16 tokens at a time up to 256: every output equals the one made by one
    request, and a context of 160 ends the outputs that would pass it (context_full)."""
    prompts = write_prompts(tmp_path / "long.jsonl", 60)
    url = start_sim(*SIM_FLAGS)
    assert procs.run("enqueue", tmp_path / "long.jsonl", *ENQUEUE_FLAGS).returncode == 0
    assert procs.run("worker", "--server", url, "--burst", "--concurrency", "16").returncode == 0
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    records = read_jsonl(out / "long" / "raw_responses.jsonl")
    check_pieced(records, prompts)
    assert {r["finish_reason"] for r in records} == {"stop", "length"}, "some stop, some reach 256"
    assert max(r["pieces"] for r in records) == UPTO // PIECE
    conn = redis.Redis.from_url(procs.env["GENQ_REDIS_URL"])
    assert not conn.exists(Keys(procs.env["GENQ_NAMESPACE"]).pieces), "checkpoints freed with the records"

    small = start_sim(*SIM_FLAGS, "--context-length", "160")
    prompts = write_prompts(tmp_path / "ctx.jsonl", 40)
    assert procs.run("enqueue", tmp_path / "ctx.jsonl", *ENQUEUE_FLAGS).returncode == 0
    assert procs.run("worker", "--server", small, "--burst", "--concurrency", "16").returncode == 0
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    records = read_jsonl(out / "ctx" / "raw_responses.jsonl")
    check_pieced(records, prompts, context=160)
    assert any(r.get("context_full") for r in records)


def test_logprobs_join_across_pieces_into_one_frame(procs, start_sim, out, tmp_path):
    """--logprobs with --continue-to: one frame per record in logprobs.bin, the pieces' logprobs
    joined in order, equal to what one request gives (the model's logprobs depend on the position
    in the whole sequence, as a real model's do)."""
    prompts = write_prompts(tmp_path / "lp.jsonl", 30)
    url = start_sim(*SIM_FLAGS)
    assert procs.run("enqueue", tmp_path / "lp.jsonl", *ENQUEUE_FLAGS, "--logprobs", "3").returncode == 0
    assert procs.run("worker", "--server", url, "--burst", "--concurrency", "16").returncode == 0
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    records = read_jsonl(out / "lp" / "raw_responses.jsonl")
    check_pieced(records, prompts)
    found = {record_id: lp for _, _, record_id, lp in frames(out / "lp" / FILE)}
    assert set(found) == {r["id"] for r in records}, "one frame per record"
    for r in records:
        token, top = sim_logprobs(r["output_ids"], 3, len(prompts[r["row"]]))
        assert r["logprobs"] == {"file": FILE, "k": 3, "tokens": len(r["output_ids"])}
        assert found[r["id"]].token == pytest.approx(token, abs=1e-6), r["id"]
        assert found[r["id"]].top_ids == [[i for i, _ in row] for row in top], r["id"]
    assert max(r["pieces"] for r in records) > 2


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (("--continue-to", "16"), "must be above --max-new-tokens 16"),
        (("--continue-to", "64", "--backend", "openai-chat"), "the openai-chat backend sends messages"),
        (("--continue-to", "64", "--turns", "all"), "a conversation (--turns all) is not continued"),
    ],
)
def test_continue_to_that_cannot_be_done_is_refused_in_one_line(procs, tmp_path, flags, why):
    write_prompts(tmp_path / "p.jsonl", 3)
    res = procs.run("enqueue", tmp_path / "p.jsonl", "--max-new-tokens", "16", *flags)
    assert res.returncode == 2 and why in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_text_rows_cannot_continue_refused_once_before_any_row(procs, tmp_path):
    """--continue-to without a tokenizer over text rows cannot work: refused in one line naming the
    first row, before anything is read or recorded. A text row among id rows is that row's reject."""
    data = tmp_path / "text.jsonl"
    data.write_text('{"prompt": "hello there"}\n' * 200 + '{"input_ids": [5, 6, 7]}\n')
    res = procs.run("enqueue", data, "--max-new-tokens", "16", "--continue-to", "64")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    (line,) = [
        x for x in res.stderr.splitlines() if x.strip() and not x.startswith("Usage") and "--help" not in x
    ]
    assert "--continue-to needs the prompts as token ids, and " in line and "text.jsonl:1 is text" in line, (
        line
    )
    assert "text" not in status_json(procs)["datasets"], "settings recorded for a refused enqueue"
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"input_ids": [5, 6, 7]}\n{"prompt": "hello there"}\n')
    res = procs.run("enqueue", mixed, "--max-new-tokens", "16", "--continue-to", "64", "--allow-rejects")
    assert res.returncode == 0, res.stderr
    assert "mixed.jsonl:2:" in res.stderr and "--continue-to needs the prompt as token ids" in res.stderr
    assert status_json(procs)["datasets"]["mixed"]["total"] == 1


@pytest.mark.timeout(600)  # in `make test-quick` too: the pieces' kill test
def test_a_kill_costs_at_most_the_piece_in_flight(procs, out, tmp_path, report):
    """150 prompts in pieces of 16 up to 256 on a batching simulator. A worker SIGKILLed mid-run:
    its replacement resumes every job from its last piece, and the server generated at most one
    piece per job in flight more than the records hold. Then the server SIGKILLed mid-run and
    restarted: the jobs resume from their checkpoints in Redis, and every output is still exactly
    the one-shot output."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = genq_argv(
        "sim-server", "--port", str(port), *SIM_FLAGS, "--latency", "realistic", "--decode-step-ms", "2"
    )

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: server_up(url), 30, "the simulator to listen")
        return proc

    concurrency = 32
    flags = ("--concurrency", str(concurrency), "--heartbeat-ttl", "5")
    sim = start()
    try:
        prompts = write_prompts(tmp_path / "wk.jsonl", 150)
        assert procs.run("enqueue", tmp_path / "wk.jsonl", *ENQUEUE_FLAGS).returncode == 0
        worker = procs.start("worker", "--server", url, *flags)
        collector = procs.start("collect", "--out", out)
        conn = redis.Redis.from_url(procs.env["GENQ_REDIS_URL"])
        pieces_key = Keys(procs.env["GENQ_NAMESPACE"]).pieces
        wait_for_records(procs, "wk", 60, 60, in_flight=True)
        wait_until(lambda: conn.hlen(pieces_key) > 0, 60, "jobs with pieces kept at the kill")
        assert worker.poll() is None, log_of(worker)
        sigkill(worker)
        worker = procs.start("worker", "--server", url, *flags)
        finish_run(procs, "wk", len(prompts), 120, worker, collector)
        records = read_jsonl(out / "wk" / "raw_responses.jsonl")
        check_pieced(records, prompts)
        kept = sum(r["completion_tokens"] for r in records)
        wasted = sim_stats(url)["tokens_generated"] - kept
        # The pieces in flight, and the last piece of a record or two the kill caught in the group
        # commit's 25 ms linger (their slots already serve the next jobs: as in test_real_sglang's
        # kill test); each worker's probe generates a token.
        bound = (concurrency + 2) * PIECE + 2
        report(
            f"pieces: a worker SIGKILLed with {concurrency} jobs in flight (pieces of {PIECE}): "
            f"{wasted} of {kept + wasted} decode tokens wasted (bound {bound})"
        )
        assert 0 <= wasted <= bound, wasted

        prompts = write_prompts(tmp_path / "srv.jsonl", 100)
        assert procs.run("enqueue", tmp_path / "srv.jsonl", *ENQUEUE_FLAGS).returncode == 0
        worker = procs.start("worker", "--server", url, *flags)
        collector = procs.start("collect", "--out", out)
        wait_until(lambda: conn.hlen(pieces_key) >= 20, 120, "20 jobs with pieces kept")
        sigkill(sim)
        # Once the worker has seen the server go, no piece can end: the checkpoints are those of the kill.
        wait_until(lambda: "looks down" in log_of(worker), 60, "the worker to see the server go")
        checkpoints = {
            job.decode(): len(orjson.loads(raw)["output_ids"])
            for job, raw in conn.hgetall(pieces_key).items()
        }
        sim = start()
        finish_run(procs, "srv", len(prompts), 120, worker, collector)
        records = {r["id"]: r for r in read_jsonl(out / "srv" / "raw_responses.jsonl")}
        check_pieced(list(records.values()), prompts)
        assert "starting the output over" not in log_of(worker)
        # The new server made only what the checkpoints did not hold: each job it served, its output
        # past the checkpoint (all of it for a job without one), and a token for each probe.
        keys = Keys(procs.env["GENQ_NAMESPACE"])
        rids = sim_get(url, "/sim/rids")
        served = {rid.split(".", 1)[0] for rid in rids if not rid.startswith("genq-probe.")}
        probes = len(rids) - sum(1 for rid in rids if not rid.startswith("genq-probe."))
        owed = sum(
            records[keys.record_id(job)]["completion_tokens"] - checkpoints.get(job, 0) for job in served
        )
        generated = sim_stats(url)["tokens_generated"]
        resumed = len(served & set(checkpoints))
        report(
            f"pieces: the server SIGKILLed with {len(checkpoints)} jobs holding pieces in Redis: the new "
            f"server generated {generated} tokens, {owed} past the checkpoints, {probes} for probes; "
            f"{resumed} jobs resumed from their checkpoints"
        )
        assert checkpoints and set(checkpoints) <= served, "a job with pieces kept did not go on"
        assert generated == owed + probes, "the new server generated again what the checkpoints held"
    finally:
        sim.kill()


def test_a_thought_closed_partway_is_the_same_in_pieces_as_in_one_shot():
    """The simulator's reasoning model (--think-ids) closes a thought its prompt leaves open once,
    where its state says: an output made in pieces of 16 still equals the one-shot output, its
    </think> included, and a prompt whose thought is closed already gets none."""
    from genq.sim.model import Thinking

    thinking, start, end = Thinking(422, 423), 422, 423
    closed = 0
    for k in range(40):
        prompt = [300 + k, 301, start]
        params = {"max_new_tokens": UPTO, "temperature": 0}
        whole = generate(prompt, params, min_len=LENGTHS[0], max_len=LENGTHS[1], autoregressive=True,
                         thinking=thinking).output_ids  # fmt: skip
        assert whole.count(end) <= 1
        closed += end in whole
        pieced: list[int] = []
        while len(pieced) < len(whole) and (not pieced or pieced[-1] != 2):
            step = {**params, "max_new_tokens": PIECE}
            pieced += generate(prompt + pieced, step, min_len=LENGTHS[0], max_len=LENGTHS[1],
                               autoregressive=True, thinking=thinking).output_ids  # fmt: skip
        assert pieced[: len(whole)] == whole, k
        again = generate([300 + k, start, 7, end], params, thinking=thinking).output_ids
        assert end not in again, "a closed thought is not closed again"
    assert closed >= 30, f"most thoughts close within {UPTO} tokens: {closed} of 40"
