"""/metrics of the worker and the collector, scraped during a run, checked against the files."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from genq.commands.embedded import free_port
from tests.helpers import log_of, read_jsonl, sim_stats, status_json, wait_until, write_prompts


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(metrics: dict, name: str, **labels: str) -> float:
    return metrics[(name, frozenset(labels.items()))]


def test_metrics_of_worker_and_collector_agree_with_the_files(procs, start_sim, out, tmp_path):
    url = start_sim("--fail-500", "0.2")
    write_prompts(tmp_path / "m.jsonl", 60)
    assert procs.run("enqueue", tmp_path / "m.jsonl", "--max-new-tokens", "100").returncode == 0
    wport, cport = free_port(), free_port()
    worker = procs.start("worker", "--server", url, "--concurrency", "8", "--metrics-port", str(wport))
    collector = procs.start("collect", "--out", out, "--metrics-port", str(cport))
    wait_until(
        lambda: (
            (s := status_json(procs))["datasets"]["m"]["done"] == 60 and s["workers"][0]["in_flight"] == 0
        ),
        60,
        "every record on disk",
    )
    injected = sim_stats(url)["faults"]["error_500"]
    assert injected > 0, "the server failed some requests: errors and retries to count"
    assert f"metrics: serving http://127.0.0.1:{cport}/metrics" in log_of(collector), "127.0.0.1 by default"
    records = read_jsonl(out / "m" / "raw_responses.jsonl")
    prompt = sum(r["prompt_tokens"] for r in records)
    completion = sum(r["completion_tokens"] for r in records)
    retried = sum(r["attempts"] - 1 for r in records)

    w = scrape(wport)
    assert value(w, "genq_worker_jobs_total", dataset="m", outcome="done") == 60
    assert value(w, "genq_worker_tokens_total", dataset="m", kind="prompt") == prompt
    assert value(w, "genq_worker_tokens_total", dataset="m", kind="completion") == completion
    assert value(w, "genq_worker_requests_total", outcome="ok", error="") == 60
    errors = value(w, "genq_worker_requests_total", outcome="error", error="server_error")
    assert errors == value(w, "genq_worker_retries_total", error="server_error") == retried > 0
    assert errors <= injected, "each error counted is one the server injected"
    assert value(w, "genq_worker_request_seconds_count") == 60 + errors
    assert value(w, "genq_worker_in_flight") == 0 and value(w, "genq_worker_server_up") == 1
    assert not [k for k in w if k[0].startswith("genq_collector_")], "a worker serves only its own metrics"

    c = scrape(cport)
    assert value(c, "genq_collector_written_total", dataset="m", kind="record") == len(records) == 60
    assert value(c, "genq_collector_tokens_total", dataset="m", kind="completion") == completion
    assert value(c, "genq_collector_tokens_total", dataset="m", kind="prompt") == prompt
    assert value(c, "genq_stream_length") == 0 and value(c, "genq_stream_oldest_pending_seconds") == 0
    assert not [k for k in c if k[0].startswith("genq_worker_")]
    for proc in (worker, collector):
        proc.terminate()
        assert proc.wait(60) == 0, log_of(proc)
