"""`genq dashboard`: rq-dashboard in headless Chromium during a run, its JSON endpoints while workers
are busy with JSON jobs, requeue that keeps genq's bookkeeping, delete off, basic auth."""

from __future__ import annotations

import asyncio
import base64
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import redis

from genq.commands.dashboard_app import create_app
from genq.commands.embedded import free_port
from genq.keys import Keys
from tests.helpers import (
    assert_adds_up,
    dump_dom,
    http,
    log_of,
    need,
    one_failure,
    status_json,
    wait_until,
    write_prompts,
)


def test_dashboard_in_chromium_during_a_run(procs, start_sim, out, tmp_path, conn, namespace):
    need("chromium")  # skipped without it; in CI (which installs it) a clear failure
    url = start_sim(
        "--latency", "realistic", "--min-len", "1500", "--max-len", "1600", "--decode-step-ms", "5"
    )
    write_prompts(tmp_path / "dash.jsonl", 40)
    assert procs.run("enqueue", tmp_path / "dash.jsonl", "--max-new-tokens", "2000").returncode == 0
    port = free_port()
    dashboard = procs.start("dashboard", "--port", str(port))
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: http(f"{base}/0/data/queues.json")[0] == 200, 30, "the dashboard")
    assert f"http://127.0.0.1:{port}/" in log_of(dashboard), "bound to 127.0.0.1 by default"
    procs.start("worker", "--server", url, "--concurrency", "8")
    procs.start("collect", "--out", out)
    # 8 sent and 2 taken ahead for the next free slots (WorkerConfig.prefetch: concurrency // 4).
    wait_until(lambda: status_json(procs)["datasets"]["dash"]["in_flight"] == 10, 30, "10 jobs in flight")

    queue = f"{namespace}.dash"
    started = conn.zrange(f"rq:wip:{queue}", 0, 0)[0].decode().split(":")[0]
    for path in (
        "/0/data/queues.json",
        "/0/data/workers.json",
        f"/0/data/jobs/{queue}/queued/20/asc/1.json",
        f"/0/data/jobs/{queue}/started/20/asc/1.json",
        f"/0/data/job/{started}.json",
        f"/0/view/job/{started}",
        "/0/view/workers",
    ):
        code, body = http(base + path)
        assert code == 200, (path, body[:500])
    workers = orjson.loads(http(f"{base}/0/data/workers.json")[1])["workers"]
    (worker,) = [w for w in workers if w["name"].startswith(f"genq.{namespace}.")]
    assert worker["state"] == "busy" and worker["queues"] == [queue]
    assert worker["current_job"]["job_id"].startswith(f"{namespace}--dash-"), "a busy worker, read as JSON"

    before = conn.llen(f"rq:queue:{queue}")
    assert 0 < before < 40, f"{before} queued: the page must show the queue while workers take from it"
    dom = dump_dom(base + "/", tmp_path / "chromium")
    after = conn.llen(f"rq:queue:{queue}")
    row = re.search(rf"<td>{re.escape(queue)}</td>\s*<td[^>]*>\s*<a [^>]*>(\d+)</a>", dom)
    assert row, dom[-3000:]
    assert after <= int(row.group(1)) <= before, (row.group(1), before, after)


