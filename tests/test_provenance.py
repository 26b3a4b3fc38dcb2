"""Every dataset says where it came from (genq/provenance.py): the servers and models that answered
it, the settings and the command that enqueued it, its ledger and token totals, written by the
collector beside the records and rewritten after any restart."""

from __future__ import annotations

import os
import subprocess

import huggingface_hub
import orjson

from genq import __version__
from tests.helpers import genq_argv, log_of, read_jsonl, status_json, write_prompts
from tests.hub import Hub


def test_provenance_names_servers_and_models_and_its_totals_are_the_records_sums(
    procs, start_sim, out, tmp_path
):
    prompts = write_prompts(tmp_path / "prov.jsonl", 60)
    # Three rows enqueue refuses, two for one reason: the card says why they are missing.
    bad = [{"input_ids": [5, -1]}, {"input_ids": [7, -3, 2]}, {"text": 12}]
    with (tmp_path / "prov.jsonl").open("ab") as fh:
        fh.write(b"".join(orjson.dumps(row) + b"\n" for row in bad))
    # Both slow enough that each worker takes a share of the jobs.
    one = start_sim("--served-model-name", "org/model-a", "--latency", "realistic")
    two = start_sim("--served-model-name", "org/model-b", "--latency", "realistic")
    flags = ("--max-new-tokens", "64", "--temperature", "0.5", "--allow-rejects")
    enq = procs.run("enqueue", tmp_path / "prov.jsonl", *flags)
    assert enq.returncode == 0, enq.stderr
    workers = [procs.start("worker", "--server", url, "--burst", "--concurrency", "4") for url in (one, two)]
    assert [w.wait(120) for w in workers] == [0, 0], [log_of(w) for w in workers]
    collector = procs.start("collect", "--out", out, "--burst")
    assert collector.wait(120) == 0, log_of(collector)
    assert "answered by 2 different models" in log_of(collector)
    status = status_json(procs)
    assert any("prov: answered by 2 different models: org/model-a" in w for w in status["warnings"]), status

    data = orjson.loads((out / "prov" / "provenance.json").read_bytes())
    assert data["genq_version"] == __version__ and data["dataset"] == "prov"
    assert data["models"] == ["org/model-a", "org/model-b"]
    assert set(data["servers"]) == {one, two}
    assert {s["backend"] for s in data["servers"].values()} == {"sglang"}
    assert all(s["version"] and s["worker"] for s in data["servers"].values())
    assert data["settings"]["sampling_params"]["temperature"] == 0.5
    assert data["settings"]["sampling_params"]["max_new_tokens"] == 64
    command = data["enqueue"]["enqueue_command"]
    assert command.startswith("genq enqueue ") and "prov.jsonl --max-new-tokens 64" in command, command
    records = read_jsonl(out / "prov" / "raw_responses.jsonl")
    assert {r["server"] for r in records} == {one, two}
    tokens = data["tokens"]
    assert tokens["records"] == len(records) == len(prompts)
    assert tokens["prompt_tokens"] == sum(r["prompt_tokens"] for r in records)
    assert tokens["completion_tokens"] == sum(r["completion_tokens"] for r in records)
    cached = [r["cached_tokens"] for r in records if r["cached_tokens"] is not None]
    assert (tokens["cached_tokens"], tokens["cached_tokens_of_records"]) == (
        sum(cached) if cached else None,
        len(cached),
    )
    book = data["ledger"]
    assert book["read"] == len(prompts) + len(bad) and book["pending"] == 0
    by_reason = data["rejected_by_reason"]
    assert book["rejected"] == sum(by_reason.values()) == len(bad), by_reason
    assert sorted(by_reason.values()) == [1, 2], f"one reason for both negative ids: {by_reason}"
    assert book["cut"] == sum(1 for r in records if r["finish_reason"] == "length")
    assert data["first_record_at"] and data["last_record_at"]

    # Gone with the disk's folder, or never written: the next collector writes it again from Redis.
    (out / "prov" / "provenance.json").unlink()
    assert procs.run("collect", "--out", out, "--burst").returncode == 0
    again = orjson.loads((out / "prov" / "provenance.json").read_bytes())
    assert {k: v for k, v in again.items() if k != "updated_at"} == {
        k: v for k, v in data.items() if k != "updated_at"
    }

    # The dataset card of the exports: YAML the Hub's DatasetCard reads, then the provenance.
    res = procs.run("export", out, "--format", "eagle3", "--include-truncated", "--license", "apache-2.0")
    assert res.returncode == 0 and "its dataset card:" in res.stdout, res.stderr
    assert procs.run("export", out, "--format", "parquet", "--license", "apache-2.0").returncode == 0
    card = huggingface_hub.DatasetCard.load(out / "prov" / "README.md")
    assert card.data.license == "apache-2.0" and card.data.pretty_name == "prov"
    assert card.data.task_categories == ["text-generation"] and card.data.size_categories == ["n<1K"]
    # `datasets` reads a folder with one builder (its first config's file type): the configs are
    # the last export's kind, each loading; the other kind is named with the line that loads it.
    configs = {c["config_name"]: c for c in card.data.configs}
    assert set(configs) == {"parquet"} and configs["parquet"].get("default"), configs
    assert configs["parquet"]["data_files"][0]["path"] == "records-*-of-*.parquet"
    assert "- eagle3: `datasets.load_dataset('json', data_files='tokenized_data.jsonl')`" in card.text
    _every_config_loads(out / "prov", len(prompts), tmp_path / "hf-cache")
    rejects = "Rejected at the last enqueue, by reason: 2: "
    for shown in (
        "org/model-a",
        "org/model-b",
        "0.1.0",
        "genq enqueue",
        "| stopped | continued | cut |",
        rejects,
    ):
        assert shown in card.text, shown
    assert f"{data['tokens']['completion_tokens']:,}" in card.text

    # genq push: the card and the exports, one commit; --dry-run builds it and sends nothing.
    env = {"HF_TOKEN": "hf_not_a_real_token_123", "HF_HUB_OFFLINE": "1"}
    res = procs.run("push", "someone/prov-data", "--out", out, "--dry-run", env=env)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("README.md: ") and "tokenized_data.jsonl: " in res.stdout
    assert any(line.startswith("records-00000-of-") for line in lines)
    assert "raw_responses" not in res.stdout and "hf_not_a_real_token" not in res.stdout + res.stderr
    assert lines[-1] == f"dry run: {len(lines) - 1} files for someone/prov-data, nothing uploaded"

    # The same push for real, to a stand-in of the Hub's API driven by the real huggingface_hub
    # client (tests/hub.py): one commit holding exactly the planned files, byte for byte, with the
    # token as the client's Bearer and nowhere in genq's words; pushed again, nothing is sent again;
    # a Hub that refuses is said in one line.
    planned = [line.split(":", 1)[0] for line in lines[:-1]]
    with Hub() as hub:
        # Online (another test of this process may have set HF_HUB_OFFLINE, as genq's tokenizer loader does).
        env = {
            "HF_TOKEN": "hf_not_a_real_token_123",
            "HF_ENDPOINT": hub.url,
            "HF_HUB_DISABLE_XET": "1",
            "HF_HUB_OFFLINE": "0",
        }
        res = procs.run("push", "someone/prov-data", "--out", out, env=env)
        assert res.returncode == 0, res.stderr
        repo = hub.repos["someone/prov-data"]
        assert repo.commits == [planned], repo.commits
        assert {name: (out / "prov" / name).read_bytes() for name in planned} == repo.files
        assert (
            res.stdout.splitlines()[-1]
            == f"pushed {len(planned)} files to {hub.url}/datasets/someone/prov-data/commit/{repo.sha}"
        )
        # Every write carried the token (the client also GETs a public list of its own, unauthenticated).
        writes = {auth for method, _, auth in hub.requests if method == "POST"}
        assert writes == {"Bearer hf_not_a_real_token_123"}, hub.requests
        assert "hf_not_a_real_token" not in res.stdout + res.stderr
        again = procs.run("push", "someone/prov-data", "--out", out, env=env)
        assert again.returncode == 0 and repo.commits == [planned], (again.stderr, repo.commits)
        hub.refuse_commits = True
        (out / "prov" / "tokenized_data.jsonl").write_bytes(b"")  # something to send
        refused = procs.run("push", "someone/prov-data", "--out", out, env=env)
        assert refused.returncode == 1, refused.stderr
        (said,) = [line for line in refused.stderr.splitlines() if line.strip()]
        assert said.startswith("Error: the Hub refused the push of someone/prov-data:"), said


