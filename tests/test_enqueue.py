"""`genq enqueue`: idempotent, pipelined, every bad row named with file:line and why."""

from __future__ import annotations

from pathlib import Path

import orjson
from rq import Queue

from genq.keys import Keys
from tests.helpers import status_json, write_jsonl, write_prompts


def test_enqueue_twice_enqueues_nothing_new(procs, conn, namespace, tmp_path):
    data = tmp_path / "d.jsonl"
    write_prompts(data, 500)
    first = procs.run("enqueue", data, "--max-new-tokens", "64")
    assert first.returncode == 0, first.stderr
    assert "read 500, enqueued 500, skipped 0, rejected 0" in first.stdout
    second = procs.run("enqueue", data, "--max-new-tokens", "64")
    assert second.returncode == 0, second.stderr
    assert "enqueued 0, skipped 500" in second.stdout
    queue = Queue(Keys(namespace).queue_name("d"), connection=conn, serializer="json")
    assert queue.count == 500
    job = queue.fetch_job(Keys(namespace).job_id("d-0"))
    assert job.kwargs["id"] == "d-0"
    assert job.kwargs["sampling_params"] == {"max_new_tokens": 64}
    assert job.kwargs["source_id"] == "src-0"


def test_appended_rows_are_enqueued_on_the_next_run(procs, conn, namespace, tmp_path):
    data = tmp_path / "grow.jsonl"
    write_prompts(data, 10)
    assert "enqueued 10" in procs.run("enqueue", data).stdout
    with data.open("ab") as fh:
        fh.write(orjson.dumps({"prompt": "one more row"}) + b"\n")
    assert "enqueued 1, skipped 10" in procs.run("enqueue", data).stdout


def test_bad_rows_are_named_and_good_rows_go_through(procs, conn, namespace, tmp_path):
    data = tmp_path / "mixed.jsonl"
    rows = [
        {"input_ids": [101, 102]},
        "{not json",
        {"prompt": ""},
        {"input_ids": [1, "x"]},
        {"text": "wrong field"},
        "",
        {"prompt": "hello world", "id": 7},
        [1, 2],
    ]
    write_jsonl(data, rows)
    res = procs.run("enqueue", data)
    assert res.returncode == 3, res.stderr  # rows rejected, the rest enqueued
    assert "read 7, enqueued 2, skipped 0, rejected 5" in res.stdout
    err = res.stderr
    assert f"{data}:2: malformed JSON" in err
    assert f"{data}:3: field 'prompt': expected a non-empty string" in err
    assert f"{data}:4: field 'input_ids'[1]: expected a non-negative integer" in err
    assert f"{data}:5: no prompt: expected field 'input_ids', 'messages', 'conversations', " in err
    assert "'prompt', 'instruction' or 'custom_id' (fields present: text)" in err
    assert f"{data}:8: expected a JSON object" in err
    queue = Queue(Keys(namespace).queue_name("mixed"), connection=conn, serializer="json")
    # Rows keep their position whatever is wrong around them: the text row is row 5.
    keys = Keys(namespace)
    assert sorted(queue.job_ids) == [keys.job_id("mixed-0"), keys.job_id("mixed-5")]
    assert queue.fetch_job(keys.job_id("mixed-5")).kwargs["text"] == "hello world"


def test_samples_get_distinct_ids_and_seeds(procs, conn, namespace, tmp_path):
    data = tmp_path / "s.jsonl"
    write_prompts(data, 3)
    res = procs.run("enqueue", data, "--samples", "4", "--seed", "10", "--temperature", "0.8")
    assert "enqueued 12" in res.stdout, res.stderr
    queue = Queue(Keys(namespace).queue_name("s"), connection=conn, serializer="json")
    jobs = [queue.fetch_job(Keys(namespace).job_id(f"s-1-{k}")) for k in range(4)]
    assert {job.kwargs["sampling_params"]["sampling_seed"] for job in jobs} == {10, 11, 12, 13}


def test_other_settings_for_an_existing_dataset_are_refused(procs, tmp_path):
    data = tmp_path / "fixed.jsonl"
    write_prompts(data, 5)
    assert procs.run("enqueue", data, "--max-new-tokens", "100").returncode == 0
    res = procs.run("enqueue", data, "--max-new-tokens", "200")
    assert res.returncode != 0
    assert "was first enqueued with" in res.stderr
    other = tmp_path / "other.jsonl"
    write_prompts(other, 5)
    res = procs.run("enqueue", other, "--dataset", "fixed", "--max-new-tokens", "100")
    assert res.returncode != 0 and "would reuse their ids" in res.stderr


