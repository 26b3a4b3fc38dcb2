"""Log-probabilities for distillation: a compact binary file beside the records, one frame per
record, under the same fsync-then-acknowledge rule and the same crash recovery."""

from __future__ import annotations

import math

import pytest

from genq.entries import ENTRY_LOGPROBS
from genq.keys import Keys
from genq.logprobs import F16_MAX, FILE, FLAG_CLAMPED, FLAG_NULL, LogProbs, frames, pack, valid_end
from genq.sim.model import logprobs as sim_logprobs
from tests.helpers import (
    check_records,
    kill_collector_mid_write,
    log_of,
    status_json,
    write_jsonl,
    write_prompts,
)

K = 5


def check_frames(out, dataset: str, records: list[dict]) -> int:
    """One frame per record, its numbers the server's; returns the file's size."""
    path = out / dataset / FILE
    found = {record_id: lp for _, _, record_id, lp in frames(path)}
    assert len(found) == sum(1 for _ in frames(path)), "a record has two frames"
    assert set(found) == {r["id"] for r in records}
    assert valid_end(path) == path.stat().st_size, "no torn or stray bytes"
    for r in records:
        token, top = sim_logprobs(r["output_ids"], K)
        lp = found[r["id"]]
        assert r["logprobs"] == {"file": FILE, "k": K, "tokens": len(r["output_ids"])}
        assert lp.token == pytest.approx(token, abs=1e-6)
        assert lp.top_ids == [[i for i, _ in row] for row in top]
        flat = [x for row in lp.top for x in row]
        assert flat == pytest.approx([x for row in top for _, x in row], rel=1e-3, abs=1e-3), "float16"
    return path.stat().st_size


@pytest.mark.parametrize("api", ["sglang", "vllm"])
def test_logprobs_land_beside_the_records(procs, start_sim, out, tmp_path, api, report):
    url = start_sim("--api", api)
    data = tmp_path / "lp.jsonl"
    prompts = write_prompts(data, 200)
    assert procs.run("enqueue", data, "--max-new-tokens", "100", "--logprobs", str(K)).returncode == 0
    worker = procs.start("worker", "--server", url, "--burst")
    assert worker.wait(120) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    records = check_records(out, "lp", prompts, {"max_new_tokens": 100})
    size = check_frames(out, "lp", records)
    tokens = sum(len(r["output_ids"]) for r in records)
    report(f"logprobs ({api}, top {K}): {size / tokens:.1f} bytes per output token in {FILE}")
    assert size / tokens < 4 + 6 * K + 2, "4 + 6K bytes per token, plus a small frame header"


@pytest.mark.parametrize("api", ["sglang", "vllm"])
def test_null_and_out_of_range_logprobs_are_stored_as_data(procs, start_sim, out, tmp_path, api):
    """Every answer's logprobs hold a null (the first token's own), a 1e6 and a -1e6 (beyond
    float16): each record lands with its frame, the null as -inf, the others clamped to ±65504,
    and the frame's flags say so (genq/logprobs.py)."""
    url = start_sim("--api", api, "--fail-wild-logprobs", "1")
    data = tmp_path / "wild.jsonl"
    prompts = write_prompts(data, 20)
    assert procs.run("enqueue", data, "--max-new-tokens", "100", "--logprobs", str(K)).returncode == 0
    worker = procs.start("worker", "--server", url, "--burst")
    assert worker.wait(120) == 0, log_of(worker)
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    records = check_records(out, "wild", prompts, {"max_new_tokens": 100})
    path = out / "wild" / FILE
    found = {record_id: lp for _, _, record_id, lp in frames(path)}
    assert set(found) == {r["id"] for r in records} and valid_end(path) == path.stat().st_size
    for r in records:
        assert r["logprobs"] == {"file": FILE, "k": K, "tokens": len(r["output_ids"])}, "no error"
        token, top = sim_logprobs(r["output_ids"], K)
        lp = found[r["id"]]
        assert lp.flags == FLAG_NULL | FLAG_CLAMPED
        assert lp.token[0] == -math.inf, "null: -inf"
        assert lp.token[1:] == pytest.approx(token[1:], abs=1e-6)
        assert lp.top[0][0] == F16_MAX and lp.top_ids[0][0] == top[0][0][0], "1e6: clamped"
        assert lp.top[-1][-1] == -F16_MAX and lp.top_ids[-1][-1] == top[-1][-1][0], "-1e6: clamped"