def _every_config_loads(folder, rows: int, cache) -> None:
    """Each config of the folder's card loads through `datasets`, the default too, and so does each
    line the card gives for the exports of the other file type; then the same the other way round."""
    import datasets

    def check() -> None:
        card = huggingface_hub.DatasetCard.load(folder / "README.md")
        for config in [None, *(c["config_name"] for c in card.data.configs)]:
            loaded = datasets.load_dataset(str(folder), config, cache_dir=str(cache))
            assert loaded["train"].num_rows == rows, (config, loaded)
        for line in card.text.splitlines():
            if line.startswith("- ") and "datasets.load_dataset(" in line:
                kind, path = line.split("load_dataset(", 1)[1].split("'")[1::2][:2]
                loaded = datasets.load_dataset(kind, data_files=str(folder / path), cache_dir=str(cache))
                assert loaded["train"].num_rows == rows, (line, loaded)

    check()
    made = subprocess.run(
        genq_argv("export", folder.parent, "--format", "eagle3", "--include-truncated"),
        capture_output=True, text=True, timeout=120, env=os.environ.copy(),
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    card = huggingface_hub.DatasetCard.load(folder / "README.md")
    assert [c["config_name"] for c in card.data.configs] == ["eagle3"] and "- parquet: " in card.text
    check()
