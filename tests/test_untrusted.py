"""Nothing read from Redis is trusted (docs/security.md): entries in a dataset's result stream that
are not a worker's are quarantined and named, never a crash, never a line on disk."""

from __future__ import annotations

import orjson

from genq.entries import KEPT_BYTES
from genq.keys import Keys
from tests.helpers import check_records, log_of, write_prompts

PARAMS = {"max_new_tokens": 32}


def _garbage(real: dict[bytes, bytes]) -> list[tuple[str, dict]]:
    """Entries a worker never writes, each with words genq's reason for it must hold."""
    data = orjson.loads(real[b"data"])

    def entry(**changed) -> dict:
        return {"kind": b"record", "id": b"good-0", "data": orjson.dumps({**data, **changed})}

    return [
        ("no field 'data'", {"kind": b"record"}),
        ("field 'kind' is None", {"id": b"good-0", "data": real[b"data"]}),
        ("field 'kind' is 'weird'", {**real, b"kind": b"weird"}),
        ("field 'data' is not JSON", {"kind": b"record", "id": b"good-0", "data": b"not json"}),
        ("field 'data' is not JSON", {"kind": b"record", "id": b"good-0", "data": b"x" * (10 << 20)}),
        ("is a JSON list", {"kind": b"record", "id": b"good-0", "data": b"[1, 2]"}),
        ("data field 'row' is None", {"kind": b"record", "id": b"good-0", "data": b'{"id": "good-0"}'}),
        ("data field 'row' is '3'", entry(row="3")),
        ("data field 'row' is -5", entry(row=-5)),
        ("past the last job", entry(row=1 << 40)),
        ("not both 'good-0'", entry(id="good-1")),
        ("no job of id 'good-1000000' was ever enqueued", {
            "kind": b"record", "id": b"good-1000000",
            "data": orjson.dumps({**data, "row": 1_000_000, "id": "good-1000000"}),
        }),
    ]  # fmt: skip


def test_stream_entries_that_are_not_a_workers_are_quarantined(
    procs, start_sim, conn, namespace, out, tmp_path
):
    """Garbage XADDed to a dataset's stream beside its real results: the collector writes every
    real record once, moves each bad entry (its bytes kept, cut) to the dataset's dead letter with
    a reason naming the field, logs each once by its entry id, and exits 0; verify, status and
    `genq failed` say so, before and after; no bitmap grows to a forged row."""
    sim = start_sim()
    prompts = write_prompts(tmp_path / "good.jsonl", 30)
    assert procs.run("enqueue", tmp_path / "good.jsonl", "--max-new-tokens", "32").returncode == 0
    keys = Keys(namespace)
    worker = procs.start("worker", "--server", sim, "--burst")
    assert worker.wait(120) == 0, log_of(worker)
    real = conn.xrange(keys.results("good"), count=1)[0][1]
    garbage = _garbage(real)
    ids = [(why, conn.xadd(keys.results("good"), fields)) for why, fields in garbage]

    # Before the collector: verify counts them in the stream, no traceback.
    res = procs.run("verify", "--out", out, "--json")
    audit = orjson.loads(res.stdout)[0]
    assert audit["bad_entries_in_stream"] == len(garbage), res.stdout + res.stderr

    collector = procs.start("collect", "--out", out, "--burst")
    assert collector.wait(120) == 0, log_of(collector)
    check_records(out, "good", prompts, PARAMS)
    assert conn.xlen(keys.results("good")) == 0, "every entry acknowledged"
    assert conn.strlen(keys.done("good")) < 64, "a forged row grew the bitmap"
    log = log_of(collector)
    letters = {f[b"entry"]: f for _, f in conn.xrange(keys.dead_letter("good"))}
    assert set(letters) == {entry_id for _, entry_id in ids}
    for why, entry_id in ids:
        assert why in letters[entry_id][b"reason"].decode(), (why, letters[entry_id])
        assert sum(entry_id.decode() in line for line in log.splitlines()) == 1, (why, log)
    big = letters[ids[4][1]]
    assert len(big[b"field:data"]) == KEPT_BYTES and big[b"size:data"] == str(10 << 20).encode()

    res = procs.run("failed", "--json")
    shown = orjson.loads(res.stdout)["quarantined"]
    assert sorted(q["entry"] for q in shown) == sorted(i.decode() for _, i in ids)
    status = orjson.loads(procs.run("status", "--json").stdout)
    assert status["quarantined"] == {"good": len(garbage)}
    assert any("quarantined" in w for w in status["warnings"])
    res = procs.run("verify", "--out", out)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{len(garbage)} stream entries that were not a worker's result quarantined" in res.stderr
