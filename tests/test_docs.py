"""The docs name only what exists: every flag and every GENQ_* variable in README.md and docs/*.md,
every message they quote (genq's words, or another program's listed here), and every genq command
line of their shell blocks (it parses as written; the recipes and README's demo also run).

A flag is genq's (any command's, read from the live command line), a benchmark script's, or one of
the other programs' flags listed in EXTERNAL with the program it belongs to. Where a line shows
`genq <command> ... --flag`, the flag must be that command's. A GENQ_* variable is a command's
environment variable, or is read somewhere in genq's code, units, compose file or scripts.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import click
import pytest

from genq.commands.cli import main
from genq.commands.embedded import free_port
from tests.helpers import read_jsonl

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ROLES = ["producer", "worker", "collector", "checker", "outputs", "sim"]
SOURCES = ["genq", *ROLES, "ops", "bench", "compose.yaml", "Makefile"]
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
    "--max-num-seqs": "vLLM",
    # llama.cpp's llama-server
    "--cache-ram": "llama-server",
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
    # the Hugging Face Hub's CLI
    "--include": "hf download",
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
@pytest.mark.parametrize("job", ["Job A", "Job B", "Job C"])
def test_the_recipes_run_as_written(tmp_path, job):
    """docs/recipes.md's commands, as a user pastes them, from a folder laid out as the repository's
    root (the simulator in place of the cluster): each ends 0 and writes the files it says."""
    text = (ROOT / "docs" / "recipes.md").read_text()
    section = text[text.index(f"## {job}") :]
    script = section[section.index("```sh\n") + 6 : section.index("\n```", section.index("```sh"))]
    port = str(free_port())
    for name in ("examples", "tests"):
        (tmp_path / name).symlink_to(ROOT / name)
    # The recipe puts genq on PATH itself (`. .venv/bin/activate`): the shell is given none.
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not (Path(p) / "genq").exists())
    env = {**os.environ, "PATH": path}
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
    elif job == "Job C":
        verdicts = read_jsonl(tmp_path / "out-c" / "verdicts" / "raw_responses.jsonl")
        answers = read_jsonl(tmp_path / "out-c" / "answers" / "raw_responses.jsonl")
        assert (
            sorted(v["parent"] for v in verdicts) == sorted(a["id"] for a in answers) and len(answers) == 200
        )
    else:
        for i in range(10):
            rows = read_jsonl(tmp_path / "out-b" / f"set{i}" / "tokenized_data.jsonl")
            assert len(rows) == 20 and all(len(r["input_ids"]) == len(r["loss_mask"]) for r in rows)
            # Split at the simulator's </think> (the ids the recipe gives are the stand-in's).
            records = read_jsonl(tmp_path / "out-b" / f"set{i}" / "raw_responses.jsonl")
            assert all(r["reasoning"] and r["content"] for r in records), records[0]
        # What it leaves in the repository's root is git-ignored (and so out of the lint's way).
        left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out"))
        ignored = subprocess.run(
            ["git", "check-ignore", "--no-index", *(f"{name}/" for name in left)],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert [p.rstrip("/") for p in ignored.stdout.split()] == left, (left, ignored.stdout, ignored.stderr)


# -- the messages the docs quote --------------------------------------------------------------------

# Words the docs quote from other programs, with the program that says them.
FOREIGN_MESSAGES = {
    "self-signed certificate in certificate chain": "OpenSSL",
    "Do you wish to run the custom code": "transformers",
    "command not allowed when used memory": "Redis",
}
HOLE = "\x00"  # where a message has a value: an f-string's {…}, a %-format's %s
PERCENT_OR_BRACES = re.compile(r"%[-#0 +]*\d*(?:\.\d+)?[sdrfgixX]|\{[^{}]*\}")
VALUE_WORDS = 3  # the most words a value stands for in a quote: a name, `genq sim-server`, a list
TOKEN = re.compile(r"[,:;.]|[^\s,:;.]+")  # words, and the punctuation between them on its own
# A word of prose: a run of three or more of them in a quoted message must be genq's own words.
PROSE_WORD = re.compile(r"(?:[A-Z]?[a-z][a-z'-]*|a|I)[,:;.]?")
# A code span that is a command, a path, JSON or a placeholder rather than a message; but
# `--tokenizer X: ...` is a message about a flag's value.
NOT_A_MESSAGE = re.compile(
    r"(?:\$ )?(?:genq|python|pip|make|sudo|curl|redis-cli|sbatch|srun|podman|docker|systemctl|export|"
    r"hf|bash|cd|rq|ssh|git|journalctl|squeue|scancel|kill|ls|cat|apt-get)\b|[-{\[\"$/.<]"
)
FLAG_SAYS = re.compile(r"--[a-z-]+ \S+: ")


class Token(NamedTuple):
    text: str  # as written, a value in it HOLE
    pattern: re.Pattern  # the text, a value in it matching anything
    value: bool  # the token is a value and nothing else
    word: bool  # a word, not punctuation


def _tokens(text: str) -> tuple[Token, ...]:
    return tuple(
        Token(t, re.compile(".*".join(map(re.escape, t.split(HOLE))), re.S), t == HOLE, t not in ",:;.")
        for t in TOKEN.findall(text)
    )


class GenqMessages:
    """Every string literal of genq's code but docstrings (f-strings and %-formats with their
    values as holes), and whether a quote is one of them."""

    def __init__(self) -> None:
        self.messages = [m for m in map(_tokens, self._strings()) if sum(t.word for t in m) >= 2]
        self.by_word: dict[str, list[int]] = {}
        for n, message in enumerate(self.messages):
            for token in message:
                if token.word and not token.value:
                    self.by_word.setdefault(token.text, []).append(n)
        self._said: dict[tuple[str, ...], bool] = {}

    @staticmethod
    def _strings() -> set[str]:
        found: set[str] = set()
        for package in ("genq", *ROLES):
            for path in (ROOT / package).rglob("*.py"):
                tree = ast.parse(path.read_text())
                docstrings = {
                    id(node.body[0].value)
                    for node in ast.walk(tree)
                    if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                    and node.body
                    and isinstance(node.body[0], ast.Expr)
                    and isinstance(node.body[0].value, ast.Constant)
                }
                for node in ast.walk(tree):
                    if isinstance(node, ast.JoinedStr):
                        found.add(
                            "".join(v.value if isinstance(v, ast.Constant) else HOLE for v in node.values)
                        )
                    elif (
                        isinstance(node, ast.Constant)
                        and isinstance(node.value, str)
                        and id(node) not in docstrings
                    ):
                        found.add(PERCENT_OR_BRACES.sub(HOLE, node.value))
        return found

    def said(self, quote: tuple[str, ...]) -> bool:
        """The quote's tokens are a stretch of one message, at least half its words (two at least)
        word for word; a value of the message stands for up to VALUE_WORDS words of the quote, or
        for another message (a cause after ``: ``, a reason before ``; retrying``)."""
        if quote not in self._said:
            self._said[quote] = False  # while it is being read: a message does not hold itself
            words = [w for w in quote if w not in ",:;."]
            need = max(2, (len(words) + 1) // 2)
            candidates = {n for w in words for n in self.by_word.get(w, [])}
            self._said[quote] = any(self._literal_words(quote, self.messages[n]) >= need for n in candidates)
        return self._said[quote]

    def _literal_words(self, quote: tuple[str, ...], message: tuple[Token, ...]) -> int:
        """The most words of ``quote`` a stretch of ``message`` says word for word, two of them
        (or its only one) its own rather than a message in its value (the quote's first token may
        end one of the message's, its last begin one); below 0 if none reads as it."""
        never = -(10**6)
        mine = min(2, sum(t.word and not t.value for t in message))

        @functools.cache
        def best(i: int, j: int, own: int) -> int:
            if i == len(quote):
                return 0 if own >= mine else never
            if j == len(message):
                return never
            token = message[j]
            if token.value:
                options, end, words = [best(i, j + 1, own)], i, 0
                while end < len(quote) and words + (quote[end] not in ",:;.") <= VALUE_WORDS:
                    words += quote[end] not in ",:;."
                    end += 1
                    options.append(best(end, j + 1, own))
                # Another message in the value: to the quote's end, or up to the token after it.
                after = message[j + 1].text if j + 1 < len(message) else None
                for end in range(i + 3, len(quote) + 1):
                    if (end == len(quote) or quote[end] == after) and self.said(quote[i:end]):
                        options.append(sum(w not in ",:;." for w in quote[i:end]) + best(end, j + 1, own))
                return max(options)
            here = quote[i]
            fits = token.pattern.fullmatch(here) or (
                (i == 0 and token.text.endswith(here))
                or (i == len(quote) - 1 and token.text.startswith(here))
            )
            return (token.word + best(i + 1, j + 1, min(2, own + token.word))) if fits else never

        return max((best(0, j, 0) for j in range(len(message))), default=never)


# A fenced block, closed by a fence as long as its opening one (a card's ``` block sits in a ````).
FENCED = re.compile(r"^(`{3,})(\w*)[^\n]*\n(.*?)^\1[ \t]*$", flags=re.M | re.S)


def _quoted_prose() -> list[tuple[str, tuple[str, ...], str]]:
    """Runs of three or more prose words inside the docs' code spans that read as messages, as
    tokens."""
    found = []
    for doc in DOCS:
        text = FENCED.sub(lambda m: "\n" * m.group(0).count("\n"), doc.read_text())
        for span in re.finditer(r"(`+)(.+?)\1", text, flags=re.S):
            quoted = " ".join(span.group(2).split()).removeprefix("Error: ")  # click's prefix
            if len(quoted.split()) < 4 or (NOT_A_MESSAGE.match(quoted) and not FLAG_SAYS.match(quoted)):
                continue
            where = f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, span.start()) + 1}"
            run: list[str] = []
            for word in [*quoted.split(), ""]:
                if word and PROSE_WORD.fullmatch(word):
                    run.append(word)
                    continue
                if len(run) >= 3:  # without the punctuation at its end: the message may stop there
                    found.append((where, tuple(TOKEN.findall(" ".join(run).rstrip(",:;."))), quoted))
                run = []
    return found


