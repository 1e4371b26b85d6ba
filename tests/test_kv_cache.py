"""The paged KV cache's parts: block allocator, prefix digests, budget sizing, attention through block tables."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from engine.attention import TorchPagedAttention, choose_backend, make_attention
from engine.attention_layout import StepLayout
from engine.block_allocator import BlockAllocator, KVBlockRefError, KVCacheFullError, block_digest
from engine.kv_cache import PagedKVCache, kv_budget_bytes, kv_bytes_per_token


def test_allocate_and_free_count_blocks_and_refuse_when_empty():
    a = BlockAllocator(3, 4)
    blocks = [a.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2] and a.num_free == 0 and a.num_used == 3
    with pytest.raises(KVCacheFullError):
        a.allocate()
    a.free([blocks[1]])
    assert a.num_free == 1 and a.allocate() == blocks[1]
    with pytest.raises(KVBlockRefError):
        a.free([blocks[0], blocks[0]])  # freed more often than taken: a refcount bug, not a full cache
    with pytest.raises(KVBlockRefError):
        a.share(blocks[0])  # nobody holds it any more


def test_blocks_for_rounds_up():
    a = BlockAllocator(4, 16)
    assert [a.blocks_for(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_a_registered_block_outlives_its_holder_until_space_is_needed():
    a = BlockAllocator(2, 4)
    d = block_digest(None, "x@1", [1, 2, 3, 4])
    b = a.allocate()
    a.register(b, d)
    a.free([b])
    assert a.num_free == 2 and a.cached_blocks() == 1       # cached, yet counted as free
    assert a.lookup(d) == b and a.refs(b) == 1 and a.prefix_hits == 1
    a.free([b])
    other = a.allocate()                                     # never-used blocks go first
    assert other != b and a.peek(d) == b
    a.allocate()                                             # now the cached one is taken over
    assert a.peek(d) is None and a.evictions == 1


def test_least_recently_freed_cached_block_is_evicted_first():
    a = BlockAllocator(3, 1)
    digests = [block_digest(None, None, [t]) for t in range(3)]
    blocks = [a.allocate() for _ in range(3)]
    for b, d in zip(blocks, digests):
        a.register(b, d)
    a.free([blocks[2]])
    a.free([blocks[0]])
    a.free([blocks[1]])
    assert a.allocate() == blocks[2]
    assert a.peek(digests[2]) is None and a.peek(digests[0]) == blocks[0]


def test_shared_block_is_freed_by_its_last_holder_only():
    a = BlockAllocator(2, 2)
    d = block_digest(None, None, [5, 6])
    b = a.allocate()
    a.register(b, d)
    assert a.lookup(d) == b and a.refs(b) == 2
    a.free([b])
    assert a.num_free == 1
    a.free([b])
    assert a.num_free == 2


def test_digest_depends_on_uid_tokens_and_parent():
    base = block_digest(None, None, [1, 2])
    assert base == block_digest(None, None, [1, 2])
    assert base != block_digest(None, "", [1, 2])            # the base model is not an adapter named ""
    assert base != block_digest(None, "a@1", [1, 2])
    assert block_digest(None, "a@1", [1, 2]) != block_digest(None, "a@2", [1, 2])  # re-registered: new uid
    assert base != block_digest(None, None, [2, 1])
    assert block_digest(base, None, [3]) != block_digest(None, None, [3])


def test_prefix_caching_off_never_shares():
    a = BlockAllocator(2, 2, prefix_caching=False)
    d = block_digest(None, None, [1, 2])
    b = a.allocate()
    a.register(b, d)
    assert a.lookup(d) is None and a.peek(d) is None
    a.free([b])
    assert a.cached_blocks() == 0


def test_budget_sizing():
    per_token = kv_bytes_per_token(4, 8, 64, torch.float32)
    assert per_token == 2 * 4 * 8 * 64 * 4
    cache = PagedKVCache.from_budget(10 * 16 * per_token + 5, 4, 16, 8, 64, device=torch.device("cpu"),
                                     dtype=torch.float32)
    assert cache.num_blocks == 10 and cache.capacity_tokens == 160 and cache.total_bytes == 10 * 16 * per_token
    assert tuple(cache.k.shape) == (4, 8, 10, 16, 64)  # head_major: [layers, kv_heads, blocks, ...]
    with pytest.raises(ValueError, match="holds no block"):
        PagedKVCache.from_budget(16 * per_token - 1, 4, 16, 8, 64, device=torch.device("cpu"), dtype=torch.float32)
    cpu = torch.device("cpu")
    assert kv_budget_bytes(12345, device=cpu, bytes_per_token=10, max_batch_size=2, max_model_len=8,
                           memory_fraction=0.8) == 12345
    assert kv_budget_bytes(None, device=cpu, bytes_per_token=10, max_batch_size=2, max_model_len=8,
                           memory_fraction=0.8) == 160  # what the contiguous rows took
    with pytest.raises(ValueError, match="less than one token"):
        kv_budget_bytes(5, device=cpu, bytes_per_token=10, max_batch_size=2, max_model_len=8, memory_fraction=0.8)


def test_layout_maps_positions_through_block_tables():
    layout = StepLayout([[5, 3, 0], [2]], [14, 0], [4, 2], block_size=8, device=torch.device("cpu"))
    # sequence 0: positions 14..17 -> block 3 offsets 6, 7, then block 0 offsets 0, 1; sequence 1: block 2
    assert layout.slots.tolist() == [3 * 8 + 6, 3 * 8 + 7, 0, 1, 16, 17]
    assert layout.positions.tolist() == [14, 15, 16, 17, 0, 1]
    assert layout.prefill_seqs == [0, 1] and layout.decode is None
    with pytest.raises(ValueError, match="cannot hold"):
        StepLayout([[1]], [7], [2], block_size=8, device=torch.device("cpu"))


def test_a_layout_for_flashinfer_builds_no_decode_gathers():
    """FlashInfer reads the block tables itself: the decode rows' gather indices are not built, the write places
    and positions are the same."""
    tables, starts, counts = [[5, 3, 0], [2], [7]], [17, 3, 0], [1, 1, 2]
    cpu = torch.device("cpu")
    full = StepLayout(tables, starts, counts, block_size=8, device=cpu)
    lean = StepLayout(tables, starts, counts, block_size=8, device=cpu, decode_gathers=False)
    assert len(full.decode_groups) == 1 and lean.decode_groups == [] and lean.decode is None
    assert lean.decode_seqs == full.decode_seqs == [0, 1] and lean.prefill_seqs == [2]
    for name in ("write_blocks", "write_offsets", "positions"):
        assert torch.equal(getattr(lean, name), getattr(full, name))


def _reference_attention(q, keys, values, qpos, window, scale, group):
    """Dense attention of queries at positions ``qpos`` over keys 0..len-1 (causal, optional window)."""
    kpos = torch.arange(keys.shape[0])
    mask = kpos[None, :] <= qpos[:, None]
    if window:
        mask &= kpos[None, :] > qpos[:, None] - window
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask[None], scale=scale)
    return out.transpose(0, 1).reshape(q.shape[0], -1)


@pytest.mark.parametrize("layout", ["head_major", "page_major"])
@pytest.mark.parametrize("window", [None, 5])
def test_paged_attention_matches_dense_attention(window, layout):
    """Decode rows, a fresh prefill and a prefill continuing a cached prefix, on scattered blocks."""
    torch.manual_seed(0)
    rng = random.Random(0)
    H, KV, hd, bs = 4, 2, 8, 4
    cache = PagedKVCache(1, 32, bs, KV, hd, device=torch.device("cpu"), dtype=torch.float32, layout=layout)
    free = list(range(32))
    rng.shuffle(free)
    # (tokens already cached, new tokens): two decodes, a fresh prefill, a prefill after a cached prefix
    shapes = [(9, 1), (2, 1), (0, 7), (8, 5)]
    contexts = [torch.randn(c + n, KV, hd) for c, n in shapes]
    vcontexts = [torch.randn(c + n, KV, hd) for c, n in shapes]
    tables = [[free.pop() for _ in range(-(-(c + n) // bs))] for c, n in shapes]
    for (c, _), table, kctx, vctx in zip(shapes, tables, contexts, vcontexts):
        if c:
            pre = StepLayout([table], [0], [c], bs, torch.device("cpu"))
            cache.write(0, pre.write_blocks, pre.write_offsets, kctx[:c], vctx[:c])
    layout = StepLayout(tables, [c for c, _ in shapes], [n for _, n in shapes], bs, torch.device("cpu"))
    k_new = torch.cat([k[c:] for (c, _), k in zip(shapes, contexts)])
    v_new = torch.cat([v[c:] for (c, _), v in zip(shapes, vcontexts)])
    q = torch.randn(layout.num_tokens, H, hd)
    cache.write(0, layout.write_blocks, layout.write_offsets, k_new, v_new)
    attention = TorchPagedAttention(cache, H, KV, hd)  # reads either layout through cache.gather_rows
    attention.begin_step(layout, [window], 0.3)
    out = attention(0, q, k_new, v_new, layout, window, 0.3)
    for i, (c, n) in enumerate(shapes):
        off = layout.token_offsets[i]
        expected = _reference_attention(q[off:off + n], contexts[i], vcontexts[i], torch.arange(c, c + n), window,
                                        0.3, H // KV)
        assert (out[off:off + n] - expected).abs().max().item() < 1e-5, shapes[i]


@pytest.mark.parametrize("layout", ["head_major", "page_major"])
@pytest.mark.parametrize("lengths", [[13, 13, 13], [13, 6, 9]])
@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize("values_in_place", [True, False])
@pytest.mark.parametrize("sparse_scores", [False, True])
@pytest.mark.parametrize("window", [None, 7])
def test_decode_rows_read_only_their_positions(layout, lengths, consecutive, values_in_place, sparse_scores, window):
    """A decode-only step (one gather group) over rows of equal or different lengths, on blocks handed out in
    order or scattered, K gathered or read in place (``sampled_addmm``), V weighted in place (``embedding_bag``)
    or gathered: equal to dense attention, and a second layer of the step (reusing the gather's buffer, the
    scores' pattern) too."""
    torch.manual_seed(1)
    H, KV, hd, bs, layers = 6, 3, 8, 4, 2
    cache = PagedKVCache(layers, 24, bs, KV, hd, device=torch.device("cpu"), dtype=torch.float32, layout=layout)
    free = list(range(24))
    if not consecutive:
        random.Random(1).shuffle(free)
    tables = [[free.pop(0) for _ in range(-(-n // bs))] for n in lengths]
    keys = [[torch.randn(n, KV, hd) for n in lengths] for _ in range(layers)]
    values = [[torch.randn(n, KV, hd) for n in lengths] for _ in range(layers)]
    for li in range(layers):
        for table, k, v in zip(tables, keys[li], values[li]):
            pre = StepLayout([table], [0], [k.shape[0]], bs, torch.device("cpu"))
            cache.write(li, pre.write_blocks, pre.write_offsets, k, v)
    step = StepLayout(tables, [n - 1 for n in lengths], [1] * len(lengths), bs, torch.device("cpu"))
    assert len(step.decode_groups) == 1 and step.decode.span == max(lengths)
    attention = TorchPagedAttention(cache, H, KV, hd, sparse_scores=sparse_scores)
    attention.values_in_place = values_in_place
    attention.begin_step(step, [window], 0.3)
    for li in range(layers):
        q = torch.randn(len(lengths), H, hd)
        out = attention(li, q, None, None, step, window, 0.3)
        for i, n in enumerate(lengths):
            expected = _reference_attention(q[i:i + 1], keys[li][i], values[li][i], torch.tensor([n - 1]), window,
                                            0.3, H // KV)
            assert (out[i:i + 1] - expected).abs().max().item() < 1e-5, (li, i)


def test_sparse_scores_check_passes_and_is_measured_on_the_cpu_in_float32_only():
    from engine.attention import sparse_scores_unsupported
    from engine.check_attention import sparse_scores_error

    assert sparse_scores_error(torch.device("cpu"), torch.float32, 6, 2, 16, [None, 9], 0.25, seed=0) < 1e-5
    assert sparse_scores_unsupported(torch.device("cpu"), torch.float32) is None
    assert "float32 only" in sparse_scores_unsupported(torch.device("cpu"), torch.bfloat16)
    assert "CPU only" in sparse_scores_unsupported(torch.device("cuda"), torch.float32)


def test_backend_choice_and_the_layout_it_reads():
    cpu = torch.device("cpu")
    assert choose_backend(cpu, torch.float32) == "torch"
    assert choose_backend(cpu, torch.bfloat16) == "torch"      # flashinfer is CUDA only
    with pytest.raises(ValueError, match="unknown attention backend"):
        choose_backend(cpu, torch.float32, "triton")
    cuda = torch.device("cuda")  # only compared, never allocated on
    # FlashInfer refuses head sizes below 64 (the demo model's is 16) and fp32: auto takes torch, logged once
    assert choose_backend(cuda, torch.bfloat16, head_dim=16) == "torch"
    assert choose_backend(cuda, torch.float32, head_dim=128) == "torch"
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            choose_backend(cpu, torch.float32, "flashinfer")
    else:
        with pytest.raises(ValueError, match="needs CUDA"):
            choose_backend(cpu, torch.float32, "flashinfer")
    cache = PagedKVCache(1, 2, 4, 1, 8, device=cpu, dtype=torch.float32)
    assert cache.layout == "head_major" and isinstance(make_attention(cache, 1, 1, 8), TorchPagedAttention)
    with pytest.raises(ValueError, match="unknown KV layout"):
        PagedKVCache(1, 2, 4, 1, 8, device=cpu, dtype=torch.float32, layout="nhd")


def test_decode_rows_of_very_different_lengths_gather_in_separate_groups():
    from engine.attention_layout import decode_groups

    assert decode_groups([5, 5, 6, 5]) == [[0, 1, 3, 2]]                  # similar lengths: one gather
    assert decode_groups([7, 257, 6, 8, 7]) == [[2, 0, 4, 3], [1]]        # the 4k-token row alone
    assert decode_groups([]) == []
