"""genq against the real SGLang (0.5.23, on the CPU) serving a tiny llama made at test time.

Greedy decoding in float32 is deterministic there, batched or not, so every record can be compared
with a direct ``/generate`` of the same ids on the same server: exactness through the queue, and
through the server's own death, a stop past the deadline (genq's timeout and ``/abort_request``),
its API key, its queue bound, its logprobs and the tiny model's chat template. The server counts
its own finished requests (``--enable-metrics``): GPU work is counted, not only records.
"""

from __future__ import annotations

import re
import signal
import time
from collections import Counter

import orjson
import pytest
from transformers import AutoTokenizer

from genq import sampling
from genq.conversation import answer_message, turn_prompt
from genq.logprobs import FILE, frames
from tests.conformance import Case, at, call, compare, concurrently, message, skeleton
from tests.engines import (
    CONTEXT,
    PIECED_FLAGS,
    UPTO,
    check_pieced_outputs,
    generations_per_job,
    hf_prompts,
    metric,
    post,
    sglang_direct,
    sglang_server,
    sglang_top2,
)
from tests.helpers import (
    assert_verified,
    check_settled,
    finish_run,
    load_shape,
    log_of,
    read_jsonl,
    run_burst,
    server_load,
    sigkill,
    sim_get,
    status_json,
    stop,
    wait_for_records,
    wait_until,
    write_ids,
)

pytestmark = [pytest.mark.real_engine, pytest.mark.sglang]
MAX_NEW = 24
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0.0}
# The server counts the GPU work genq asks for: every /generate received (/metrics), and each
# request's rid in its log (tests/engines.generations_per_job).
COUNTED = ("--enable-metrics", "--log-requests", "--log-requests-level", "0")
GENERATES = ("sglang:http_requests_total", 'endpoint="/generate"')


# SGLang's advice for input_ids workloads (the job genq was built for): no tokenizer or detokenizer in
# the server; its answers carry output_ids and no text, which the worker decodes (Backend.decode).
SKIP = "--skip-tokenizer-init"


@pytest.fixture(scope="module")
def sglang(sglang_install, tmp_path_factory):
    """The module's server, counting the generations it is asked for."""
    python, model = sglang_install
    server = sglang_server(python, model, tmp_path_factory.mktemp("sglang") / "sglang.log", *COUNTED)
    yield server.start()
    server.stop()


@pytest.fixture(scope="module")
def sglang_skip(sglang_install, tmp_path_factory):
    """The module's server started with --skip-tokenizer-init, counting as the other does."""
    python, model = sglang_install
    server = sglang_server(
        python, model, tmp_path_factory.mktemp("sglang-skip") / "sglang.log", *COUNTED, SKIP
    )
    yield server.start()
    server.stop()


# The tests that run on both: with its tokenizer, and without it (SKIP).
BOTH = pytest.mark.parametrize("server", ["sglang", "sglang_skip"], ids=["tokenizer", "skip-tokenizer-init"])


def _check_texts(records: list[dict], prompts: list[list[int]], url: str) -> None:
    """Each record's text is the one SGLang's own detokenizer makes of the same greedy output (``url``:
    a server with its tokenizer), whether the server made it or the worker decoded it."""
    want = sglang_direct(url, [prompts[r["row"]] for r in records], GREEDY)
    for r, direct in zip(records, want, strict=True):
        assert r["output_ids"] == direct["output_ids"], r["id"]
        assert r["text"] == direct["text"] and r["content"] == direct["text"], f"{r['id']}: not SGLang's text"


def _check_exact(
    out, dataset: str, prompts: list[list[int]], url: str, key: str | None = None, batch: int = 16
) -> list[dict]:
    """Each prompt once, its output ids what the server gives it when asked directly."""
    records = read_jsonl(out / dataset / "raw_responses.jsonl")
    assert sorted(r["row"] for r in records) == list(range(len(prompts))), "each prompt exactly once"
    headers = {"Authorization": f"Bearer {key}"} if key else None
    expected = sglang_direct(url, [prompts[r["row"]] for r in records], GREEDY, headers, batch)
    for r, want in zip(records, expected, strict=True):
        assert r["output_ids"] == want["output_ids"], f"{r['id']}: not the server's greedy output"
        assert r["backend"] == "sglang" and r["prompt_tokens"] == len(prompts[r["row"]])
        assert r["finish_reason"] == want["meta_info"]["finish_reason"]["type"]
    return records


