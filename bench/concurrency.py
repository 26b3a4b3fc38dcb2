"""`--concurrency auto` against fixed concurrencies, side by side, on simulator profiles (issues 27, 42).

    python bench/concurrency.py            # 4 profiles x (16 ... 1024, auto), ~45 minutes
    python bench/concurrency.py --quick    # a third of the jobs: runs of 8-17 s, ramp-up included
    python bench/concurrency.py --engine all --engines-only   # the real engines
    python bench/concurrency.py --engine vllm --engines-only --quick --concurrency 16 --concurrency auto

Each row is one worker on a fresh simulator whose KV cache over-admits and retracts when full
(sim/scheduler.py), every process real (bench/throughput.py's run_once). Columns: completion
tokens/s, waste (tokens recomputed because of retractions, paid for twice, per completion token),
each job's latency (p50, p99, from the records), and for auto its ratios to the fixed settings of
its profile, the goal's terms (issue 42: >= 0.97x the best's tok/s, p50 <= 1.5x the knee's, from
the first 10 s): tok/s against the best's, p50 against the knee's (the fewest in flight that reach
0.97 of the best tok/s: more only queue), the first 10 seconds' tok/s against the best's first 10
seconds, p99 against the best's. vllm-512-slots-15s speaks vLLM's API (no slot count published:
auto learns it), 512 slots, a run of about 15 s at the best setting.
With ``--engine``, the same sweep (from 4 in flight) on the real engines' tiny CPU models, each
server started once for its sweep: llama.cpp with 4 and with 16 slots, SGLang with a 4,096-token
KV cache and with 8 running requests at most, vLLM with 64 sequences; there "retracted" is the
engine's own count (SGLang sglang:num_retracted_reqs, vLLM vllm:num_preemptions_total) and waste
is not measured. Speed is measured here, never asserted in tests. Results also go to
bench/results/concurrency.json (concurrency-engines.json with --engines-only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import orjson
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import kill_children, machine  # noqa: E402
from bench.real_engine import bare, engine_server  # noqa: E402
from bench.throughput import EARLY_S, Config, Engine, console, run_once  # noqa: E402
from genq.backends.load import prometheus  # noqa: E402
from genq.commands.embedded import EmbeddedRedis  # noqa: E402

FAST = ("--latency", "realistic", "--decode-step-ms", "4", "--batch-knee", "64")
# name: (simulator flags, max_new_tokens, jobs)
PROFILES = {
    "large-kv-short": ((*FAST, "--kv-tokens", "400000", "--min-len", "16", "--max-len", "64"), 64, 6000),
    "small-kv-long": ((*FAST, "--kv-tokens", "12000", "--min-len", "200", "--max-len", "400"), 400, 900),
    "mixed": ((*FAST, "--kv-tokens", "40000", "--min-len", "16", "--max-len", "512"), 512, 1800),
    # vLLM's API (no slot count published: auto learns it), 512 slots, a run of about 15 seconds.
    "vllm-512-slots-15s": (
        (*FAST, "--api", "vllm", "--max-running-requests", "512", "--min-len", "16", "--max-len", "64"),
        64,
        4500,
    ),
}
CONCURRENCIES: tuple[int | str, ...] = (16, 64, 128, 256, 512, 1024, "auto")
# The real engines on their tiny CPU models (bench/real_engine.py's servers, these flags after the
# tests'): name: (engine, batch slots, more server flags, max_new_tokens, jobs). SGLang's KV cache is
# cut to 4,096 tokens so that its scheduler, not the CPU alone, bounds the batch.
ENGINES = {
    "llamacpp-parallel-4": ("llamacpp", 4, (), 64, 1500),
    "llamacpp-parallel-16": ("llamacpp", 16, (), 64, 3000),
    "sglang": ("sglang", 256, ("--max-total-tokens", "4096", "--enable-metrics"), 128, 800),
    "sglang-8-running": ("sglang", 8, ("--enable-metrics",), 128, 800),
    "vllm": ("vllm", 64, (), 128, 800),
}
ENGINE_CONCURRENCIES: tuple[int | str, ...] = (4, 8, 16, 32, 64, 256, 1024, "auto")
# Each engine's count of requests it took back from a full KV cache, on its /metrics.
PREEMPTIONS = {"sglang": "sglang:num_retracted_reqs", "vllm": "vllm:num_preemptions_total"}


def sim_stats(url: str) -> dict:
    with urllib.request.urlopen(url + "/sim/stats", timeout=10) as resp:
        stats = orjson.loads(resp.read())
    return {"retracted": stats["retracted"], "recomputed_tokens": stats["recomputed_tokens"]}


def preemptions(engine: str, url: str) -> int | None:
    """The engine's retractions/preemptions since it started; None for llama.cpp (fixed slots, it
    never takes a request back)."""
    if engine not in PREEMPTIONS:
        return None
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return int(prometheus(text, [PREEMPTIONS[engine]]).get(PREEMPTIONS[engine], 0))


def waste(m: dict) -> float | None:
    """Tokens recomputed (retracted or preempted, paid for twice) per completion token; None on a
    real engine, which does not count them (its retractions are in their own column)."""
    if m.get("recomputed_tokens") is None:
        return None
    return m["recomputed_tokens"] / max(1, m["completion_tokens"])


def progress(res: dict) -> str:
    """One run's line as it ends."""
    recomputed = "" if res["recomputed_tokens"] is None else f"{res['recomputed_tokens']} recomputed, "
    rate = f"{res['wall_s']:.1f} s, {res['completion_tok_per_s']:.0f} tok/s"
    return f"{rate}, {recomputed}{res['log_issues']} log issues"


