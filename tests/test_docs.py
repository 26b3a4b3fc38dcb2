"""The docs name only what exists: every flag and every GENQ_* variable in README.md and docs/*.md.

A flag is genq's (any command's, read from the live command line), a benchmark script's, or one of
the other programs' flags listed in EXTERNAL with the program it belongs to. Where a line shows
`genq <command> ... --flag`, the flag must be that command's. A GENQ_* variable is a command's
environment variable, or is read somewhere in genq's code, units, compose file or scripts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest

from genq.commands.cli import main
from genq.commands.embedded import free_port
from tests.helpers import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = ["genq", "producer", "worker", "collector", "sim", "ops", "bench", "compose.yaml", "Makefile"]
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
VARIABLE = re.compile(r"\bGENQ_[A-Z0-9_]+\b")
# `genq CMD` and what follows it on the line, up to a pipe, `;`, `&&` or the end of a code span.
COMMAND_LINE = re.compile(r"\bgenq ([a-z][a-z-]*)([^|;&`\n]*)")

EXTERNAL = {
    # SGLang's launch_server and its router
    "--device": "SGLang",
    "--model-path": "SGLang",
    "--enable-deterministic-inference": "SGLang",
    "--enable-metrics": "SGLang",
    "--disable-retries": "sglang-router",
    # vLLM's api_server
    "--enable-prompt-tokens-details": "vLLM",
    "--max-model-len": "vLLM",
    "--max-num-queued-reqs": "vLLM",
    # llama.cpp's llama-server
    "--kv-unified": "llama-server",
    "--parallel": "llama-server",
    "--metrics": "llama-server",
    "--no-slots": "llama-server",
    # Slurm's sbatch
    "--account": "sbatch",
    "--array": "sbatch",
    "--export": "sbatch",
    "--signal": "sbatch",
    # pytest-xdist (docs/design.md, Testing)
    "--dist": "pytest-xdist",
    # podman, podman-compose, systemd, pip, redis-server
    "--build": "podman-compose",
    "--build-arg": "podman build",
    "--env-file": "podman-compose",
    "--init": "podman",
    "--layers": "podman build",
    "--network": "podman",
    "--profile": "podman-compose",
    "--restart": "podman",
    "--stop-timeout": "podman",
    "--volumes": "podman-compose down",
    "--now": "systemctl",
    "--find-links": "pip",
    "--no-index": "pip",
    "--sentinel": "redis-server",
    "--tls-port": "redis-server",
    "--tls-cert-file": "redis-server",
    "--tls-key-file": "redis-server",
    "--tls-ca-cert-file": "redis-server",
}


def _commands() -> dict[str, click.Command]:
    ctx = click.Context(main)
    return {name: main.get_command(ctx, name) for name in main.list_commands(ctx)}  # type: ignore[misc]


def _flags(command: click.Command) -> set[str]:
    found = {"--help", "-h"}
    for param in command.params:
        found.update(param.opts, param.secondary_opts)
    if isinstance(command, click.Group):
        for sub in _commands_of(command).values():
            found |= _flags(sub)
    return found


def _commands_of(group: click.Group) -> dict[str, click.Command]:
    ctx = click.Context(group)
    return {name: group.get_command(ctx, name) for name in group.list_commands(ctx)}  # type: ignore[misc]


def _bench_flags() -> set[str]:
    pattern = re.compile(r'add_argument\(\s*"(--[a-z-]+)"')
    return {flag for path in (ROOT / "bench").glob("*.py") for flag in pattern.findall(path.read_text())}


def _variables() -> set[str]:
    found: set[str] = set()
    for command in _commands().values():
        for param in command.params:
            env = getattr(param, "envvar", None)
            found.update(_listed(env) if env else [])
    for name in SOURCES:
        path = ROOT / name
        for file in [path] if path.is_file() else path.rglob("*"):
            if file.is_file() and file.suffix not in {".png", ".svg", ".pyc"}:
                found.update(VARIABLE.findall(file.read_text(errors="replace")))
    return found


def _doc_lines():
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            yield f"{doc.relative_to(ROOT)}:{number}", line


def test_every_flag_the_docs_name_exists():
    commands = _commands()
    known = set().union(*(_flags(c) for c in commands.values())) | _bench_flags() | set(EXTERNAL)
    named = [(where, flag) for where, line in _doc_lines() for flag in FLAG.findall(line)]
    assert len(named) > 300, "the docs' flags were not found: the pattern is broken"
    unknown = [f"{where}: {flag}" for where, flag in named if flag not in known]
    assert not unknown, "flags the docs name that nothing has:\n" + "\n".join(unknown)
    assert not [f for f in EXTERNAL if f in known - set(EXTERNAL)], "a genq flag is listed as external"


def test_flags_shown_after_a_command_are_that_commands():
    commands = _commands()
    checked, misplaced = 0, []
    for where, line in _doc_lines():
        for match in COMMAND_LINE.finditer(line):
            command = commands.get(match.group(1))
            if command is None:
                continue
            for flag in FLAG.findall(match.group(2)):
                checked += 1
                if flag not in _flags(command):
                    misplaced.append(f"{where}: genq {match.group(1)} has no {flag}")
    assert checked > 50, "no `genq <command> --flag` found in the docs: the pattern is broken"
    assert not misplaced, "\n".join(misplaced)


def test_every_variable_the_docs_name_is_read_somewhere():
    variables = _variables()
    named = [(where, v) for where, line in _doc_lines() for v in VARIABLE.findall(line)]
    assert len(named) > 30, "the docs' variables were not found: the pattern is broken"
    unknown = [f"{where}: {v}" for where, v in named if v not in variables]
    assert not unknown, "variables the docs name that nothing reads:\n" + "\n".join(unknown)


def test_every_options_variable_is_a_well_formed_name():
    """An on/off pair (`--x/--no-x`) gets one variable named after its first half, never a name
    with the slash in it."""
    names = [
        (name, param.name, param.envvar)
        for name, command in _commands().items()
        for param in command.params
        if getattr(param, "envvar", None)
    ]
    assert len(names) > 50
    bad = [n for n in names if not all(VARIABLE.fullmatch(v) for v in _listed(n[2]))]
    assert not bad, bad


def _listed(envvar: str | list[str]) -> list[str]:
    return [envvar] if isinstance(envvar, str) else list(envvar)


def test_only_the_commands_that_name_a_dataset_read_genq_dataset():
    """GENQ_DATASET names the dataset `enqueue` (and `run`) writes; a command whose --dataset
    filters what it shows reads a variable of its own, so an exported GENQ_DATASET cannot
    silently narrow `failed`, `retry`, `verify` or `export`."""
    readers = {
        name
        for name, command in _commands().items()
        for param in command.params
        if "GENQ_DATASET" in _listed(getattr(param, "envvar", None) or [])
    }
    assert readers == {"enqueue", "run"}, readers


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("job", ["Job A", "Job B"])
def test_the_recipes_run_as_written(tmp_path, job):
    """docs/recipes.md's commands, as a user pastes them, from a folder laid out as the repository's
    root (the simulator in place of the cluster): each ends 0 and writes the files it says."""
    text = (ROOT / "docs" / "recipes.md").read_text()
    section = text[text.index(f"## {job}") :]
    script = section[section.index("```sh\n") + 6 : section.index("\n```", section.index("```sh"))]
    port = str(free_port())
    for name in ("examples", "tests"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    res = subprocess.run(
        ["bash", "-euc", script.replace("18000", port)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    if job == "Job A":
        records = read_jsonl(tmp_path / "out-a" / "prompts" / "raw_responses.jsonl")
        assert len(records) == 200 and all(r["reasoning"] is not None for r in records)
        assert len(read_jsonl(tmp_path / "out-a" / "prompts" / "sharegpt.jsonl")) == 200
    else:
        for i in range(10):
            rows = read_jsonl(tmp_path / "out-b" / f"set{i}" / "tokenized_data.jsonl")
            assert len(rows) == 20 and all(len(r["input_ids"]) == len(r["loss_mask"]) for r in rows)
