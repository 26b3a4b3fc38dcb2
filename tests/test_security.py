"""docs/security.md, tested: Redis content is untrusted input, secrets stay where they belong, TLS
checks the server's name, and `genq run`'s private Redis is private."""

from __future__ import annotations

import shutil

import orjson
import pytest

from genq.keys import Keys
from genq.templates import ChatTemplate, TemplateError
from tests.helpers import check_records, log_of, write_prompts

PARAMS = {"max_new_tokens": 32}


def test_a_dataset_name_from_redis_cannot_leave_out(procs, start_sim, conn, namespace, out, tmp_path):
    """Names written into Redis by hand (``../escape``, an absolute path) with entries in their
    streams: the collector refuses each with one line, leaves its entries, and writes nothing
    outside OUT, while the sound dataset lands."""
    sim = start_sim()
    prompts = write_prompts(tmp_path / "good.jsonl", 20)
    assert procs.run("enqueue", tmp_path / "good.jsonl", "--max-new-tokens", "32").returncode == 0
    keys = Keys(namespace)
    settings = orjson.loads(conn.hget(keys.datasets, "good"))
    escaped = tmp_path / "abs"
    bad = ["../escape", str(escaped)]
    procs.start("worker", "--server", sim, "--burst").wait(120)
    entries = conn.xrange(keys.results("good"))
    assert entries, "the worker left the sound dataset's results in its stream"
    for name in bad:
        conn.hset(keys.datasets, name, orjson.dumps({**settings, "name": name}))
        for _, fields in entries:
            conn.xadd(keys.results(name), fields)

    collector = procs.start("collect", "--out", out, "--burst")
    assert collector.wait(120) == 0, log_of(collector)
    check_records(out, "good", prompts, PARAMS)
    assert not (tmp_path / "escape").exists() and not escaped.exists()
    assert sorted(p.name for p in out.iterdir()) == ["good"]
    for name in bad:
        refused = [line for line in log_of(collector).splitlines() if "refusing dataset" in line]
        assert sum(repr(name.encode()) in line for line in refused) == 1, log_of(collector)
        assert conn.xlen(keys.results(name)) == len(entries), "its entries are left for an operator"


def test_a_job_cannot_choose_its_tokenizer_or_smuggle_a_chat_template(tokenizer_dir, tmp_path):
    """A job's template spec is Redis content: the worker loads only the tokenizer, kwargs and
    fingerprint the dataset's settings recorded, and the fingerprint covers the kwargs."""
    enqueued = ChatTemplate(str(tokenizer_dir))
    recorded = {"tokenizer": enqueued.name, "chat_template": enqueued.fingerprint}
    assert ChatTemplate.from_spec(enqueued.spec(), recorded).fingerprint == enqueued.fingerprint

    smuggled = ChatTemplate(str(tokenizer_dir), {"chat_template": "{{ 'pwned' }}"})
    assert smuggled.fingerprint != enqueued.fingerprint
    forged = {**enqueued.spec(), "kwargs": smuggled.kwargs}
    other = shutil.copytree(tokenizer_dir, tmp_path / "other")
    for spec in (forged, smuggled.spec(), {**enqueued.spec(), "tokenizer": str(other)}):
        with pytest.raises(TemplateError, match="not the one its dataset recorded"):
            ChatTemplate.from_spec(spec, recorded)
