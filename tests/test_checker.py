"""The checker stage's parts that judge one record (checker/): the shapes a checker may answer in,
the built-in checks, and the two ways to run a user's checker — a Python function in processes of
its own, a command per record — bounded when the checker hangs, crashes or answers nonsense."""

from __future__ import annotations

import asyncio
import json
import os
import textwrap

import pytest

from genq.checker import builtin
from genq.checker.runner import CommandChecker, PythonChecker
from genq.checker.verdict import CheckerError, Verdict, verdict_of


def record(content: str, **fields: object) -> dict:
    return {"id": "d-0", "text": content, "content": content, "completion_tokens": 7, "fields": fields}


@pytest.mark.parametrize(
    ("answer", "verdict"),
    [
        (True, Verdict(True)),
        (0.0, Verdict(False, 0.0)),
        (1, Verdict(True, 1.0)),
        ({"score": -1}, Verdict(False, -1.0)),
        ({"accepted": True, "score": 0.2, "reason": "ok"}, Verdict(True, 0.2, "ok")),
    ],
)
def test_a_checker_may_answer_a_bool_a_reward_or_a_mapping(answer, verdict):
    assert verdict_of(answer) == verdict


@pytest.mark.parametrize(
    "answer", [None, "yes", {"reason": "?"}, {"accepted": "yes"}, {"score": float("nan")}, [1]]
)
def test_an_answer_that_is_no_verdict_is_the_checkers_failure_not_a_rejection(answer):
    with pytest.raises(CheckerError):
        verdict_of(answer)


def test_answer_match_compares_the_last_boxed_answer_normalized():
    assert builtin.answer_match(record("so it is \\boxed{ 42 }.", answer="42")).accepted
    assert builtin.answer_match(record("The Answer.", answer="the answer")).accepted
    assert not builtin.answer_match(record("41", answer="42")).accepted
    assert not builtin.answer_match(record("The Answer.", answer="the answer"), exact="true").accepted
    with pytest.raises(CheckerError, match="--keep-field solution"):
        builtin.answer_match(record("42", answer="42"), field="solution")


def test_json_valid_with_a_schema_names_where_the_answer_breaks_it(tmp_path):
    """--check-option schema=FILE: the answer checked against that JSON Schema; the reason says where
    (the path into the answer, or "the value" for the whole)."""
    schema = tmp_path / "answer.schema.json"
    schema.write_text('{"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}')
    assert builtin.json_valid(record('{"a": 1}'), schema=str(schema)).accepted
    wrong_type = builtin.json_valid(record('```json\n{"a": "one"}\n```'), schema=str(schema))
    assert not wrong_type.accepted and wrong_type.reason.startswith("a: "), wrong_type
    missing = builtin.json_valid(record("{}"), schema=str(schema))
    assert not missing.accepted and missing.reason.startswith("the value: "), missing
    assert builtin.json_valid(record("[1]"), schema=str(schema)).accepted is False


def test_regex_json_and_length_checks():
    assert builtin.regex(record("id: 123"), must=r"\d+").accepted
    assert not builtin.regex(record("I cannot help"), must_not="cannot").accepted
    assert builtin.json_valid(record('```json\n{"a": 1}\n```')).accepted
    assert not builtin.json_valid(record("{'a': 1}")).accepted
    assert builtin.length(record("x"), min_tokens="1", max_tokens="7").accepted
    assert not builtin.length(record("x"), min_tokens="8").accepted


CHECKS = textwrap.dedent(
    """
    import os, time

    def third(record, salt="0"):
        accepted = hash((record["id"], salt)) % 3 == 0
        return {"accepted": accepted, "score": float(accepted), "reason": "" if accepted else "unlucky"}

    def slow(record):
        if record["id"].endswith("hang"):
            time.sleep(600)
        return True

    def crash(record):
        if record["id"].endswith("crash"):
            os._exit(3)
        return True

    def wrong(record):
        raise KeyError("answer")

    def whoami(record, salt="0"):
        return {"accepted": True, "score": float(salt), "reason": str(os.getpid())}
    """
)


