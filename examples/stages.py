"""Generate, judge, keep: a stage of genq judges each answer as it lands (docs/python.md; CI runs it:
tests/test_api.py). On the bundled simulator, whose answers are random words, the "judge" is a
model asked for a verdict like any other; the answers kept are those whose verdict says "right".

    python examples/stages.py [OUT]      # OUT: the run's folder (default: out-stages)
"""

import sys

import genq

out = sys.argv[1] if len(sys.argv) > 1 else "out-stages"
questions = [{"prompt": f"Question {i}: name a prime number above {10 * i}."} for i in range(200)]
JUDGE = "Is this answer right or wrong?\nQuestion: {{ prompt }}\nAnswer: {{ content }}"

with genq.LocalRun(out, simulate=True, backend="vllm") as client:
    client.enqueue(questions, dataset="answers", max_new_tokens=32)
    judged = client.stage("answers", "verdicts", JUDGE, max_new_tokens=8)  # follows answers as they land
    print(f"verdicts: {judged.result().enqueued} judged")  # returns once every answer is judged
    client.wait("verdicts", timeout=600, show=False)
    answers = {record["id"]: record for record in client.results("answers")}
    verdicts = client.results("verdicts")
    kept = [answers[v["parent"]] for v in verdicts if "right" in (v["content"] or "").split()]

print(f"answers: {len(answers)}, kept (judged right): {len(kept)}")