def run_engine(
    name: str, settings: list[int | str], quick: bool, server: EmbeddedRedis, work: Path, children: list
) -> dict[str, dict]:
    """Every setting on one real server, started once for them all."""
    engine, batch, flags, max_new, jobs = ENGINES[name]
    jobs = jobs // 3 if quick else jobs
    results = {}
    folder = work / name
    folder.mkdir()
    with engine_server(engine, folder, batch, None, *flags) as (url, pid, make_prompts):
        vocabulary = make_prompts(jobs)
        # Warm up (first requests compile and allocate), outside the measured runs.
        asyncio.run(bare(engine, url, vocabulary[:64], max_new, 16))
        for c in settings:
            cfg = Config(f"{name}-c{c}", (), 1, c, jobs, max_new, name)
            before = preemptions(engine, url)

            def measure(url: str, before: int | None = before) -> dict:
                after = preemptions(engine, url)
                taken_back = None if after is None or before is None else after - before
                return {"retracted": taken_back, "recomputed_tokens": None}

            console.print(f"{cfg.name}: {cfg.jobs} jobs ...", end=" ")
            on = Engine(url, pid, vocabulary, ("--backend", engine))
            res = run_once(cfg, server, work, children, measure, on)
            console.print(progress(res))
            results[cfg.name] = {"config": cfg.__dict__, "median": res, "runs": [res]}
    return results


KNEE = 0.97  # the knee: the fewest in flight that reach this share of the best fixed tok/s


def versus_fixed(results: dict[str, dict], auto: dict) -> str:
    """Auto against the fixed settings of its profile, in the goal's terms (issue 42 item 3): tok/s
    against the best's, p50 against the knee's (the fewest in flight reaching KNEE of the best:
    more only queue), the first seconds' tok/s against the best's first seconds, p99 against the
    best's, and against the best wasting at most 1 %."""
    cfg, m = auto["config"], auto["median"]
    fixed = [
        r
        for r in results.values()
        if r["config"]["baseline"] == cfg["baseline"] and r["config"]["concurrency"] != "auto"
    ]
    if not fixed:
        return ""
    best = max(fixed, key=lambda f: f["median"]["completion_tok_per_s"])["median"]
    top = best["completion_tok_per_s"]
    knee = min(
        (f for f in fixed if f["median"]["completion_tok_per_s"] >= KNEE * top),
        key=lambda f: int(f["config"]["concurrency"]),
    )
    parts = [
        f"{m['completion_tok_per_s'] / top:.2f}x tok/s",
        f"p50 {m['latency_p50_s'] / knee['median']['latency_p50_s']:.2f}x the knee's "
        f"({knee['config']['concurrency']})",
    ]
    if best.get("early_tok_per_s") and m.get("early_tok_per_s") is not None:
        parts.append(f"first {EARLY_S} s {m['early_tok_per_s'] / best['early_tok_per_s']:.2f}x")
    parts.append(f"p99 {m['latency_p99_s'] / best['latency_p99_s']:.2f}x")
    clean = [f["median"] for f in fixed if (waste(f["median"]) or 0) <= 0.01]
    if clean and (safe := max(clean, key=lambda f: f["completion_tok_per_s"])) is not best:
        parts.append(f"{m['completion_tok_per_s'] / safe['completion_tok_per_s']:.2f}x the best wasting ≤1%")
    return "; ".join(parts)


