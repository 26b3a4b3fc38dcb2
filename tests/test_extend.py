"""`genq retry --truncated --continue-to N` (producer/extend.py) against the simulator's
autoregressive model: records cut at max_new_tokens are continued from their stored output, not
generated again; each longer record supersedes the one it extends (the supersede rule, genq/schema.py
``extends``), so exports, stats, verify and the token counters see one record per id; kills of the
worker and the collector mid-way lose nothing and duplicate nothing."""

from __future__ import annotations

from collections import Counter

import orjson
import pytest
import redis

from genq.keys import Keys
from tests.helpers import log_of, read_jsonl, sigkill, sim_stats, status_json, wait_until, write_prompts
from tests.test_pieces import PIECE, SIM_FLAGS, one_shot

UPTO = 96


def _setup(procs, start_sim, tmp_path, out, name: str, n: int, *sim_flags: str) -> tuple[str, list]:
    """``n`` prompts generated in one piece of PIECE tokens: most records end on length."""
    prompts = write_prompts(tmp_path / f"{name}.jsonl", n)
    url = start_sim(*SIM_FLAGS, *sim_flags)
    flags = ("--max-new-tokens", str(PIECE), "--temperature", "0")
    assert procs.run("enqueue", tmp_path / f"{name}.jsonl", *flags).returncode == 0
    assert procs.run("worker", "--server", url, "--burst", "--concurrency", "16").returncode == 0
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    return url, prompts


def _cut_at_piece(prompts: list) -> int:
    """How many of the prompts' outputs run past PIECE tokens, by the simulator's own model (its EOS
    comes every 175 tokens on average, at random: most, not all)."""
    params = {"max_new_tokens": PIECE, "temperature": 0.0}
    return sum(one_shot(p, {"sampling_params": params}, PIECE)[-1] != 2 for p in prompts)


def _check_extended(procs, out, name: str, prompts: list, before: list[dict]) -> list[dict]:
    """One record per id in the export, each truncated one now the one-shot output up to UPTO and
    beginning with what it had; verify clean; stats and Redis's counters count each id once."""
    cut = {r["id"]: r for r in before if r["finish_reason"] == "length"}
    lines = read_jsonl(out / name / "raw_responses.jsonl")
    per_id = Counter(r["id"] for r in lines)
    # Each cut id twice (its record, then the extension that supersedes it), every other id once.
    wrong = {i: n for i, n in per_id.items() if n != (2 if i in cut else 1)}
    assert not wrong and len(per_id) == len(prompts), f"lines per id: {sorted(wrong.items())[:10]}"
    last = {r["id"]: r for r in lines}  # each id's last line
    for r in last.values():
        if r["id"] not in cut:
            assert "extends" not in r
            continue
        old = cut[r["id"]]
        assert r["extends"] == len(old["output_ids"]) and r["output_ids"][:PIECE] == old["output_ids"]
        assert r["output_ids"] == one_shot(prompts[r["row"]], r, UPTO), r["id"]
        assert r["continue_to"] == UPTO and r["pieces"] >= 2
    res = procs.run("export", out, "--format", "eagle3", "--include-truncated", "--dataset", name)
    assert res.returncode == 0, res.stderr
    exported = read_jsonl(out / name / "tokenized_data.jsonl")
    assert sorted(r["id"] for r in exported) == sorted(last), "one training row per id"
    for row in exported:
        record = last[row["id"]]
        assert row["input_ids"] == prompts[record["row"]] + record["output_ids"], "the superseding record"
    res = procs.run("verify", "--out", out, "--dataset", name)
    assert res.returncode == 0 and f"{len(cut):,} records extended" in res.stdout, res.stdout + res.stderr
    stats = procs.run("stats", out, "--json")
    mine = orjson.loads(stats.stdout)["datasets"][name]
    assert mine["records"] == len(prompts)
    assert mine["completion_tokens"] == sum(r["completion_tokens"] for r in last.values())
    assert sum(mine["finish_reasons"].values()) == len(prompts)
    book = status_json(procs)["datasets"][name]["ledger"]
    assert book["read"] == len(prompts) and book["pending"] == 0 and book["rejected"] == 0, book
    assert {k: book[k] for k in mine["ledger"]} == mine["ledger"], "Redis's ledger is the files' ledger"
    still_cut = sum(1 for r in last.values() if r["finish_reason"] == "length")
    assert book["cut"] == still_cut and book["continued"] == sum(
        1 for r in last.values() if r["finish_reason"] != "length" and r.get("pieces", 1) > 1
    )
    conn = redis.Redis.from_url(procs.env["GENQ_REDIS_URL"])
    keys = Keys(procs.env["GENQ_NAMESPACE"])
    tokens = {k.decode(): v for k, v in conn.hgetall(keys.tokens(name)).items()}
    assert int(tokens["records"]) == len(prompts)
    assert int(tokens["completion_tokens"]) == sum(r["completion_tokens"] for r in last.values())
    assert conn.bitcount(keys.extending(name)) == 0 and not conn.exists(keys.pieces)
    return list(last.values())


