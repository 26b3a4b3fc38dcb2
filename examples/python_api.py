"""genq from Python, as a notebook or a script uses it (docs/python.md; CI runs it: tests/test_api.py).

A `datasets.Dataset` of questions is enqueued on a local run (private Redis, the bundled simulator
of vLLM's API, two workers, the collector), waited on with a progress bar, and read back as a
`datasets.Dataset`. Run it again: the run resumes and nothing is generated twice.

    python examples/python_api.py [OUT]      # OUT: the run's folder (default: out-python)
"""

import sys

import datasets

import genq

out = sys.argv[1] if len(sys.argv) > 1 else "out-python"
questions = datasets.Dataset.from_list(
    [{"prompt": f"Question {i}: what is {i} times {i + 1}?", "answer": i * (i + 1)} for i in range(500)]
)

with genq.LocalRun(out, simulate=True, backend="vllm") as client:
    enqueued = client.enqueue(questions, dataset="squares", max_new_tokens=32, keep_fields=("answer",))
    print(f"squares: {enqueued.enqueued} enqueued, {enqueued.skipped} already queued or done")
    client.wait("squares", timeout=600)
    results = client.results("squares").to_dataset()

print(f"squares: {results.num_rows} records; the first: {results[0]['text']!r}")
