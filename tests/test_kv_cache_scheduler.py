"""Scheduling by free KV blocks: admission, preemption of the newest, FIFO order, prefix reuse, no deadlock.

Real ``Sequence``s, ``BlockManager`` and ``PagedKVCache``; the model's forward is replaced by
what the engine does around it (commit the fed tokens, append one token), so thousands of
steps run in a second.
"""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.demo import build_tokenizer
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import PagedKVCache
from engine.request import GenerateRequest
from engine.scheduler import Scheduler
from engine.sequence import Sequence

TOKENIZER = build_tokenizer()


def make(num_blocks=8, block_size=4, max_batch=16, prefix_caching=True, watermark=1):
    cache = PagedKVCache(1, num_blocks, block_size, 1, 2, device=torch.device("cpu"), dtype=torch.float32,
                         prefix_caching=prefix_caching)
    blocks = BlockManager(cache, watermark)
    return Scheduler(lambda uids: True, lambda uid: False, max_batch, 16, blocks=blocks), blocks


def seq(prompt_len, max_tokens=4, uid=None, prompt=None):
    ids = prompt if prompt is not None else [10 + i % 50 for i in range(prompt_len)]
    request = GenerateRequest(adapter=uid, token_ids=ids, max_tokens=max_tokens)
    return Sequence(request, uid, ids, IncrementalDetokenizer(TOKENIZER, []), lambda item: None)


def fake_step(sched, blocks):
    """What the engine does around a forward: every running sequence's fed tokens are cached, one token
    is appended; finished ones leave. Returns the finished sequences."""
    done = []
    for s in list(sched.running):
        assert len(s.block_table) * blocks.block_size >= s.num_tokens  # room for the whole next input
        blocks.commit(s, s.num_tokens)
        s.output_ids.append(7)
        if len(s.output_ids) >= s.request.max_tokens:
            sched.finish(s)
            done.append(s)
    return done


def check_invariants(sched, blocks):
    alloc = blocks.allocator
    held = [b for s in sched.running for b in s.block_table]
    for b in set(held):
        assert alloc.refs(b) == held.count(b)
    assert alloc.num_used == len(set(held))
    assert all(not s.block_table for s in sched.waiting)


def test_admission_is_by_free_blocks_not_by_count():
    sched, blocks = make(num_blocks=8, block_size=4)
    short = [seq(3) for _ in range(6)]  # one block each
    for s in short:
        sched.add(s)
    admitted, _ = sched.schedule()
    # six one-block requests fit in 8 blocks with the 1-block watermark kept free for growth
    assert admitted == short and blocks.allocator.num_used == 6


def test_a_request_waiting_for_blocks_is_not_overtaken():
    sched, blocks = make(num_blocks=8, block_size=4)
    first = seq(16)           # 4 blocks
    big = seq(20)             # 5 blocks: does not fit beside the first
    small = seq(2)            # would fit
    for s in (first, big, small):
        sched.add(s)
    admitted, _ = sched.schedule()
    assert admitted == [first] and list(sched.waiting) == [big, small]


def test_default_watermark_is_one_percent_of_the_blocks_rounded_down():
    assert make(num_blocks=8, watermark=None)[1].watermark == 0     # e.g. one 2048-token row per request
    assert make(num_blocks=250, watermark=None)[1].watermark == 2


def test_nothing_running_admits_up_to_every_block():
    sched, blocks = make(num_blocks=4, block_size=4)
    whole = seq(16, max_tokens=1)
    sched.add(whole)
    admitted, _ = sched.schedule()
    assert admitted == [whole] and blocks.num_free() == 0  # no watermark when it runs alone