def test_truncated_records_are_continued_not_regenerated_and_superseded(procs, start_sim, out, tmp_path):
    """60 records cut at 16 tokens continued to 96: the server generates only the tokens added (a
    probe's token aside), the export holds one record per id equal to the one-shot output, and a
    second retry re-opens nothing."""
    url, prompts = _setup(procs, start_sim, tmp_path, out, "ext", 60)
    before = read_jsonl(out / "ext" / "raw_responses.jsonl")
    cut = [r for r in before if r["finish_reason"] == "length"]
    assert len(cut) == _cut_at_piece(prompts) >= 50, "the records cut are the model's outputs past 16"
    generated = sim_stats(url)["tokens_generated"]

    book = status_json(procs)["datasets"]["ext"]["ledger"]
    assert book == {
        "stopped": 60 - len(cut),
        "continued": 0,
        "cut": len(cut),
        "failed": 0,
        "rejected": 0,
        "pending": 0,
        "read": 60,
    }, book
    res = procs.run("retry", "--truncated", "--continue-to", str(UPTO), "--records", out)
    assert res.returncode == 0 and f"ext: re-opened {len(cut)}" in res.stdout, res.stdout + res.stderr
    counts = status_json(procs)["datasets"]["ext"]
    assert counts["done"] == 60 - len(cut) and counts["queued"] == len(cut) and counts["unaccounted"] == 0
    assert counts["ledger"]["pending"] == len(cut) and counts["ledger"]["cut"] == 0
    again = procs.run("retry", "--truncated", "--continue-to", str(UPTO), "--records", out)
    assert "ext: re-opened 0;" in again.stdout, again.stdout
    assert f"{len(cut)} re-opened already" in again.stdout, again.stdout
    assert procs.run("worker", "--server", url, "--burst", "--concurrency", "16").returncode == 0
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    exported = _check_extended(procs, out, "ext", prompts, before)

    added = sum(r["completion_tokens"] - r["extends"] for r in exported if "extends" in r)
    extra = sim_stats(url)["tokens_generated"] - generated - added
    assert 0 <= extra <= 1, f"{extra} tokens generated beyond those added (a worker's probe makes one)"
    done = procs.run("retry", "--truncated", "--continue-to", str(UPTO), "--records", out)
    assert "ext: re-opened 0" in done.stdout, done.stdout


def test_retry_truncated_is_refused_in_one_line_without_what_it_needs(procs, tmp_path, out):
    write_prompts(tmp_path / "p.jsonl", 3)
    assert procs.run("enqueue", tmp_path / "p.jsonl", "--max-new-tokens", "16").returncode == 0
    res = procs.run("retry", "--truncated", "--records", out)
    assert res.returncode == 2 and "--truncated needs --continue-to N" in res.stderr, res.stderr
    res = procs.run("retry", "--truncated", "--continue-to", "64")
    assert res.returncode == 2 and "give --out" in res.stderr, res.stderr
    res = procs.run("retry", "--all", "--continue-to", "64")
    assert res.returncode == 2 and "go with --truncated" in res.stderr, res.stderr
    chat = tmp_path / "c.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert procs.run("enqueue", chat, "--backend", "openai-chat").returncode == 0
    (out / "c").mkdir(parents=True)
    (out / "c" / "raw_responses.jsonl").write_text("")
    res = procs.run("retry", "--truncated", "--continue-to", "64", "--records", out, "--dataset", "c")
    assert res.returncode == 1 and "messages a chat server renders" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.timeout(600)  # in `make test-quick` too: the extension's kill test