def test_dashboard_requeue_is_genq_retry_and_delete_is_off(
    procs, start_sim, out, tmp_path, redis_url, namespace
):
    one_failure(procs, start_sim("--context-length", "256"), out, tmp_path)
    client = create_app(redis_url).test_client()
    same_site = {"Origin": "http://localhost"}
    job_id = Keys(namespace).job_id("rq-1")
    res = client.post(f"/job/{job_id}/requeue", headers=same_site)
    assert res.status_code == 200 and res.json["count"] == 1, res.json
    status = status_json(procs)
    assert_adds_up(status)
    assert (status["datasets"]["rq"]["queued"], status["datasets"]["rq"]["failed"]) == (1, 0)
    meta = redis.Redis.from_url(redis_url).hget(f"rq:job:{job_id}", "meta")
    assert meta in (None, b"{}"), f"meta stays JSON (not pickle): {meta!r}"
    assert client.post(f"/requeue/{namespace}.rq", headers=same_site).json["count"] == 0, (
        "nothing failed is left"
    )
    res = client.post("/requeue/someone-elses-queue", headers=same_site)
    assert res.status_code == 403 and "not a genq queue" in res.json["message"]
    res = client.post(f"/job/{job_id}/delete", headers=same_site)
    assert res.status_code == 403 and res.json["status"] == "DISABLED"
    assert client.get("/1/data/queues.json").status_code == 404, "one Redis"

    locked = create_app(redis_url, "ops", "pw").test_client()
    assert locked.get("/0/data/queues.json").status_code == 401
    auth = {"Authorization": "Basic " + base64.b64encode(b"ops:pw").decode()}
    assert locked.get("/0/data/queues.json", headers=auth).status_code == 200


async def _cdp(ws, calls: list[int], method: str, **params: Any) -> dict:
    """One Chrome DevTools Protocol command, its result (events in between are skipped)."""
    calls.append(len(calls) + 1)
    await ws.send_json({"id": calls[-1], "method": method, "params": params})
    async for msg in ws:
        reply = orjson.loads(msg.data)
        if reply.get("id") == calls[-1]:
            assert "error" not in reply, reply
            return reply["result"]
    raise AssertionError(f"Chromium closed the connection during {method}")


def click_in_chromium(
    url: str, selectors: list[str], profile: Path, done: Callable[[], Any], what: str
) -> None:
    """Open ``url`` in headless Chromium once it has loaded (its scripts have bound the buttons),
    click each element in turn as an operator does, and keep the page open until ``done()``."""
    chromium = subprocess.Popen(
        [need("chromium"), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        active = profile / "DevToolsActivePort"
        port = wait_until(lambda: active.exists() and active.read_text().split("\n")[0], 60, "Chromium")

        async def drive() -> None:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{port}/json/list") as res:
                    page = next(t for t in await res.json() if t["type"] == "page")
                async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                    calls: list[int] = []
                    await _cdp(ws, calls, "Page.navigate", url=url)
                    first = orjson.dumps(selectors[0]).decode()
                    ready = f"document.readyState === 'complete' && !!document.querySelector({first})"
                    for _ in range(200):
                        found = await _cdp(ws, calls, "Runtime.evaluate", expression=ready)
                        if found["result"].get("value") is True:
                            break
                        await asyncio.sleep(0.1)
                    else:
                        raise AssertionError(f"no {selectors[0]} on {url}")
                    for selector in selectors:
                        click = f"document.querySelector({orjson.dumps(selector).decode()}).click()"
                        await _cdp(ws, calls, "Runtime.evaluate", expression=click)

        asyncio.run(drive())
        wait_until(done, 30, what)
    finally:
        chromium.kill()
        chromium.wait(30)


def test_dashboard_buttons_in_chromium(procs, start_sim, out, tmp_path, namespace):
    """The Requeue All button of the failed jobs' page: rq-dashboard's own $.post, from Chromium,
    passes the same-origin check (browsers send Origin with a POST) and requeues the failure."""
    need("chromium")
    one_failure(procs, start_sim("--context-length", "256"), out, tmp_path)
    port = free_port()
    procs.start("dashboard", "--port", str(port))
    base = f"http://localhost:{port}"
    wait_until(lambda: http(f"{base}/0/data/queues.json")[0] == 200, 30, "the dashboard")
    page = f"{base}/0/view/jobs/{namespace}.rq/failed/8/asc/1"
    counts = lambda: status_json(procs)["datasets"]["rq"]  # noqa: E731
    requeued = lambda: (counts()["queued"], counts()["failed"]) == (1, 0)  # noqa: E731
    buttons = ["#requeue-all-btn", "#confirmation-modal-yes"]
    click_in_chromium(page, buttons, tmp_path / "chromium", requeued, "the failure requeued")
