"""The steering of ``--concurrency auto`` (worker/concurrency.py), one reading of the server's load
at a time: where the answer follows from the reading alone, it is asserted here, exactly; how the
target moves against a live server is tests/test_concurrency.py's."""

from __future__ import annotations

from genq.backends.load import Load
from genq.worker.concurrency import FLOOR, SHRINK_QUEUE, START, Concurrency


def auto(ceiling: int = 1024) -> Concurrency:
    return Concurrency(START, FLOOR, ceiling, auto=True, reason="start")


def test_free_slots_of_a_server_without_a_published_cache_size_fill_at_once():
    """llama.cpp publishes its slots and no KV size (a slot's cache is its own): a 15-second run
    must not spend its first ten seconds growing ×1.25 a second towards 512 slots."""
    c = auto()
    load = Load("/slots", running=START, waiting=None, max_running=512)
    assert c.steer(load, busy=START)
    assert c.target == 512, c.reason
    assert "slow start" in c.reason


def test_a_known_cache_size_still_bounds_the_slow_start():
    """With the KV size known, free slots are filled only as far as the longest jobs fit."""
    c = auto()
    for _ in range(16):
        c.answered(1.0, output_tokens=100, prompt_tokens=100, max_new_tokens=400, started=False)
    load = Load("/v1/loads", running=START, waiting=0, kv_usage=0.1, max_running=512, kv_tokens=20_000)
    c.steer(load, busy=START)
    assert c.target == int(0.90 * 20_000 / 500), c.reason  # KV_TARGET of the cache, jobs at 500 tokens


def test_jobs_whose_prompt_length_is_known_bound_the_slow_start_before_any_answer():
    """Token-id prompts say their size as they start: the first steer (a quarter of a second in)
    fills the batch as far as they fit, without waiting for answers."""
    c = auto()
    for _ in range(START):
        c.started(prompt_tokens=100, max_new_tokens=400)
    load = Load("/v1/loads", running=START, waiting=0, kv_usage=0.1, max_running=512, kv_tokens=20_000)
    c.steer(load, busy=START)
    assert c.target == int(0.90 * 20_000 / 500), c.reason


def test_a_queue_behind_busy_slots_is_given_back_by_this_workers_share():
    """SGLang with 8 running requests at most: every one of this worker's jobs beyond the slots and
    the few that refill them waits in the server's queue, adding latency and no tokens."""
    c = Concurrency(16, FLOOR, 1024, auto=True)
    c.steer(Load("/v1/loads", running=8, waiting=8, max_running=8), busy=16)
    assert c.target == 10, c.reason  # the 8 slots and 2 to refill those that free
    assert "waiting for 8 busy slots" in c.reason


def test_two_workers_each_give_back_their_own_share():
    c = Concurrency(32, FLOOR, 1024, auto=True)
    c.steer(Load("/v1/loads", running=32, waiting=32, max_running=32), busy=32)
    assert c.target == 32 - 15, c.reason  # half of the 30 in excess: the other worker's is its own


def test_a_server_that_hides_its_queue_is_sent_no_more_than_its_slots():
    """llama.cpp without /metrics: all 4 slots busy and 32 of this worker's jobs in flight."""
    c = auto()
    c.steer(Load("/slots", running=4, waiting=None, max_running=4), busy=START)
    assert c.target == FLOOR, c.reason  # 4 slots + 2, never under the floor
    assert "in flight for 4 busy slots" in c.reason


def test_busy_slots_and_a_small_queue_hold_the_target():
    """Every slot busy and just enough waiting to refill them: growing would only queue."""
    c = Concurrency(66, FLOOR, 1024, auto=True)
    assert not c.steer(Load("/v1/loads", running=64, waiting=2, max_running=64), busy=66)
    assert c.target == 66


def test_the_slots_of_a_server_that_does_not_publish_them_are_learned_from_its_queue():
    """vLLM publishes no --max-num-seqs: requests waiting while its KV cache has room wait for a
    slot, so the running count is the slots, and the queue beyond what refills them is given back."""
    c = Concurrency(128, FLOOR, 1024, auto=True)
    c.steer(Load("/metrics", running=64, waiting=64, kv_usage=0.2, kv_tokens=400_000), busy=128)
    assert c.target == 64 + 4, c.reason  # its 64 slots and 4 to refill those that free
    assert "waiting for 64 busy slots" in c.reason


def test_a_queue_behind_a_full_kv_cache_teaches_no_slots():
    """Requests waiting for KV cache, not for a slot: the running count says nothing of the slots."""
    c = Concurrency(128, FLOOR, 1024, auto=True)
    c.steer(Load("/metrics", running=64, waiting=64, kv_usage=0.95, kv_tokens=400_000), busy=128)
    # The queue shrinks the target by its factor; had 64 slots been learned from it, the target
    # would be those slots and the 4 that refill them (68), as in the test above.
    assert c.target == int(128 * SHRINK_QUEUE) != 64 + 4, c.reason


def test_slots_seen_idle_while_this_workers_jobs_are_on_their_way_lengthen_the_queue():
    """A fast step and a busy client (SGLang held to 8 running on the CPU): slots free faster than
    answers come back and new requests arrive, so a queue of 2 leaves them idle; the queue allowed
    behind busy slots grows with each idle reading, never past the slots."""
    c = Concurrency(10, FLOOR, 1024, auto=True)
    c.steer(Load("/v1/loads", running=6, waiting=0, max_running=8), busy=10)
    held = c.target
    assert not c.steer(Load("/v1/loads", running=8, waiting=4, max_running=8), busy=held)  # 4 waiting: kept
    for _ in range(5):
        c.steer(Load("/v1/loads", running=7, waiting=0, max_running=8), busy=c.target)
    before = c.target
    c.steer(Load("/v1/loads", running=8, waiting=12, max_running=8), busy=20)  # all at the server
    assert c.target == before - 4, c.reason  # a queue of 8 at most, the slots' number