def test_extending_survives_kills_of_the_worker_and_the_collector(procs, start_sim, out, tmp_path, report):
    """150 records cut at 16 tokens continued to 96 on a batching simulator; the worker and the
    collector SIGKILLed mid-way and started again: every id still has exactly one record after
    export, each the one-shot output, verify is clean, and the server generated at most a piece per
    job in flight more than the tokens added."""
    url, prompts = _setup(procs, start_sim, tmp_path, out, "kx", 150, "--latency", "realistic")
    before = read_jsonl(out / "kx" / "raw_responses.jsonl")
    generated = sim_stats(url)["tokens_generated"]
    res = procs.run("retry", "--truncated", "--continue-to", str(UPTO), "--records", out)
    assert res.returncode == 0, res.stderr
    conn = redis.Redis.from_url(procs.env["GENQ_REDIS_URL"])
    extending = Keys(procs.env["GENQ_NAMESPACE"]).extending("kx")
    reopened = conn.bitcount(extending)
    concurrency = 32
    flags = ("--concurrency", str(concurrency), "--heartbeat-ttl", "5")
    worker = procs.start("worker", "--server", url, *flags)
    collector = procs.start("collect", "--out", out)
    wait_until(lambda: conn.bitcount(extending) <= reopened * 2 // 3, 120, "a third of the records extended")
    sigkill(collector)
    sigkill(worker)
    worker = procs.start("worker", "--server", url, *flags)
    collector = procs.start("collect", "--out", out)
    wait_until(lambda: conn.bitcount(extending) == 0, 240, "every re-opened record extended")
    for proc in (worker, collector):
        proc.terminate()
        assert proc.wait(60) == 0, log_of(proc)
    exported = _check_extended(procs, out, "kx", prompts, before)
    added = sum(r["completion_tokens"] - r["extends"] for r in exported if "extends" in r)
    wasted = sim_stats(url)["tokens_generated"] - generated - added
    bound = (concurrency + 2) * PIECE + 2
    report(
        f"retry --truncated: {reopened} records continued 16 -> {UPTO} with the worker and the collector "
        f"SIGKILLed mid-way: {wasted} of {added + wasted} decode tokens wasted (bound {bound})"
    )
    assert 0 <= wasted <= bound, wasted
    assert reopened == _cut_at_piece(prompts), "re-opened: exactly the model's outputs past 16"


def test_an_extension_that_fails_leaves_its_record_as_it_was(procs, start_sim, out, tmp_path):
    """Re-opened records whose checkpoints are gone (Redis lost them) fail at once, generating
    nothing: the collector clears their extending bits, each id keeps its one record, the ledger
    counts them cut again, and `genq failed` lists the jobs."""
    url, prompts = _setup(procs, start_sim, tmp_path, out, "lost", 20)
    before = read_jsonl(out / "lost" / "raw_responses.jsonl")
    cut = sum(1 for r in before if r["finish_reason"] == "length")
    assert procs.run("retry", "--truncated", "--continue-to", str(UPTO), "--records", out).returncode == 0
    conn = redis.Redis.from_url(procs.env["GENQ_REDIS_URL"])
    keys = Keys(procs.env["GENQ_NAMESPACE"])
    conn.delete(keys.pieces)
    generated = sim_stats(url)["tokens_generated"]
    assert procs.run("worker", "--server", url, "--burst", "--concurrency", "8").returncode == 0
    collect = procs.run("collect", "--out", out, "--burst")
    assert collect.returncode == 0 and "was not extended" in collect.stderr, collect.stderr
    assert sim_stats(url)["tokens_generated"] - generated <= 1, "nothing generated but a probe's token"
    assert read_jsonl(out / "lost" / "raw_responses.jsonl") == before, "the records stand as they were"
    assert conn.bitcount(keys.extending("lost")) == 0
    counts = status_json(procs)["datasets"]["lost"]
    assert counts["done"] == len(prompts) and counts["ledger"]["cut"] == cut, counts
    failed = procs.run("failed", "--json")
    assert sum(g["count"] for g in orjson.loads(failed.stdout)["groups"]) == cut
    assert procs.run("verify", "--out", out, "--dataset", "lost").returncode == 0
