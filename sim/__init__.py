"""A simulator of SGLang's native HTTP API.

The real server needs a GPU; tests, demos and load tests run against this one instead. It keeps
SGLang's request rules, response shapes and error texts (see shared FACTS, "SGLang native API"),
answers with a deterministic toy model, can model continuous-batching latency, and injects faults.
"""