@pytest.fixture
def checks(tmp_path, monkeypatch):
    (tmp_path / "user_checks.py").write_text(CHECKS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path))  # the identity's digest finds the module here too
    monkeypatch.setenv("PYTHONHASHSEED", "0")


def test_a_python_checker_runs_in_processes_of_its_own_with_its_options(checks):
    async def run(function: str) -> list[Verdict]:
        checker = PythonChecker(f"user_checks:{function}", ["salt=7"], slots=2)
        try:
            return await asyncio.gather(*(checker.check({"id": f"d-{i}"}, 30) for i in range(30)))
        finally:
            await checker.close()

    verdicts = asyncio.run(run("third"))
    accepted = sum(v.accepted for v in verdicts)
    assert 0 < accepted < 30, accepted
    assert all(v.reason == "unlucky" for v in verdicts if not v.accepted)
    # The checker says where it ran and what it was given: its --check-opt, in processes of its own
    # (not this one), as many as the slots at most.
    verdicts = asyncio.run(run("whoami"))
    assert {v.score for v in verdicts} == {7.0}, "the option did not reach the checker"
    pids = {int(v.reason) for v in verdicts}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2, pids


def test_a_checker_that_hangs_or_crashes_fails_that_record_and_the_next_gets_a_new_process(checks):
    async def run() -> None:
        for target, bad in (("user_checks:slow", "d-hang"), ("user_checks:crash", "d-crash")):
            checker = PythonChecker(target, [], slots=1)
            try:
                assert (await checker.check({"id": "d-1"}, 30)).accepted
                with pytest.raises(CheckerError):
                    await checker.check({"id": bad}, 1.0)
                assert (await checker.check({"id": "d-2"}, 30)).accepted
            finally:
                await checker.close()
        checker = PythonChecker("user_checks:wrong", [], slots=1)
        try:
            with pytest.raises(CheckerError, match="KeyError"):
                await checker.check({"id": "d-1"}, 30)
        finally:
            await checker.close()

    asyncio.run(asyncio.wait_for(run(), 120))


def test_a_python_checker_is_identified_by_its_modules_content(checks, tmp_path):
    first = PythonChecker("user_checks:third", [], slots=1).identity
    (tmp_path / "user_checks.py").write_text(CHECKS + "\n# changed\n")
    assert PythonChecker("user_checks:third", [], slots=1).identity != first
    # Its options are part of what judged: they go with the identity.
    with_option = PythonChecker("user_checks:third", ["salt=7"], slots=1).identity
    assert with_option.endswith(" salt=7") and with_option.startswith("user_checks:third sha256:")
    with pytest.raises(CheckerError, match="no module"):
        PythonChecker("no_such_checks:third", [], slots=1)


def test_a_command_checker_reads_the_record_on_stdin_and_answers_json(tmp_path):
    script = tmp_path / "check.sh"
    script.write_text(
        textwrap.dedent(
            """\
            #!/bin/sh
            record=$(cat)
            case "$record" in
              *hang*) sleep 600 ;;
              *crash*) echo "no sandbox" >&2; exit 4 ;;
              *yes*) echo '{"accepted": true, "reason": "said yes"}' ;;
              *) echo '{"accepted": false, "score": 0, "reason": "no yes"}' ;;
            esac
            """
        )
    )
    script.chmod(0o755)
    checker = CommandChecker(f"sh {script}")

    async def run() -> None:
        assert await checker.check(record("yes"), 30) == Verdict(True, None, "said yes")
        assert await checker.check(record("no"), 30) == Verdict(False, 0.0, "no yes")
        with pytest.raises(CheckerError, match="exited 4: no sandbox"):
            await checker.check(record("crash"), 30)
        with pytest.raises(CheckerError, match="within 1 s"):
            await checker.check(record("hang"), 1.0)

    asyncio.run(asyncio.wait_for(run(), 60))
    assert json.loads(json.dumps(Verdict(True, 1.0, "x").to_json())) == {
        "accepted": True,
        "score": 1.0,
        "reason": "x",
    }