def test_the_messages_the_docs_quote_are_genqs_words():
    """A message quoted in the docs (in a code span) is one genq's code can print: each run of
    prose words in it is a string of genq's, its values standing for any words — or another
    program's, listed in FOREIGN_MESSAGES."""
    quoted = _quoted_prose()
    assert len(quoted) > 40, "the docs' quoted messages were not found: the pattern is broken"
    messages = GenqMessages()
    wrong = [
        f"{where}: {' '.join(tokens)!r} (in `{text[:100]}`)"
        for where, tokens, text in quoted
        if not any(f in text for f in FOREIGN_MESSAGES) and not messages.said(tokens)
    ]
    assert not wrong, "the docs quote words genq does not say:\n" + "\n".join(wrong)


# -- the commands in the docs' shell blocks ---------------------------------------------------------


def _shell_lines():
    """Each `genq` command line of the docs' ``sh`` blocks (and ``$ genq`` lines of any block), its
    continuation lines joined; lines with a placeholder (…) are the reader's to fill."""
    for doc in DOCS:
        text = doc.read_text()
        for block in FENCED.finditer(text):
            first = text.count("\n", 0, block.start()) + 2
            lang, body = block.group(2), block.group(3)
            for offset, line in enumerate(body.replace("\\\n", " \n").split("\n")):
                line = line.strip().removeprefix("$ ")
                if lang not in ("sh", "bash") and not body.split("\n")[offset].startswith("$ "):
                    continue
                if "…" in line or "..." in line:
                    continue
                yield f"{doc.relative_to(ROOT)}:{first + offset}", line