@BOTH
def test_records_equal_direct_greedy_generate_and_nothing_is_generated_twice(
    procs, sglang, sglang_install, server, request, out, tmp_path
):
    """Pre-tokenized prompts (the tokenizer given to enqueue, as the EAGLE-3 job does): each record
    the server's greedy output, and its text SGLang's own, made by the server or, where it skips its
    tokenizer, by the worker."""
    target = request.getfixturevalue(server)
    prompts = hf_prompts(240)
    data = write_ids(tmp_path / "exact.jsonl", prompts)
    _, model = sglang_install
    res = procs.run(
        "enqueue", data, "--max-new-tokens", str(MAX_NEW), "--temperature", "0", "--server", target.url,
        "--tokenizer", model,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "enqueued 240" in res.stdout
    before = metric(target.url, *GENERATES)  # after enqueue's own 1-token probe of the server
    logs = run_burst(procs, out, target.url, ("--concurrency", "16"), ("--concurrency", "16"))
    # The start-up probe read the real /server_info and /model_info.
    assert "sglang detected 0.5.23" in logs[0], logs[0]
    assert ("skips its tokenizer" in logs[0]) is (server == "sglang_skip"), logs[0]
    generated = metric(target.url, *GENERATES) - before
    # Each worker's 1-token probe, each prompt once: no generation wasted.
    assert generated == len(prompts) + 2, f"{generated} generations for {len(prompts)} prompts"
    per_job = generations_per_job("sglang", target.log)
    assert sorted(per_job[f"{procs.env['GENQ_NAMESPACE']}--exact-{i}"] for i in range(len(prompts))) == [
        1
    ] * len(prompts), "each prompt generated once"
    records = _check_exact(out, "exact", prompts, target.url)
    _check_texts(records, prompts, sglang.url)
    assert_verified(procs, out, data)
    status = status_json(procs)
    assert status["datasets"]["exact"]["done"] == len(prompts)
    # A second enqueue finds everything on disk.
    res = procs.run(
        "enqueue", data, "--max-new-tokens", str(MAX_NEW), "--temperature", "0", "--tokenizer", model
    )
    assert "enqueued 0, skipped 240" in res.stdout, res.stdout


def test_outputs_in_pieces_equal_one_request(procs, sglang, out, tmp_path, report):
    """--continue-to on /generate: prompt + output so far as input_ids, against one request for
    UPTO tokens asked directly; with --logprobs, the pieces' log-probabilities joined into one frame
    per record are the one request's."""
    prompts = hf_prompts(60, seed=21)
    data = write_ids(tmp_path / "pieced.jsonl", prompts)
    k = 2
    res = procs.run("enqueue", data, *PIECED_FLAGS, "--logprobs", str(k), "--server", sglang.url)
    assert res.returncode == 0, res.stderr
    run_burst(procs, out, sglang.url, ("--concurrency", "16"))
    records = sorted(read_jsonl(out / "pieced" / "raw_responses.jsonl"), key=lambda r: r["row"])
    one_shot = sglang_direct(
        sglang.url,
        prompts,
        {"max_new_tokens": UPTO, "temperature": 0.0},
        return_logprob=True,
        top_logprobs_num=k,
    )
    texts = [a["text"] for a in one_shot]
    ids = [a["output_ids"] for a in one_shot]
    check_pieced_outputs(records, prompts, ids, "SGLang", report, texts, sglang_top2(sglang.url))
    got = {record_id: lp for _, _, record_id, lp in frames(out / "pieced" / FILE)}
    assert set(got) == {r["id"] for r in records}, "a frame per record"
    joined = 0
    for r, want in zip(records, one_shot, strict=True):
        lp, meta = got[r["id"]], want["meta_info"]
        assert len(lp.token) == len(r["output_ids"]) == r["logprobs"]["tokens"], r["id"]
        if r["output_ids"] != want["output_ids"] or r["pieces"] < 2:
            continue
        joined += 1
        # Prefill (a piece's start) and decode differ in the last bits; float16 for the top-K values.
        assert lp.token == pytest.approx([t[0] for t in meta["output_token_logprobs"]], abs=1e-3), r["id"]
        assert [row[0] for row in lp.top_ids] == [row[0][1] for row in meta["output_top_logprobs"]], r["id"]
    assert joined >= 0.9 * len(records), f"only {joined} records in pieces equal to one request"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("started", [(), (SKIP,)], ids=["tokenizer", "skip-tokenizer-init"])
def test_the_server_killed_and_stopped_mid_run(procs, sglang, sglang_install, started, out, tmp_path):
    """SIGKILL with requests in flight, a restart; SIGSTOP past genq's request deadline, so its
    timeout sends the real /abort_request, then SIGCONT: each prompt once, as direct calls, with
    SGLang's own text; none failed."""
    python, model = sglang_install
    server = sglang_server(python, model, tmp_path / "sglang.log", *started)
    server.start()
    # Issue #52's run: 400 prompts without the tokenizer; with it, the 240 this test always ran.
    prompts = hf_prompts(400 if started else 240, seed=1)
    data = write_ids(tmp_path / "kills.jsonl", prompts)
    flags = ("--concurrency", "8", "--request-timeout", "4", "--max-attempts", "20", "--heartbeat-ttl", "5")
    try:
        res = procs.run(
            "enqueue", data, "--max-new-tokens", str(MAX_NEW), "--temperature", "0", "--tokenizer", model
        )
        assert res.returncode == 0, res.stderr
        collector = procs.start("collect", "--out", out)
        worker = procs.start("worker", "--server", server.url, *flags)

        def at(n: int) -> None:
            wait_for_records(procs, "kills", n, 120, in_flight=True)

        at(len(prompts) // 6)
        server.kill()  # every request in flight is dropped
        wait_until(lambda: "looks down" in log_of(worker), 60, "the worker to notice")
        server.start()
        at(len(prompts) // 2)
        server.signal(signal.SIGSTOP)  # every request in flight hangs past its 4 s deadline
        wait_until(lambda: "failed: timeout" in log_of(worker), 60, "a request to time out")
        time.sleep(2)
        server.signal(signal.SIGCONT)
        finish_run(procs, "kills", len(prompts), 120, worker, collector)
        records = _check_exact(out, "kills", prompts, server.url)
        _check_texts(records, prompts, sglang.url)
        assert not read_jsonl(out / "kills" / "errors.jsonl")
        assert_verified(procs, out, data)
        # The aborts reached the real server once it ran again: it logs each one it carried out.
        aborted = server.log.read_text(errors="replace").count("Abort")
        assert aborted > 0, server.tail()
    finally:
        server.stop()


def test_context_checks_agree_with_the_real_scheduler(procs, sglang, out, tmp_path):
    """enqueue --server refuses what the real scheduler refuses (a prompt of max_req_input_len ids
    and longer), and passes the longest prompt it accepts."""
    info = sim_get(sglang.url, "/server_info")
    limit = info["max_req_input_len"]
    assert info["context_length"] == CONTEXT and limit < CONTEXT
    longest, refused = hf_prompts(1, seed=5, length=(limit - 1, limit - 1))[0], [7] * limit
    for ids, ok in ((longest, True), (refused, False)):
        status, body = post(
            sglang.url, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
        )
        assert (status == 200) is ok, (len(ids), status, body)
    data = write_ids(tmp_path / "ctx.jsonl", [hf_prompts(1)[0], longest, refused])
    res = procs.run("enqueue", data, "--max-new-tokens", "1", "--temperature", "0", "--server", sglang.url)
    assert res.returncode == 3, res.stderr  # rows rejected, the rest enqueued
    assert "enqueued 2, skipped 0, rejected 1" in res.stdout, res.stdout
    assert f"{data}:3: field 'input_ids': {limit} prompt tokens" in res.stderr, res.stderr


def test_every_sampling_key_enqueue_accepts_the_real_server_accepts(procs, sglang, tmp_path):
    """Each key of genq's sampling contract, with a value enqueue's checks pass, is served by the real
    SGLang; a misspelled key that enqueue refuses is refused by the real server too."""
    values = {
        "max_new_tokens": 4, "min_new_tokens": 1, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05,
        "frequency_penalty": 0.1, "presence_penalty": 0.1, "repetition_penalty": 1.1, "stop": ["zzz"],
        "stop_token_ids": [5], "stop_regex": "qqq+", "ignore_eos": True, "skip_special_tokens": False,
        "spaces_between_special_tokens": False, "no_stop_trim": True, "sampling_seed": 3,
        "json_schema": '{"type": "string"}', "regex": "[a-z]+", "ebnf": 'root ::= "a"+',
        "structural_tag": orjson.dumps(
            {"structures": [{"begin": "<a>", "schema": {"type": "string"}, "end": "</a>"}],
             "triggers": ["<a>"]}
        ).decode(),
        "logit_bias": {"5": 1.0}, "custom_params": {"k": 1},
    }  # fmt: skip
    assert set(values) == set(sampling.KEYS), "a key enqueue accepts has no value to try here"
    for key, value in values.items():
        params = {"max_new_tokens": 4, key: value}
        sampling.check(params)  # what enqueue runs on --sampling-params; raises on a refusal
        status, body = post(sglang.url, "/generate", {"input_ids": [5, 6, 7], "sampling_params": params})
        assert status == 200, (key, status, body)
    status, body = post(sglang.url, "/generate", {"input_ids": [5], "sampling_params": {"temprature": 0.5}})
    assert status == 400 and "unknown field `temprature`" in body["error"], body
    data = tmp_path / "p.jsonl"
    data.write_bytes(orjson.dumps({"input_ids": [5, 6, 7]}) + b"\n")
    res = procs.run("enqueue", data, "--sampling-params", '{"temprature": 0.5}')
    assert res.returncode != 0 and "temprature" in res.stderr and "'temperature'" in res.stderr, res.stderr


@pytest.mark.timeout(600)
def test_api_key_rotation_and_a_full_queue_cost_no_attempt(procs, sglang_install, out, tmp_path):
    """--api-key (from a file) and --max-queued-requests on the real server: the queue-full 503s are
    retried for free, a key rotated mid-run closes the gate until the file has the new key."""
    python, model = sglang_install
    key_file = tmp_path / "key"
    key_file.write_text("first-key\n")
    limits = ("--max-running-requests", "4", "--max-queued-requests", "4")  # 16 in flight meet 503s
    server = sglang_server(python, model, tmp_path / "sglang.log", "--api-key", "first-key", *limits)
    server.start()
    prompts = hf_prompts(120, seed=3)
    data = write_ids(tmp_path / "keyed.jsonl", prompts)
    env = {"GENQ_SERVER_API_KEY_FILE": str(key_file)}
    try:
        status, body = post(
            server.url, "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}
        )
        assert status == 401, body
        res = procs.run("enqueue", data, "--max-new-tokens", str(MAX_NEW), "--temperature", "0")
        assert res.returncode == 0, res.stderr
        worker = procs.start("worker", "--server", server.url, "--concurrency", "16", env=env)
        collector = procs.start("collect", "--out", out)
        wait_for_records(procs, "keyed", 40, 120)
        server.stop()
        server.argv[server.argv.index("first-key")] = "second-key"
        server.start()
        wait_until(lambda: "API key" in log_of(worker), 60, "the worker to name the refused key")
        done = status_json(procs)["datasets"]["keyed"]["done"]
        time.sleep(3)
        assert status_json(procs)["datasets"]["keyed"]["done"] == done, "the gate stayed closed"
        key_file.write_text("second-key\n")
        finish_run(procs, "keyed", len(prompts), 120, worker, collector)
        records = _check_exact(out, "keyed", prompts, server.url, key="second-key", batch=4)
        assert "overloaded" in log_of(worker) or "queue is full" in log_of(worker), "no queue-full 503 met"
        assert all(r["attempts"] == 1 for r in records), "a 503 or a refused key charged an attempt"
        assert "first-key" not in log_of(worker) and "second-key" not in log_of(worker)
    finally:
        server.stop()


def test_logprobs_equal_a_direct_calls(procs, sglang, out, tmp_path):
    k = 5
    prompts = hf_prompts(40, seed=4)
    data = write_ids(tmp_path / "lp.jsonl", prompts)
    res = procs.run(
        "enqueue", data, "--max-new-tokens", str(MAX_NEW), "--temperature", "0", "--logprobs", str(k)
    )
    assert res.returncode == 0, res.stderr
    run_burst(procs, out, sglang.url, ("--concurrency", "8"))
    records = {r["id"]: r for r in _check_exact(out, "lp", prompts, sglang.url)}
    got = {record_id: lp for _, _, record_id, lp in frames(out / "lp" / FILE)}
    assert set(got) == set(records)
    for record_id, lp in got.items():
        (want,) = sglang_direct(
            sglang.url, [prompts[records[record_id]["row"]]], GREEDY, return_logprob=True, top_logprobs_num=k
        )
        meta = want["meta_info"]
        # float32 on disk (and a batch's arithmetic may differ from a single request's in the last bits)
        assert lp.token == pytest.approx([t[0] for t in meta["output_token_logprobs"]], abs=1e-4)
        assert lp.top_ids == [[t[1] for t in row] for row in meta["output_top_logprobs"]]
        # float16 on disk: three significant digits
        for row, want_row in zip(lp.top, meta["output_top_logprobs"], strict=True):
            assert row == pytest.approx([t[0] for t in want_row], rel=2e-3, abs=2e-3)


@BOTH
def test_turns_all_with_the_models_chat_template(
    procs, sglang, sglang_install, server, request, out, tmp_path
):
    """Each turn's prompt ids are the tiny model's template over the conversation so far (with the
    model's own earlier answers, as SGLang's text: decoded by the worker where the server skips its
    tokenizer); each turn's output is the server's for that prompt."""
    target = request.getfixturevalue(server)
    _, model = sglang_install
    tok = AutoTokenizer.from_pretrained(str(model))
    rows = [
        {
            "id": f"c{i}",
            "messages": [
                *([{"role": "system", "content": "You answer briefly."}] if i % 2 else []),
                *[
                    m
                    for k in range(1 + i % 3)
                    for m in (
                        {"role": "user", "content": f"question {k} of {i}: what is the sea?"},
                        {"role": "assistant", "content": "an old answer"},
                    )
                ],
            ],
        }
        for i in range(12)
    ]
    data = tmp_path / "chat.jsonl"
    data.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    res = procs.run(
        "enqueue", data, "--tokenizer", model, "--turns", "all", "--max-new-tokens", str(MAX_NEW),
        "--temperature", "0", "--server", target.url,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    run_burst(procs, out, target.url, ("--concurrency", "8"))
    records = read_jsonl(out / "chat" / "raw_responses.jsonl")
    assert sorted(r["row"] for r in records) == list(range(len(rows)))
    for r in records:
        source = rows[r["row"]]["messages"]
        answers: list[dict] = []
        for k, turn in enumerate(r["turns"]):
            ids = tok.apply_chat_template(
                turn_prompt(source, answers, k), add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
            assert turn["input_ids"] == list(ids), f"{r['id']} turn {k}: not the template's prompt"
            (want,) = sglang_direct(sglang.url, [list(ids)], GREEDY)  # the server with its tokenizer
            assert turn["output_ids"] == want["output_ids"], f"{r['id']} turn {k}: not the server's output"
            assert turn["content"] == want["text"], f"{r['id']} turn {k}: not SGLang's text"
            answers.append(answer_message(want["text"], None))
        assert len(r["turns"]) == sum(m["role"] == "user" for m in source)


def test_the_regex_checker_keeps_what_the_real_model_writes_to_a_pattern(
    procs, sglang, out, tmp_path, report
):
    """The check stage on the real server: sampled outputs (temperature 1) judged by the built-in
    regex checker, until 1 of each prompt matches or 3 were drawn. Whatever the model writes, an
    accepted record matches and a rejected one does not, a prompt is drawn again only while it has
    none accepted, and the server generated each drawn sample once."""
    prompts = hf_prompts(40, seed=11)
    data = write_ids(tmp_path / "rx.jsonl", prompts)
    # An even number of spaces: about half of any text of a few dozen tokens, whatever the model
    # writes, so both verdicts come (all 40 accepted at once: 2**-40). "[aeiou]{2}" was in almost
    # every sample, and a CI run had every prompt accepted on its first draw.
    pattern = r"^(?:[^ ]* [^ ]* )*[^ ]*\Z"
    res = procs.run(
        "enqueue", data, "--max-new-tokens", str(MAX_NEW), "--temperature", "1", "--accept", "1",
        "--max-samples", "3", "--server", sglang.url,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    before = metric(sglang.url, *GENERATES)
    roles = [
        procs.start("worker", "--server", sglang.url, "--concurrency", "8"),
        procs.start("check", "--check", "genq.checker.builtin:regex", "--check-option", f"must={pattern}"),
        procs.start("collect", "--out", out),
    ]
    counts = check_settled(procs, "rx", 300)
    for proc in roles:
        assert stop(proc, timeout=60) == 0, log_of(proc)
    accepted = read_jsonl(out / "rx" / "raw_responses.jsonl")
    rejected = read_jsonl(out / "rx" / "rejected_samples.jsonl")
    assert all(re.search(pattern, r["content"] or r["text"]) for r in accepted)
    assert all(not re.search(pattern, r["content"] or r["text"]) for r in rejected)
    drawn = Counter(r["row"] for r in accepted + rejected)
    won = Counter(r["row"] for r in accepted)
    assert all(won[row] <= 1 and (won[row] == 1 or drawn[row] == 3) for row in range(len(prompts)))
    assert all(r["sample"] < drawn[r["row"]] for r in accepted + rejected), "samples drawn in order"
    # Drawn again only while none was accepted: a prompt's accepted sample is its last drawn, and
    # its samples are 0..n-1, each once.
    for row in range(len(prompts)):
        samples = sorted(r["sample"] for r in accepted + rejected if r["row"] == row)
        assert samples == list(range(drawn[row])), (row, samples)
    assert all(r["sample"] == drawn[r["row"]] - 1 for r in accepted), "a sample drawn after an accepted one"
    assert accepted and rejected, "the pattern decided nothing: all samples accepted, or none"
    assert counts["verdicts"] == {
        k: v for k, v in (("accepted", len(accepted)), ("rejected", len(rejected))) if v
    }
    # The worker's 1-token probe and each drawn sample once.
    assert metric(sglang.url, *GENERATES) - before == len(accepted) + len(rejected) + 1
    assert_verified(procs, out, data)
    report(
        f"regex checker on SGLang: {len(accepted)} of {len(prompts)} prompts accepted, "
        f"{len(rejected)} rejected samples"
    )


def test_a_worker_killed_mid_run_repeats_only_what_was_in_flight(procs, sglang, out, tmp_path, report):
    """SIGKILL a worker with work in flight on the real server: the replacement finishes the run,
    each prompt once, and the server generated at most the in-flight jobs a second time."""
    prompts = hf_prompts(300, seed=6)
    data = write_ids(tmp_path / "wk.jsonl", prompts)
    assert procs.run("enqueue", data, "--max-new-tokens", str(MAX_NEW), "--temperature", "0").returncode == 0
    before = metric(sglang.url, *GENERATES)
    flags = ("--concurrency", "8", "--heartbeat-ttl", "5")
    worker = procs.start("worker", "--server", sglang.url, *flags)

    def mid_run() -> bool:
        c = status_json(procs)["datasets"]["wk"]
        return metric(sglang.url, *GENERATES) - before > 80 and c["in_flight"] > 0 and c["queued"] > 0

    wait_until(mid_run, 120, "80 generations, jobs in flight and more queued")
    assert worker.poll() is None, log_of(worker)
    sigkill(worker)  # with work in flight: the condition just held, and the queue keeps it full
    # Not --burst: a burst worker may find the queue empty while the dead worker's jobs still wait
    # out its heartbeat TTL, and exit before they come back.
    replacement = procs.start("worker", "--server", sglang.url, *flags)
    collector = procs.start("collect", "--out", out)
    finish_run(procs, "wk", len(prompts), 120, replacement, collector)
    wasted = metric(sglang.url, *GENERATES) - before - len(prompts) - 2  # two workers' probes
    per_job = generations_per_job("sglang", sglang.log)
    mine = {job: n for job, n in per_job.items() if job.startswith(f"{procs.env['GENQ_NAMESPACE']}--wk-")}
    twice = sorted(job for job, n in mine.items() if n > 1)
    report(f"real SGLang, a worker SIGKILLed with 8 in flight: {wasted:.0f} generations repeated")
    assert len(mine) == len(prompts) and wasted == len(twice) and max(mine.values()) <= 2, twice
    # Besides the 8 at the server, the kill can catch results waiting for their group commit: a
    # finished job gives its slot to the next at once and its result lingers up to LINGER_S (25 ms)
    # for company (worker/commits.py), so one or two answers of the last instant die with it.
    assert wasted <= 8 + 2, f"{wasted} generations repeated: {twice} (8 were in flight)"
    _check_exact(out, "wk", prompts, sglang.url)


# -- the simulator against the real server ----------------------------------------------------------

P = [5, 6, 7, 8, 9, 10]
SHORT = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
# As long as the context allows: ~1 s on the real server alone on two cores, 10 s on the simulator.
LONG = {"max_new_tokens": 500, "temperature": 0, "ignore_eos": True}


def _gen(name: str, params: dict | None = None, ids: list[int] | None = P, **kw) -> Case:
    body: dict = {"sampling_params": {**SHORT, **(params or {})}}
    if ids is not None:
        body["input_ids"] = ids
    extra = {k: v for k, v in kw.items() if k not in ("message", "values")}
    return Case(
        name, "/generate", {**body, **extra}, message=kw.get("message", False), values=kw.get("values", ())
    )


FINISH = ("meta_info.finish_reason", "meta_info.prompt_tokens", "meta_info.completion_tokens")
SGLANG_CASES = [
    _gen("ids", values=FINISH),
    _gen("rid given", rid="conformance-rid", values=("meta_info.id",)),
    Case("text", "/generate", {"text": "Hello world", "sampling_params": SHORT}),
    _gen("max_new_tokens 0", {"max_new_tokens": 0}, values=FINISH),
    _gen("logprobs, top 5", {"max_new_tokens": 3}, return_logprob=True, top_logprobs_num=5),
    _gen("unknown top-level key", foo=1),
    _gen("prompt over the context", ids=[7] * 600, message=True),
    _gen("prompt as long as the context", ids=[7] * 512, message=True),
    _gen("prompt + max_new_tokens over the context", {"max_new_tokens": 16}, ids=[7] * 511, message=True),
    _gen("max_new_tokens over the context", {"max_new_tokens": 600}, ids=[7] * 10, message=True),
    _gen("prompt + max_new_tokens = the context", {"max_new_tokens": 16}, ids=[7] * 496, values=FINISH),
    _gen("longest prompt the scheduler takes", {"max_new_tokens": 1}, ids=[7] * 505, values=FINISH),
    _gen("prompt at max_req_input_len", {"max_new_tokens": 1}, ids=[7] * 506, message=True),
    _gen("unknown sampling key", {"foo": 1}, message=True),
    _gen("max_new_tokens a string", {"max_new_tokens": "x"}, message=True),
    _gen("max_new_tokens a string of digits", {"max_new_tokens": "8"}, message=True),
    _gen("max_new_tokens a float", {"max_new_tokens": 8.5}, message=True),
    _gen("temperature a string", {"temperature": "hot"}, message=True),
    _gen("ignore_eos a string", {"ignore_eos": "yes"}, message=True),
    _gen("stop_token_ids not a list", {"stop_token_ids": 5}, message=True),
    _gen("max_new_tokens negative", {"max_new_tokens": -1}, message=True),
    _gen("temperature negative", {"temperature": -1}, message=True),
    _gen("top_p 0", {"top_p": 0}, message=True),
    _gen("top_k 0", {"top_k": 0}, message=True),
    _gen("min_p 2", {"min_p": 2}, message=True),
    _gen("repetition_penalty 3", {"repetition_penalty": 3}, message=True),
    _gen("frequency_penalty 3", {"frequency_penalty": 3}, message=True),
    _gen("min_new_tokens over max_new_tokens", {"min_new_tokens": 9}, message=True),
    _gen("two grammars", {"regex": "a+", "ebnf": 'root ::= "a"'}, message=True),
    _gen("input_ids a string", ids=None, input_ids="abc"),
    _gen("input_ids of floats", ids=[1.5]),  # type: ignore[list-item]
    _gen("input_ids empty", ids=[], message=True),
    _gen("no prompt", ids=None, message=True),
    Case("sampling_params not an object", "/generate", {"input_ids": P, "sampling_params": 5}),
    Case("not JSON", "/generate", raw=b"{not json"),
    Case("health", "/health"),
    Case("health_generate", "/health_generate"),
    # genq reads the model's names; the simulator leaves out the model's config (architectures, ...)
    Case(
        "model_info",
        "/model_info",
        keys=("model_path", "served_model_name", "tokenizer_path", "weight_version"),
    ),
    Case("v1/models", "/v1/models", values=("data.0.max_model_len",)),
    Case("abort of an unknown rid", "/abort_request", {"rid": "no-such-rid"}),
    Case("abort with an empty body", "/abort_request", {}),
    _gen("batch of prompts", ids=[P, P]),  # type: ignore[list-item]
    _gen("n 2", {"n": 2}),
    _gen("id outside the vocabulary", ids=[5000]),
]
SGLANG_DELIBERATE = {
    "batch of prompts": "genq sends one prompt per request; the simulator refuses lists (400)",
    "n 2": "genq makes one job per sample (--samples); the simulator refuses n > 1 (400)",
    "id outside the vocabulary": (
        "the real 0.5.23 dies whole (IndexError in the embedding, then kill_process_tree); genq keeps such "
        "ids out at enqueue (producer/context.py check_vocab); the simulator's toy vocabulary is 32,000"
    ),
}


# meta_info fields that the module's server has only because of --enable-metrics (which genq's
# GPU-work counting needs); the simulator imitates a server without it.
METRICS_ONLY = frozenset(
    (
        "storage_prefetch_wait", "storage_staging_wait", "forward_entry_time", "prefill_finished_time",
        "queue_time", "request_received_ts", "first_token_latency", "api_server_dispatch_finish_ts",
        "request_finished_ts", "decode_throughput",
    )
)  # fmt: skip


def _without_metrics(body):
    if isinstance(body, dict) and isinstance(body.get("meta_info"), dict):
        body["meta_info"] = {k: v for k, v in body["meta_info"].items() if k not in METRICS_ONLY}
    return body


def _server_info_agrees(real: str, sim: str) -> list[str]:
    """The /server_info fields genq reads (genq/backends/sglang.py probe)."""
    a, b = sim_get(real, "/server_info"), sim_get(sim, "/server_info")
    keys = ("context_length", "max_req_input_len", "version", "skip_tokenizer_init")
    return [f"server_info.{k}: {b.get(k)!r}, real {a.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def _duplicate_rid(url: str) -> dict:
    rid = "conformance-duplicate"
    body = {"rid": rid, "input_ids": P, "sampling_params": LONG}
    first, second = concurrently(
        lambda: call(url, "/generate", body), lambda: call(url, "/generate", body), stagger=0.1
    )
    return {
        "first": (first.status, at(first.body, "meta_info.finish_reason.type")),
        "second": (second.status, skeleton(second.body), message(second.body)),
    }


def _abort_running(url: str) -> dict:
    rid = "conformance-abort"
    running, aborted = concurrently(
        lambda: call(url, "/generate", {"rid": rid, "input_ids": P, "sampling_params": LONG}),
        lambda: call(url, "/abort_request", {"rid": rid}),
        stagger=0.3,  # the rid is registered on arrival; the generation is far from done
    )
    return {
        "abort": (aborted.status, aborted.body),
        "request": (
            running.status,
            skeleton(_without_metrics(running.body)),
            at(running.body, "meta_info.finish_reason"),
        ),
        "stopped early": len(running.body["output_ids"]) < LONG["max_new_tokens"],
    }


def _health_while_busy(url: str) -> dict:
    busy = [lambda: call(url, "/generate", {"input_ids": P, "sampling_params": LONG}) for _ in range(8)]
    answers = concurrently(*busy, lambda: call(url, "/health"), lambda: call(url, "/v1/models"), stagger=0.1)
    return {"health": answers[8].status, "models": answers[9].status, "busy": [a.status for a in answers[:8]]}


def test_the_simulator_answers_as_the_real_sglang(sglang, start_sim):
    """Every request genq sends, and each bad kind it handles, to the real SGLang and to the simulator
    in 0.5.23 mode: the same statuses, body shapes, messages and finish reasons, or a difference
    written down in SGLANG_DELIBERATE."""
    sim = start_sim("--sglang-version", "0.5.23", "--context-length", str(CONTEXT), "--latency", "realistic")
    found = compare(sglang.url, sim, SGLANG_CASES, SGLANG_DELIBERATE, _without_metrics)
    found += _server_info_agrees(sglang.url, sim)
    for name, scenario in (
        ("duplicate rid", _duplicate_rid),
        ("abort of a running request", _abort_running),
        ("health while busy", _health_while_busy),
    ):
        real, simulated = scenario(sglang.url), scenario(sim)
        found += [f"{name}: {k} {simulated[k]!r}, real {real[k]!r}" for k in real if real[k] != simulated[k]]
    assert not found, "the simulator differs from the real SGLang:\n" + "\n".join(found)


# Started with --skip-tokenizer-init: ids in, ids out, and what needs the tokenizer refused.
SKIP_CASES = [
    _gen("ids", values=FINISH),
    _gen(
        "stop token id", {"stop_token_ids": [P[0]], "ignore_eos": False}, values=("meta_info.prompt_tokens",)
    ),
    _gen("logprobs, top 5", {"max_new_tokens": 3}, return_logprob=True, top_logprobs_num=5),
    Case("text prompt", "/generate", {"text": "Hello world", "sampling_params": SHORT}, message=True),
    _gen("stop string", {"stop": ["zzz"]}, message=True),
    _gen("stop_regex", {"stop_regex": "qqq+"}, message=True),
    _gen("min_new_tokens", {"min_new_tokens": 1}, message=True),
    _gen("min_new_tokens 0", {"min_new_tokens": 0}, values=FINISH),
]


def test_the_simulator_answers_as_the_real_sglang_without_its_tokenizer(sglang_skip, start_sim):
    """SGLang started with --skip-tokenizer-init and the simulator with the same flag: answers without
    text, the same refusals in the same words, and /server_info saying so."""
    sim = start_sim(
        "--sglang-version", "0.5.23", "--context-length", str(CONTEXT), "--latency", "realistic", SKIP
    )
    found = compare(sglang_skip.url, sim, SKIP_CASES, {}, _without_metrics)
    found += _server_info_agrees(sglang_skip.url, sim)
    assert sim_get(sglang_skip.url, "/server_info")["skip_tokenizer_init"] is True
    assert not found, "the simulator differs from the real SGLang without its tokenizer:\n" + "\n".join(found)


def test_load_reads_the_real_sglang_as_it_reads_the_simulator(sglang, start_sim):
    """genq's load() of the real 0.5.23 (/v1/loads, and /metrics: the module's server counts with
    --enable-metrics) and of the simulator in the same mode fill the same fields from the same
    endpoints; idle, both say nothing runs, nothing waits, nothing was retracted."""
    sim = start_sim("--sglang-version", "0.5.23", "--latency", "realistic", "--enable-metrics")
    real, simulated = server_load(sglang.url, "sglang"), server_load(sim, "sglang")
    assert real is not None and real.source == "/v1/loads+/metrics", real
    assert load_shape(real) == load_shape(simulated), (real, simulated)
    assert (real.running, real.waiting, real.preempted) == (0, 0, 0), real
    assert real.max_running and real.kv_tokens and 0.0 <= real.kv_usage <= 1.0, real