def test_a_bad_frame_from_redis_costs_the_frame_not_the_record(
    procs, start_sim, out, tmp_path, conn, namespace
):
    """Frames come from Redis, untrusted: one whose payload is corrupt and one that is another
    record's reach the collector. Neither is written (the frames after them stay readable), each
    record lands saying why it has none, with one error line each."""
    url = start_sim()
    data = tmp_path / "bad.jsonl"
    prompts = write_prompts(data, 30)
    assert procs.run("enqueue", data, "--max-new-tokens", "100", "--logprobs", str(K)).returncode == 0
    assert procs.run("worker", "--server", url, "--burst").returncode == 0
    stream = Keys(namespace).results("bad")
    entries = conn.xrange(stream)
    (first_id, first), (second_id, second), (_, third) = entries[:3]
    lp = ENTRY_LOGPROBS.encode()
    corrupt = first[lp][:-1] + bytes([first[lp][-1] ^ 0xFF])  # its CRC no longer matches
    for entry_id, fields, frame in ((first_id, first, corrupt), (second_id, second, third[lp])):
        conn.xdel(stream, entry_id)
        conn.xadd(stream, {**fields, lp: frame})
    res = procs.run("collect", "--out", out, "--burst")
    assert res.returncode == 0, res.stderr
    records = check_records(out, "bad", prompts, {"max_new_tokens": 100})
    bad = {first[b"id"].decode(), second[b"id"].decode()}
    assert res.stderr.count("logprobs frame of") == 2, res.stderr
    for r in records:
        if r["id"] in bad:
            assert "CRC32" in r["logprobs"]["error"] or "not of" in r["logprobs"]["error"], r["logprobs"]
    check_frames(out, "bad", [r for r in records if r["id"] not in bad])


def test_collector_kills_leave_one_frame_per_record(procs, start_sim, out, tmp_path):
    url = start_sim()
    data = tmp_path / "kills.jsonl"
    prompts = write_prompts(data, 600)
    assert procs.run("enqueue", data, "--max-new-tokens", "100", "--logprobs", str(K)).returncode == 0
    assert procs.run("worker", "--server", url, "--burst").returncode == 0
    assert status_json(procs)["stream"]["length"] == len(prompts), "every result waits in the stream"
    # Killed three times while it drains that backlog: small batches (an fsync each) keep it
    # writing a while; each kill must leave lines still to write.
    kill_collector_mid_write(procs, out, out / "kills" / "raw_responses.jsonl", len(prompts))
    # A crash between a batch's frames and its lines leaves frames of records not on disk.
    with (out / "kills" / FILE).open("ab") as fh:
        fh.write(pack("kills-99999", LogProbs([-0.5], [[1] * K], [[-0.5] * K])))
        fh.write(b"GQLP\x01torn")
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    records = check_records(out, "kills", prompts, {"max_new_tokens": 100})
    check_frames(out, "kills", records)
    assert status_json(procs)["datasets"]["kills"]["done"] == 600


def test_a_backend_without_logprobs_is_refused_at_enqueue(procs, start_sim, tmp_path):
    url = start_sim("--api", "openai-chat")
    data = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "hello"}])
    res = procs.run("enqueue", data, "--server", url, "--logprobs", "3")
    assert res.returncode == 2 and "the openai-chat backend cannot return them" in res.stderr
    assert "chat" not in status_json(procs)["datasets"], "refused before anything was registered or queued"