def _genq_argv(line: str) -> list[str] | None:
    """What follows `genq` on a shell line, up to the end of its command (a pipe, `;`, `&&`)."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    for i, word in enumerate(words):
        if (word == "genq" or word.endswith("/bin/genq")) and i + 1 < len(words):
            rest = words[i + 1 :]
            ends = [k for k, w in enumerate(rest) if w in ("|", "&&", ";", "&", "||")]
            return rest[: ends[0]] if ends else rest
    return None


def _parse(command: click.Command, name: str, args: list[str]) -> None:
    """Parse ``args`` as ``command`` would (its options, their values' types and choices, its
    arguments), without touching files: a click.UsageError or BadParameter when they are wrong."""
    ctx = click.Context(command, info_name=name)
    if isinstance(command, click.Group) and args and not args[0].startswith("-"):
        sub = command.get_command(ctx, args[0])
        if sub is None:
            raise click.UsageError(f"no command {args[0]!r}")
        return _parse(sub, args[0], args[1:])
    values, extra, _ = command.make_parser(ctx).parse_args(list(args))
    if extra:
        raise click.UsageError(f"extra arguments {extra}")
    for param in command.params:
        value = values.get(param.name)
        if value is None or not isinstance(param.type, click.Choice | click.types._NumberParamTypeBase):
            continue
        for one in value if isinstance(value, list | tuple) else [value]:
            param.type.convert(one, param, ctx)


def test_the_docs_genq_commands_parse():
    """Every `genq ...` line of the docs' shell blocks is one genq takes as written: the command
    exists, its options are its own and have their values, numbers are numbers and choices are
    among the choices (README's demo and docs/recipes.md also run, above and in test_run)."""
    commands = _commands()
    checked, wrong = 0, []
    for where, line in _shell_lines():
        argv = _genq_argv(line)
        if not argv:
            continue
        checked += 1
        command = commands.get(argv[0])
        try:
            if command is None:
                raise click.UsageError(f"no command {argv[0]!r}")
            _parse(command, argv[0], argv[1:])
        except click.ClickException as exc:
            wrong.append(f"{where}: genq {' '.join(argv)}: {exc.format_message()}")
    assert checked > 20, "no genq command found in the docs' shell blocks: the pattern is broken"
    assert not wrong, "\n".join(wrong)


# docs/python.md's reference: a heading per public name, its parameters as the code has them.
_API_HEADING = re.compile(r"^### `((?:genq\.)?[A-Za-z_.]+)\((.*)\)`$", re.M)


def _api_documented() -> dict[str, str]:
    return dict(_API_HEADING.findall((ROOT / "docs" / "python.md").read_text()))


def _api_public() -> dict[str, object]:
    """genq's public names, and the public methods of its classes, by the name the docs give."""
    import dataclasses
    import inspect

    import genq

    found: dict[str, object] = {}
    for name in genq.API:
        value = getattr(genq, name)
        if inspect.isclass(value) and issubclass(value, Exception):
            continue  # the errors: documented together, they take a message
        found[f"genq.{name}"] = value
        if inspect.isclass(value) and not dataclasses.is_dataclass(value):
            for method, member in vars(value).items():
                if not method.startswith("_") and callable(member):
                    found[f"{name}.{method}"] = member
    return found


def _params(signature) -> str:
    """A signature as the docs write it: self left out, defaults as repr, * before keyword-only."""
    import inspect

    parts, star = [], False
    for p in signature.parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
            continue
        default = p.default
        if default is inspect.Parameter.empty:
            parts.append(p.name)
        else:
            shown = default if not isinstance(default, tuple | list) else list(default)
            parts.append(f"{p.name}={shown!r}")
    return ", ".join(parts)


def test_the_python_reference_names_every_public_name_with_its_real_signature():
    """docs/python.md has a heading for each public name and method of genq's API, its parameters
    written as the code has them (names, order, defaults), and no heading for a name that is not."""
    import dataclasses
    import inspect

    documented, public = _api_documented(), _api_public()
    assert sorted(set(public) - set(documented)) == [], "public names docs/python.md does not describe"
    assert sorted(set(documented) - set(public)) == [], "docs/python.md describes names genq does not have"
    for name, value in public.items():
        if inspect.isclass(value) and dataclasses.is_dataclass(value):
            shown = ", ".join(_field(f) for f in dataclasses.fields(value))
        else:
            shown = _params(inspect.signature(value))
        said = documented[name]
        assert said == shown, f"{name}: docs/python.md says ({said}), the code ({shown})"


def _field(f) -> str:
    """A dataclass field as the docs write it: its default (or its factory's value) after it."""
    import dataclasses

    if f.default is not dataclasses.MISSING:
        return f"{f.name}={f.default!r}"
    if f.default_factory is not dataclasses.MISSING:
        return f"{f.name}={f.default_factory()!r}"
    return f.name
