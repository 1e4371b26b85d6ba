"""The per-step token budget: decodes first, prefills chunked in arrival order, admission within the budget;
long prompts capped per step and yielding to shorter ones."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import TEST_KV_FRACTION
from deployments.config import AppArgs
from engine.block_manager import BlockManager
from engine.detokenizer import IncrementalDetokenizer
from engine.demo.tokenizer import build_tokenizer
from engine.kv_cache import PagedKVCache
from engine.kv_setup import (DEFAULT_LONG_PREFILL, DEFAULT_LONG_PREFILL_CHUNK, DEFAULT_TOKEN_BUDGET, long_prefill_cap,
                              long_prefill_chunk, token_budget)
from engine.live_settings import apply_live_settings
from engine.request import GenerateRequest
from engine.scheduler import Scheduler
from engine.sequence import Sequence

TOKENIZER = build_tokenizer()


def make(budget, num_blocks=64, block_size=4, max_batch=4, cap=None, chunk=None):
    cache = PagedKVCache(1, num_blocks, block_size, 1, 2, device=torch.device("cpu"), dtype=torch.float32,
                         prefix_caching=False)
    blocks = BlockManager(cache, watermark=0)
    return Scheduler(lambda uids: True, lambda uid: False, max_batch, 16, blocks=blocks,
                     max_num_batched_tokens=budget, long_prefill_tokens=cap,
                     long_prefill_chunk_tokens=chunk), blocks


def seq(prompt_len, max_tokens=3):
    ids = [10 + i % 50 for i in range(prompt_len)]
    request = GenerateRequest(token_ids=ids, max_tokens=max_tokens)
    return Sequence(request, None, ids, IncrementalDetokenizer(TOKENIZER, []), lambda item: None)


def step(sched, blocks):
    """What the engine does with a plan: cache the fed tokens; a request whose input ended gets a token."""
    sched.schedule()
    plan = sched.plan_step()
    sched.note_plan(plan)
    for s, n in plan:
        blocks.commit(s, s.num_computed + n)
        if s.num_computed == s.num_tokens:
            s.output_ids.append(7)
            if len(s.output_ids) >= s.request.max_tokens:
                sched.finish(s)
    return plan


def test_decodes_go_first_then_the_shortest_prefills_with_what_is_left():
    sched, blocks = make(budget=8)
    old = seq(3, max_tokens=10)
    sched.add(old)
    assert step(sched, blocks) == [(old, 3)]            # alone: its whole prompt
    long, short, later = seq(20, max_tokens=10), seq(5, max_tokens=10), seq(30)
    for s in (long, short, later):
        sched.add(s)
    # the decode first, then the 5-token prompt before the 20-token one; the 30-token one would get nothing
    assert step(sched, blocks) == [(old, 1), (short, 5), (long, 2)]
    assert list(sched.waiting) == [later]
    assert step(sched, blocks) == [(old, 1), (short, 1), (long, 6)]
    assert step(sched, blocks) == [(old, 1), (short, 1), (long, 6)]
    assert step(sched, blocks) == [(old, 1), (short, 1), (long, 6)] and long.output_ids == [7]
    assert list(sched.waiting) == [later]           # the decodes and long's last 6 took all 8
    assert step(sched, blocks) == [(old, 1), (long, 1), (short, 1), (later, 5)]   # decodes by age
    assert sched.prefill_chunks == 4


def fed_under_short_arrivals(sched, blocks, long, steps: int) -> list[list[int]]:
    """``long`` admitted (one step), then an 8-token prompt arriving before each of ``steps`` steps: the chunks
    each of those steps fed ``long``."""
    sched.add(long)
    step(sched, blocks)
    fed = []
    for _ in range(steps):
        sched.add(seq(8, max_tokens=1))
        fed.append([n for s, n in step(sched, blocks) if s is long])
    return fed


def test_a_long_prefill_is_not_starved_by_a_stream_of_short_ones():
    sched, blocks = make(budget=8, num_blocks=512, max_batch=8)
    sched.max_bypass_steps = 3
    long = seq(40, max_tokens=1)
    fed_long = [bool(n) for n in fed_under_short_arrivals(sched, blocks, long, 12)]  # each short fills the budget
    assert fed_long[:3] == [False] * 3 and fed_long[3]  # left out 3 steps in a row, then it goes first
    assert long.num_computed > 8


def test_without_a_budget_every_running_request_feeds_all_its_tokens():
    sched, blocks = make(budget=None)
    a, b = seq(30), seq(9)
    sched.add(a)
    sched.add(b)
    assert step(sched, blocks) == [(a, 30), (b, 9)]
    assert sched.prefill_chunks == 0


def test_a_budget_below_the_batch_size_is_refused():
    with pytest.raises(ValueError, match="max_num_batched_tokens=3 is below max_batch_size=4"):
        make(budget=3, max_batch=4)
    sched, blocks = make(budget=8, max_batch=4)
    with pytest.raises(ValueError, match="at most max_num_batched_tokens=8"):
        apply_live_settings({"max_batch_size": 9}, config=AppArgs().engine_config(), pool=None, scheduler=sched,
                            kv_blocks=64)
    assert sched.max_batch_size == 4  # the refused setting changed nothing


def test_the_default_budget_is_per_device_and_never_below_the_batch_size():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert token_budget(AppArgs().engine_config(), cpu) == DEFAULT_TOKEN_BUDGET["cpu"]
    assert token_budget(AppArgs().engine_config(), cuda) == DEFAULT_TOKEN_BUDGET["cuda"]
    assert token_budget(AppArgs(max_batch_size=1024).engine_config(), cpu) == 1024
    assert token_budget(AppArgs(max_num_batched_tokens=64).engine_config(), cuda) == 64


@pytest.mark.parametrize("seed", range(6))
def test_random_arrivals_finish_within_the_budget_and_no_decode_waits(seed):
    rng = random.Random(seed)
    budget = rng.choice([4, 6, 11])
    sched, blocks = make(budget=budget, num_blocks=256, max_batch=4)
    seqs = [seq(rng.randint(1, 40), max_tokens=rng.randint(1, 6)) for _ in range(12)]
    pending = list(seqs)
    fed = {id(s): 0 for s in seqs}
    for _ in range(500):
        if pending and rng.random() < 0.4:
            sched.add(pending.pop(0))
        decoding = [s for s in sched.running if s.num_tokens - s.num_computed == 1]
        plan = step(sched, blocks)
        assert sum(n for _, n in plan) <= budget
        fed_now = {id(s) for s, _ in plan}
        assert all(id(s) in fed_now for s in decoding)   # decodes never wait for a prefill
        for s, n in plan:
            fed[id(s)] += n
        if not pending and not len(sched):
            break
    assert not len(sched) and all(len(s.output_ids) == s.request.max_tokens for s in seqs)
    # each prompt was fed once (no preemption here), then one token per output but the last
    assert all(fed[id(s)] == len(s.prompt_ids) + s.request.max_tokens - 1 for s in seqs)


def test_the_profiling_forward_runs_a_full_budget_step_and_the_reserve_leaves_the_kv_budget(demo_assets):
    """The start-up profile feeds ``max_num_batched_tokens`` tokens in one forward (measured on CUDA only); a reserve
    larger than the free memory is a clear error, never a negative budget."""
    from engine.activation_profile import activation_reserve_bytes, profile_forward
    from engine.engine import LoRAEngine
    from engine.kv_cache import kv_budget_bytes

    engine = LoRAEngine(AppArgs(base_model=str(demo_assets.model_dir), max_num_batched_tokens=96,
                                kv_cache_memory_fraction=TEST_KV_FRACTION).engine_config())
    try:
        with engine._step_lock:
            logits = profile_forward(engine.model, engine.pool, engine.context, engine.config, engine.device,
                                     engine.dtype, engine.max_num_batched_tokens)
        assert logits.shape == (1, engine.model.config.vocab_size) and torch.isfinite(logits).all()
        reserve = activation_reserve_bytes(engine.model, engine.pool, engine.context, engine.config, engine.device,
                                           engine.dtype, 96)
        assert (reserve > 0) == (engine.device.type == "cuda")
        assert engine.stats()["max_num_batched_tokens"] == 96
        if engine.device.type == "cuda":
            with pytest.raises(ValueError, match="lower max_num_batched_tokens"):
                kv_budget_bytes(None, device=engine.device, bytes_per_token=1, max_batch_size=1, max_model_len=1,
                                memory_fraction=0.5, reserve_bytes=1 << 50)
    finally:
        engine.shutdown()


# Long prefills: capped at ``long_prefill_tokens`` a step and yielding to shorter prompts' prefills, so a short
# request's first token never waits behind a long chunk in its own step; a starved long prefill still goes.

def test_a_long_prompt_feeds_at_most_the_cap_and_short_prompts_share_the_budget():
    sched, blocks = make(budget=64, num_blocks=512, max_batch=8, cap=16)
    long = seq(100)
    sched.add(long)
    assert step(sched, blocks) == [(long, 16)]                  # alone: a capped chunk, not the whole budget
    shorts = [seq(12), seq(14), seq(10)]
    for s in shorts:
        sched.add(s)
    # the short prompts (none over the cap) are batched whole, fewest tokens first; the long one yields this step
    assert step(sched, blocks) == [(shorts[2], 10), (shorts[0], 12), (shorts[1], 14)]
    assert step(sched, blocks) == [*[(s, 1) for s in shorts], (long, 16)]   # decodes, then its next chunk


def test_a_long_prompt_left_out_max_bypass_steps_goes_with_the_short_ones():
    sched, blocks = make(budget=64, num_blocks=512, max_batch=8, cap=16)
    sched.max_bypass_steps = 2
    long = seq(100, max_tokens=1)
    fed = fed_under_short_arrivals(sched, blocks, long, 4)
    assert fed[:2] == [[], []] and fed[2] == [16]              # starved twice, then first, still capped


def test_without_a_cap_nothing_is_long():
    sched, blocks = make(budget=64, num_blocks=512, max_batch=8)
    long, short = seq(100), seq(10)
    sched.add(long)
    sched.add(short)
    assert step(sched, blocks) == [(short, 10), (long, 54)]


def test_the_cap_defaults_per_device_only_with_the_default_budget():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert long_prefill_cap(AppArgs().engine_config(), cpu) == DEFAULT_LONG_PREFILL["cpu"] == 128
    assert long_prefill_cap(AppArgs().engine_config(), cuda) is None
    assert long_prefill_cap(AppArgs(max_num_batched_tokens=4096).engine_config(), cpu) is None
    assert long_prefill_cap(AppArgs(max_num_batched_tokens=4096, long_prefill_tokens=512).engine_config(), cpu) == 512


def test_the_chunk_defaults_smaller_than_the_threshold_only_with_both_defaults_on_the_cpu():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert long_prefill_chunk(AppArgs().engine_config(), cpu) == DEFAULT_LONG_PREFILL_CHUNK["cpu"] == 64
    assert long_prefill_chunk(AppArgs().engine_config(), cuda) is None
    assert long_prefill_chunk(AppArgs(long_prefill_tokens=256).engine_config(), cpu) == 256
    assert long_prefill_chunk(AppArgs(max_num_batched_tokens=4096).engine_config(), cpu) is None
    assert long_prefill_chunk(AppArgs(long_prefill_chunk_tokens=32).engine_config(), cpu) == 32


def test_a_long_prompt_feeds_chunks_while_a_prompt_under_the_threshold_batches_whole():
    """Long above ``long_prefill_tokens`` (here 32), fed ``long_prefill_chunk_tokens`` (16) a step: a 30-token
    prompt is not long, so it feeds whole beside another short one; the 200-token one feeds 16 alone."""
    sched, blocks = make(budget=128, num_blocks=512, max_batch=8, cap=32, chunk=16)
    long, mid, short = seq(200), seq(30), seq(10)
    for s in (long, mid, short):
        sched.add(s)
    assert step(sched, blocks) == [(short, 10), (mid, 30)]  # the long one yields to the step's prefills
    assert step(sched, blocks) == [(mid, 1), (short, 1), (long, 16)]  # decodes by age, then one chunk
    assert step(sched, blocks) == [(mid, 1), (short, 1), (long, 16)]
    assert step(sched, blocks) == [(long, 16)]  # the short ones finished (3 tokens)


def test_a_chunk_below_one_token_is_refused():
    with pytest.raises(ValueError, match="long_prefill_chunk_tokens"):
        make(budget=64, cap=32, chunk=0)


def test_a_waiting_long_prompt_does_not_hold_back_the_short_ones_behind_it():
    sched, blocks = make(budget=64, num_blocks=512, max_batch=8, cap=16)
    first, second, short = seq(200), seq(200), seq(10)
    sched.add(first)
    step(sched, blocks)
    sched.add(second)                  # would get no token while the first one prefills...
    sched.add(short)                   # ...so the short prompt behind it starts now
    assert step(sched, blocks) == [(short, 10)]
    assert list(sched.waiting) == [second]


def test_a_long_prompts_chunk_shrinks_with_its_cached_context_and_its_tail_stays_chunked():
    """With a ``context_span`` (here 64) a long prompt's chunk is ``chunk / (1 + cached / span)``: 16 tokens at no
    context, 8 after 64 cached. Its last ~30 tokens, under the threshold (32) as tokens, still count their attention
    (30 x 3 > 32): they stay chunked and yield to a short prompt's prefill, instead of one step of twice a chunk."""
    sched, blocks = make(budget=128, num_blocks=512, max_batch=8, cap=32, chunk=16)
    sched.context_span = 64
    long = seq(158)
    sched.add(long)
    while long.num_computed < 128:
        cached = long.num_computed
        assert step(sched, blocks) == [(long, int(16 / (1 + cached / 64)))]
        assert sched.last_chunk_tokens == int(16 / (1 + cached / 64))
    cached = long.num_computed
    assert 158 - cached <= 32  # no longer long by its tokens alone
    short = seq(10)
    sched.add(short)
    assert step(sched, blocks) == [(short, 10)]  # long by its cost: it yields
    assert step(sched, blocks) == [(short, 1), (long, int(16 / (1 + cached / 64)))]


def test_without_a_context_span_the_chunk_is_a_token_count():
    sched, blocks = make(budget=128, num_blocks=512, max_batch=8, cap=32, chunk=16)
    long = seq(100)
    sched.add(long)
    assert [step(sched, blocks)[0][1] for _ in range(5)] == [16, 16, 16, 16, 16]
    assert step(sched, blocks) == [(long, 20)]  # 20 left: not long any more, fed whole


def test_the_context_span_applies_on_the_cpu_with_every_prefill_default_only():
    from engine.kv_setup import CPU_ATTENTION_COST_FACTOR, context_span
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                         num_key_value_heads=2, num_hidden_layers=1))
    cpu = torch.device("cpu")
    weights = 64 * (64 + 32 + 32 + 64) + 3 * 64 * 128  # q k v o, gate up down
    assert context_span(model, AppArgs().engine_config(), cpu) == int(weights / (2 * 64) / CPU_ATTENTION_COST_FACTOR)
    assert context_span(model, AppArgs().engine_config(), torch.device("cuda")) is None
    for changed in ({"long_prefill_chunk_tokens": 64}, {"long_prefill_tokens": 128}, {"max_num_batched_tokens": 512}):
        assert context_span(model, AppArgs(**changed).engine_config(), cpu) is None