def test_growth_preempts_the_newest_and_requeues_it_before_later_arrivals():
    sched, blocks = make(num_blocks=6, block_size=4)   # 24 tokens: each request fits alone, as the engine ensures
    a, b = seq(8, max_tokens=14), seq(7, max_tokens=14)
    for s in (a, b):
        sched.add(s)
    assert sched.schedule() == ([a, b], [])           # 2 + 2 blocks
    c, later = seq(4, max_tokens=14), seq(2, max_tokens=14)
    fake_step(sched, blocks)                          # a: 9 tokens, b: 8
    sched.add(c)
    assert sched.schedule() == ([], [])               # a took a 3rd block; c would eat the watermark
    sched.add(later)
    preempted = []
    while not preempted:
        fake_step(sched, blocks)
        _, preempted = sched.schedule()
        check_invariants(sched, blocks)
    # a needed a 4th block with none free: b, the newest running request, gave its blocks back
    assert preempted == [b] and sched.running == [a] and len(a.block_table) == 4
    assert list(sched.waiting) == [b, c, later]       # arrival order: b first
    assert sched.preemptions == 1 and not b.block_table and b.num_computed == 0
    tokens, start = b.next_input()
    assert start == 0 and tokens == b.prompt_ids + b.output_ids  # recomputed from the start
    finished = []
    for _ in range(200):                              # everything still finishes, b before c
        finished += fake_step(sched, blocks)
        sched.schedule()
        check_invariants(sched, blocks)
        if not len(sched):
            break
    assert set(finished) == {a, b, c, later} and blocks.allocator.num_used == 0
    assert finished.index(b) < finished.index(c)


def test_same_uid_and_prefix_share_blocks_other_uids_do_not():
    sched, blocks = make(num_blocks=16, block_size=4)
    prompt = list(range(20, 31))  # 11 tokens: 2 full blocks may be shared (never the last token's)
    first = seq(0, uid="a@1", prompt=prompt)
    sched.add(first)
    sched.schedule()
    blocks.commit(first, first.num_tokens)
    same = seq(0, uid="a@1", prompt=prompt)
    renamed = seq(0, uid="a@2", prompt=prompt)   # same name re-registered: a new uid
    base = seq(0, uid=None, prompt=prompt)
    assert blocks.admission_cost(same) == 1       # 3 blocks, 2 of them shared
    assert blocks.admission_cost(renamed) == 3 and blocks.admission_cost(base) == 3
    for s in (same, renamed, base):
        sched.add(s)
    sched.schedule()
    assert same.block_table[:2] == first.block_table[:2] and same.num_computed == 8
    assert not set(renamed.block_table) & set(first.block_table)
    assert not set(base.block_table) & set(first.block_table)
    tokens, start = same.next_input()
    assert start == 8 and tokens == prompt[8:]
    check_invariants(sched, blocks)


def test_a_finished_requests_blocks_serve_the_next_one_with_that_prefix():
    sched, blocks = make(num_blocks=8, block_size=4)
    prompt = list(range(40, 49))
    first = seq(0, uid="a@1", prompt=prompt, max_tokens=1)
    sched.add(first)
    sched.schedule()
    fake_step(sched, blocks)   # finishes: its 2 full blocks stay cached
    assert blocks.allocator.num_used == 0 and blocks.allocator.cached_blocks() == 2
    again = seq(0, uid="a@1", prompt=prompt)
    sched.add(again)
    sched.schedule()
    assert again.num_computed == 8 and blocks.allocator.prefix_hits == 2


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 20), st.sampled_from([None, "a@1", "b@1"])),
                min_size=1, max_size=25),
       st.integers(8, 24), st.sampled_from([1, 4, 8]), st.booleans(), st.integers(0, 1000))
def test_every_request_finishes_and_blocks_stay_consistent(shapes, num_blocks, block_size, prefix, seed):
    """Random lengths under a tight cache: progress every step, never a deadlock, nothing leaked."""
    sched, blocks = make(num_blocks=num_blocks, block_size=block_size, max_batch=8, prefix_caching=prefix)
    capacity = num_blocks * block_size
    rng = random.Random(seed)
    pending = []
    for prompt_len, max_tokens, uid in shapes:
        prompt_len = min(prompt_len, capacity - 1)
        max_tokens = max(1, min(max_tokens, capacity - prompt_len))  # the engine refuses longer ones
        prompt = [rng.randrange(3) for _ in range(prompt_len)]      # few distinct tokens: prefixes repeat
        pending.append(seq(0, max_tokens=max_tokens, uid=uid, prompt=prompt))
    finished = []
    steps = 0
    while pending or len(sched):
        if pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        sched.schedule()
        check_invariants(sched, blocks)
        if not sched.running:
            assert not sched.waiting or pending, "nothing runs while requests wait: a deadlock"
        finished += fake_step(sched, blocks)
        steps += 1
        assert steps < 5000
    assert len(finished) == len(shapes)
    assert all(len(s.output_ids) == s.request.max_tokens for s in finished)
    assert blocks.allocator.num_used == 0