def print_table(results: dict[str, dict]) -> None:
    """One row per run; auto's row also says how it compares with the fixed settings."""
    table = Table(title="--concurrency auto vs fixed (one worker)")
    cols = ("profile", "concurrency", "jobs", "tok/s", "waste", "retracted", "p50 s", "p99 s")
    cols = (*cols, "auto vs fixed")
    for col in cols:
        table.add_column(col, justify="left" if col in ("profile", "auto vs fixed") else "right")
    for res in results.values():
        cfg, m = res["config"], res["median"]
        table.add_row(
            cfg["baseline"],
            str(cfg["concurrency"]),
            str(cfg["jobs"]),
            f"{m['completion_tok_per_s']:.0f}",
            "-" if (w := waste(m)) is None else f"{w:.1%}",
            "-" if m["retracted"] is None else f"{m['retracted']:.0f}",
            f"{m['latency_p50_s']:.2f}",
            f"{m['latency_p99_s']:.2f}",
            versus_fixed(results, res) if cfg["concurrency"] == "auto" else "",
        )
    console.print(table)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a third of the jobs")
    parser.add_argument("--profile", action="append", choices=PROFILES, help="only these (repeatable)")
    parser.add_argument(
        "--engine",
        action="append",
        choices=[*ENGINES, "all"],
        help="also these real engines (repeatable; all: every one)",
    )
    parser.add_argument("--engines-only", action="store_true", help="no simulator profiles")
    parser.add_argument(
        "--concurrency", action="append", help="only these settings, e.g. auto or 64 (repeatable)"
    )
    args = parser.parse_args()
    configs = [
        Config(f"{name}-c{c}", flags, 1, c, jobs // 3 if args.quick else jobs, max_new, name)
        for name, (flags, max_new, jobs) in PROFILES.items()
        if not args.engines_only and (not args.profile or name in args.profile)
        for c in CONCURRENCIES
        if not args.concurrency or str(c) in args.concurrency
    ]

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    work = Path(tempfile.mkdtemp(prefix="genq-bench-concurrency-"))
    children: list[subprocess.Popen] = []
    server = EmbeddedRedis(work / "redis")
    results: dict[str, dict] = {}
    try:
        server.start()
        for cfg in configs:
            console.print(f"{cfg.name}: {cfg.jobs} jobs ...", end=" ")
            res = run_once(cfg, server, work, children, sim_stats)
            console.print(progress(res))
            results[cfg.name] = {"config": cfg.__dict__, "median": res, "runs": [res]}
        engines = list(ENGINES) if "all" in (args.engine or ()) else args.engine or []
        settings = [c for c in ENGINE_CONCURRENCIES if not args.concurrency or str(c) in args.concurrency]
        for name in engines:
            results.update(run_engine(name, settings, args.quick, server, work, children))
    except KeyboardInterrupt:
        console.print("\ninterrupted")
        return 130
    finally:
        kill_children(children)
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print_table(results)
    name = "concurrency-engines.json" if args.engines_only else "concurrency.json"
    dest = Path(__file__).resolve().parent / "results" / name
    dest.write_text(
        json.dumps({"machine": machine(), "quick": args.quick, "results": results}, indent=2) + "\n"
    )
    console.print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
