"""Logs: one line per event worth knowing, with job id, dataset and worker; JSON for log shippers."""

from __future__ import annotations

import orjson

from genq.commands.embedded import free_port
from tests.helpers import log_of, sim_stats, status_json, stop, wait_until, write_prompts


def test_worker_json_log_names_job_dataset_and_worker_for_every_event(
    procs, start_sim, out, tmp_path, namespace
):
    write_prompts(tmp_path / "logs.jsonl", 20)
    with (tmp_path / "logs.jsonl").open("ab") as fh:
        fh.write(orjson.dumps({"input_ids": [101] * 200}) + b"\n")  # cannot fit: fails for good
    assert procs.run("enqueue", tmp_path / "logs.jsonl", "--max-new-tokens", "100").returncode == 0
    port = free_port()
    server = f"http://127.0.0.1:{port}"
    # The server is down when the worker starts, and comes up later.
    worker = procs.start("worker", "--server", server, "--concurrency", "4", "--log-format", "json")
    wait_until(lambda: "not ready" in log_of(worker), 30, "the worker to see the server down")
    # start_sim's --port 0 comes first: the last --port wins.
    assert start_sim("--port", str(port), "--context-length", "256", "--fail-500", "0.3") == server
    collector = procs.start("collect", "--out", out, "--burst", env={"GENQ_LOG_FORMAT": "json"})
    wait_until(lambda: status_json(procs)["datasets"]["logs"]["done"] == 20, 60, "the run")
    assert stop(worker) == 0, log_of(worker)
    assert collector.wait(60) == 0, log_of(collector)
    assert sim_stats(server)["faults"]["error_500"] > 0, "the server failed some requests: retries to log"

    lines = [orjson.loads(line) for line in log_of(worker).splitlines()]  # every line is JSON
    assert lines and all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)

    def events(text: str) -> list[dict]:
        found = [line for line in lines if text in line["msg"]]
        assert found, f"no {text!r} line in {lines}"
        return found

    (start,) = events(f"serving {server}")
    name = start["worker"]
    assert name.startswith(f"genq.{namespace}.") and start["server"] == server
    assert events("not ready")[0]["server"] == server
    for retry in events("retrying in"):
        assert retry["job_id"].startswith(f"{namespace}--logs-") and retry["dataset"] == "logs"
        assert retry["worker"] == name and retry["attempt"] >= 1 and retry["error"]
    (failed,) = events("failed for good")
    assert (failed["job_id"], failed["dataset"], failed["error"]) == (
        f"{namespace}--logs-20",
        "logs",
        "bad_request",
    )
    assert events("stop requested")[0]["worker"] == name
    assert lines[-1]["msg"].endswith("stopped") and lines[-1]["worker"] == name
    collected = [orjson.loads(line) for line in log_of(collector).splitlines()]  # every line is JSON
    assert collected and all({"ts", "level", "logger", "msg"} <= set(line) for line in collected)


def test_text_log_names_the_worker(procs, start_sim, tmp_path, namespace):
    url = start_sim()
    write_prompts(tmp_path / "t.jsonl", 3)
    assert procs.run("enqueue", tmp_path / "t.jsonl", "--max-new-tokens", "50").returncode == 0
    res = procs.run("worker", "--server", url, "--burst")
    assert res.returncode == 0
    assert f" INFO genq.worker[genq.{namespace}." in res.stderr, res.stderr


def test_a_server_nothing_listens_on_is_said_so_with_how_long_and_what_to_check(procs, tmp_path):
    """A mistyped port: enqueue's one line asks whether the server runs; a worker keeps waiting
    (as documented) and each line says how long it has waited so far and what to check."""
    data = tmp_path / "p.jsonl"
    write_prompts(data, 2)
    server = f"http://127.0.0.1:{free_port()}"
    res = procs.run("enqueue", data, "--server", server)
    assert res.returncode != 0 and "is the server running? check the URL" in res.stderr, res.stderr
    assert procs.run("enqueue", data).returncode == 0
    worker = procs.start("worker", "--server", server)
    wait_until(lambda: log_of(worker).count("not ready") >= 3, 60, "three probes of the absent server")
    lines = [line for line in log_of(worker).splitlines() if "not ready" in line]
    assert all("waited" in line and "check --server" in line for line in lines), lines
    assert "waited 0 s so far" in lines[0] and "waited 0 s so far" not in lines[-1], lines
    assert stop(worker) == 0, log_of(worker)