def test_enqueue_script_and_env_settings(procs, conn, tmp_path, namespace):
    """`enqueue` is the same command; GENQ_* variables set the flags."""
    import subprocess
    import sys

    data = tmp_path / "viaenv.jsonl"
    write_prompts(data, 3)
    res = subprocess.run(
        [sys.executable, "-c", "from producer.cli import enqueue_main; enqueue_main()", str(data)],
        env={**procs.env, "GENQ_MAX_NEW_TOKENS": "33"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "enqueued 3" in res.stdout
    queue = Queue(Keys(namespace).queue_name("viaenv"), connection=conn, serializer="json")
    jobs = [queue.fetch_job(Keys(namespace).job_id(f"viaenv-{row}")) for row in range(3)]
    assert [job.kwargs["sampling_params"] for job in jobs] == [{"max_new_tokens": 33}] * 3, (
        "GENQ_MAX_NEW_TOKENS did not reach the jobs"
    )


def test_a_first_enqueue_that_enqueued_nothing_binds_no_settings(procs, tmp_path):
    """A first try that enqueued nothing (every row refused under its settings, as a newcomer's
    first `genq run` is) fixes no settings: the corrected command is taken. Once a job is
    enqueued, they are fixed."""
    data = write_jsonl(tmp_path / "long.jsonl", [{"input_ids": list(range(1, 61))}])
    res = procs.run("enqueue", data, "--context-length", "100", "--max-new-tokens", "80")
    assert res.returncode == 3 and "enqueued 0" in res.stdout, res.stderr  # 60 + 80 > 100
    res = procs.run("enqueue", data, "--context-length", "100", "--max-new-tokens", "30")
    assert res.returncode == 0 and "enqueued 1" in res.stdout, res.stderr
    res = procs.run("enqueue", data, "--context-length", "100", "--max-new-tokens", "20")
    assert res.returncode != 0 and "was first enqueued with" in res.stderr, res.stderr


def test_limit_enqueues_a_trial_and_the_next_enqueue_the_rest(procs, conn, namespace, tmp_path):
    """--limit N: the first N rows, a dataset of N jobs so far; verify says the rest is not read yet
    (not missing); the same enqueue without it enqueues the rest, each row once."""
    data = tmp_path / "trial.jsonl"
    write_prompts(data, 30)
    first = procs.run("enqueue", data, "--limit", "10")
    assert first.returncode == 0 and "read 10, enqueued 10, skipped 0" in first.stdout, first.stderr
    assert status_json(procs)["datasets"]["trial"]["total"] == 10
    audit = procs.run("verify", data, "--out", tmp_path, "--json")
    (verdict,) = orjson.loads(audit.stdout)
    assert (verdict["expected"], verdict["not_read_yet"], verdict["missing"]) == (10, 20, 0), verdict
    said = procs.run("verify", data, "--out", tmp_path).stdout
    assert "20 rows after the first 10 not read yet (the last enqueue had --limit 10)" in said, said
    rest = procs.run("enqueue", data)
    assert rest.returncode == 0 and "read 30, enqueued 20, skipped 10" in rest.stdout, rest.stderr
    queue = Queue(Keys(namespace).queue_name("trial"), connection=conn, serializer="json")
    assert sorted(queue.job_ids) == sorted(Keys(namespace).job_id(f"trial-{i}") for i in range(30))
    (verdict,) = orjson.loads(procs.run("verify", data, "--out", tmp_path, "--json").stdout)
    assert (verdict["expected"], verdict["not_read_yet"]) == (30, 0), verdict


def test_a_dataset_named_by_its_hugging_face_id_is_read_from_the_local_cache(
    procs, conn, namespace, tmp_path
):
    """owner/name with --config and --split, offline: datasets reads it from the cache an earlier
    online load left (made here as that load lays it out); enqueued again it skips what it queued,
    another split is another dataset's settings, --limit reads its first rows; an id nobody cached
    is one line saying what to do."""
    home = tmp_path / "hf"
    hub_cache(home, "someone/maths", "easy", {"train": 12, "test": 5})
    env = {**procs.env, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    first = procs.run("enqueue", "someone/maths", "--config", "easy", "--split", "test", env=env)
    assert first.returncode == 0 and "maths: read 5, enqueued 5" in first.stdout, first.stderr
    queue = Queue(Keys(namespace).queue_name("maths"), connection=conn, serializer="json")
    job = queue.fetch_job(Keys(namespace).job_id("maths-3"))
    assert job.kwargs["text"] == "test question 3", job.kwargs
    again = procs.run("enqueue", "someone/maths", "--config", "easy", "--split", "test", env=env)
    assert again.returncode == 0 and "enqueued 0, skipped 5" in again.stdout, again.stderr
    other = procs.run("enqueue", "someone/maths", "--config", "easy", "--split", "train", env=env)
    assert other.returncode != 0 and "prompting.split 'test', not 'train'" in other.stderr, other.stderr
    train = ("someone/maths", "--config", "easy", "--split", "train", "--dataset", "maths-train")
    train += ("--limit", "4")
    trial = procs.run("enqueue", *train, env=env)
    assert trial.returncode == 0 and "maths-train: read 4, enqueued 4" in trial.stdout, trial.stderr
    missing = procs.run("enqueue", "nobody/nothing", env=env)
    (line,) = [line for line in missing.stderr.splitlines() if line.startswith("Error")]
    assert missing.returncode != 0 and "nobody/nothing: no such file or folder" in line, missing.stderr
    assert "load it once online" in line and "Traceback" not in missing.stderr


def hub_cache(home, repo_id: str, config: str, splits: dict[str, int]) -> None:
    """The prepared cache `datasets.load_dataset(repo_id, config)` leaves after an online load
    (HF_DATASETS_CACHE/<owner>___<name>/<config>/<version>/<commit>/), made from local Parquet
    files with the same builder, so an offline load finds it (datasets' CachedDatasetModuleFactory)."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets.packaged_modules.parquet.parquet import Parquet

    files = {}
    for split, n in splits.items():
        files[split] = str(home / "src" / f"{split}.parquet")
        (home / "src").mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"prompt": [f"{split} question {i}" for i in range(n)]}), files[split])
    builder = Parquet(cache_dir=str(home / "datasets"), dataset_name=repo_id.split("/")[1], data_files=files)
    builder.repo_id = repo_id
    builder._cache_dir = builder._build_cache_dir()
    builder.download_and_prepare()
    prepared = Path(builder.cache_dir)
    final = home / "datasets" / repo_id.replace("/", "___") / config / "0.0.0" / "0123456789abcdef"
    final.parent.mkdir(parents=True)
    shutil.move(str(prepared), str(final))
    shutil.rmtree(prepared.parent)
    info = orjson.loads((final / "dataset_info.json").read_bytes())
    (final / "dataset_info.json").write_bytes(orjson.dumps({**info, "config_name": config}))
