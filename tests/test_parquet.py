"""`genq export --format parquet` (the records) and `--format eagle3 --parquet` (training rows):
Parquet shards of one schema that the `datasets` library loads with the ledger's counts."""

from __future__ import annotations

import datasets

from tests.helpers import read_jsonl, status_json, write_prompts


def _load(kind: str, files: list, cache) -> object:
    paths = [str(f) for f in files]
    return datasets.load_dataset(kind, data_files=paths, split="train", cache_dir=str(cache))


def test_records_and_eagle3_rows_as_parquet_shards_load_with_the_ledgers_counts(
    procs, start_sim, out, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompts = write_prompts(tmp_path / "pq.jsonl", 400)
    url = start_sim("--min-len", "20", "--max-len", "200")
    assert procs.run("enqueue", tmp_path / "pq.jsonl", "--max-new-tokens", "120").returncode == 0
    assert procs.run("worker", "--server", url, "--burst", "--concurrency", "32").returncode == 0
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    records = {r["id"]: r for r in read_jsonl(out / "pq" / "raw_responses.jsonl")}
    book = status_json(procs)["datasets"]["pq"]["ledger"]
    on_disk = book["stopped"] + book["continued"] + book["cut"]
    assert on_disk == len(prompts) == len(records) and book["cut"] > 0, book

    res = procs.run("export", out, "--format", "parquet", "--shard-mb", "0.1")
    assert res.returncode == 0, res.stderr
    shards = sorted((out / "pq").glob("records-*-of-*.parquet"))
    assert len(shards) > 1 and f"-of-{len(shards):05d}.parquet" in shards[0].name, shards
    assert f"pq: wrote {len(records)} to " in res.stdout and "shards" in res.stdout, res.stdout
    table = _load("parquet", shards, tmp_path / "hf")
    assert sorted(table["id"]) == sorted(records) and table.num_rows == on_disk, (
        "every record, truncated ones too, once"
    )
    for row in table:
        r = records[row["id"]]
        assert (row["output_ids"], row["input_ids"], row["finish_reason"]) == (
            r["output_ids"],
            r["input_ids"],
            r["finish_reason"],
        )
        assert row["completion_tokens"] == r["completion_tokens"] and row["text"] == r["text"]
    assert sum(table["completion_tokens"]) == sum(r["completion_tokens"] for r in records.values())

    assert procs.run("export", out, "--format", "eagle3").returncode == 0
    res = procs.run("export", out, "--format", "eagle3", "--parquet", "--shard-mb", "0.1")
    assert res.returncode == 0, res.stderr
    rows = read_jsonl(out / "pq" / "tokenized_data.jsonl")
    assert len(rows) == book["stopped"] + book["continued"], "training rows: truncated ones left out"
    as_json = _load("json", [out / "pq" / "tokenized_data.jsonl"], tmp_path / "hf")
    as_parquet = _load("parquet", sorted((out / "pq").glob("tokenized_data-*-of-*.parquet")), tmp_path / "hf")
    assert as_json.num_rows == as_parquet.num_rows == len(rows)
    assert [(r["id"], r["input_ids"], r["loss_mask"]) for r in rows] == [
        (r["id"], r["input_ids"], r["loss_mask"]) for r in as_parquet
    ]
    # Exported again: the shards are replaced, not added to.
    assert procs.run("export", out, "--format", "parquet").returncode == 0
    assert [p.name for p in (out / "pq").glob("records-*.parquet*")] == ["records-00000-of-00001.parquet"]


def test_parquet_goes_with_eagle3_rows_only(procs, out, tmp_path):
    (out / "d").mkdir(parents=True)
    (out / "d" / "raw_responses.jsonl").write_text("")
    res = procs.run("export", out, "--format", "sharegpt", "--parquet")
    assert res.returncode == 2 and "--parquet writes eagle3 rows" in res.stderr, res.stderr
