"""The prefix cache's bookkeeping (selfspec.runtime.prefixes) on plain caches: which prefix it
restores, what it copies, what it drops. That a restored prefix decodes to the tokens a fresh
prefill gives is tested with real models in tests/test_batch.py and tests/test_server.py."""

from __future__ import annotations

import torch

from selfspec.runtime.prefixes import PrefixStore
from selfspec.runtime.runner import KVCache

LAYERS, HEADS, DIM = 3, 2, 4
PER_TOKEN = 2 * LAYERS * HEADS * DIM * 4  # keys and values, float32


def _filled(tokens: list[int], max_len: int = 32) -> KVCache:
    """A cache whose row at each position holds that position's token (and the layer), so a
    copied row says where it came from."""
    cache = KVCache(LAYERS, HEADS, DIM, max_len, torch.float32, "cpu")
    for i in range(LAYERS):
        keys, values = cache.layer(i)
        for pos, token in enumerate(tokens):
            keys[:, pos] = token + 1000 * i
            values[:, pos] = -(token + 1000 * i)
    return cache


def _rows(cache: KVCache, n: int) -> list[float]:
    return [float(cache.layer(1)[0][0, p, 0]) - 1000 for p in range(n)]


def test_the_longest_stored_prefix_is_restored_but_never_the_prompts_last_token():
    store = PrefixStore(budget_bytes=10**6, block_tokens=3)  # entries end inside a block
    store.save([1, 2, 3, 4], _filled([1, 2, 3, 4]))
    store.save([1, 2, 7], _filled([1, 2, 7]))
    fresh = KVCache(LAYERS, HEADS, DIM, 32, torch.float32, "cpu")
    assert store.restore([1, 2, 3, 9, 9], fresh) == 3
    assert _rows(fresh, 4) == [1, 2, 3, -1000]  # position 3 untouched
    assert float(fresh.layer(2)[1][1, 2, 3]) == -2003  # every layer, keys and values
    whole = KVCache(LAYERS, HEADS, DIM, 32, torch.float32, "cpu")
    assert store.restore([1, 2, 3, 4], whole) == 3  # the last row must be scored
    assert store.restore([5, 1, 2], whole) == 0


def test_an_extended_entry_is_dropped_and_the_least_recently_used_goes_first():
    store = PrefixStore(budget_bytes=10 * PER_TOKEN, block_tokens=1)
    store.save([1, 2, 3], _filled([1, 2, 3]))
    store.save([1, 2, 3, 4, 5], _filled([1, 2, 3, 4, 5]))  # extends the first
    assert [e.tokens.tolist() for e in store.entries] == [[1, 2, 3, 4, 5]]
    store.save([1, 2], _filled([1, 2]))  # held already
    assert len(store.entries) == 1
    store.save([8, 9, 10], _filled([8, 9, 10]))
    store.restore([1, 2, 3, 6], KVCache(LAYERS, HEADS, DIM, 32, torch.float32, "cpu"))
    store.save([20, 21, 22, 23], _filled([20, 21, 22, 23]))  # 12 tokens > 10: [8, 9, 10] goes
    assert [e.tokens[0].item() for e in store.entries] == [1, 20]
    assert store.nbytes <= store.budget_bytes and store.evictions == 1  # extended: not counted
    store.save(list(range(40, 60)), _filled(list(range(40, 60))))  # alone past the budget
    assert [e.tokens.tolist() for e in store.entries] == [list(range(40, 50))]
    assert store.evictions == 3
    store.save(list(range(40, 58)), _filled(list(range(40, 58))))  # cut to what it holds
    assert [e.tokens.tolist() for e in store.entries] == [list(range(40, 50))]


def test_a_store_without_budget_keeps_nothing():
    store = PrefixStore(budget_bytes=0)
    store.save([1, 2, 3], _filled([1, 2, 3]))
    assert store.entries == []
    assert store.restore([1, 2, 3, 4], _filled([])) == 0


def test_entries_come_and_go_inside_one_pool_of_blocks():
    """Many entries of every length saved and dropped: the store keeps writing the same pool
    (no memory of its own past the budget), and what it restores is still each entry's rows."""
    store = PrefixStore(budget_bytes=40 * PER_TOKEN, block_tokens=4)  # 10 blocks
    store.save([0, 1], _filled([0, 1]))
    pool = store.pool.data_ptr()
    for start in range(100, 400, 10):
        tokens = list(range(start, start + 1 + start % 7 * 3))  # 1 to 19 tokens
        store.save(tokens, _filled(tokens))
        assert store.nbytes <= store.budget_bytes and store.pool.data_ptr() == pool
        used = sum(len(e.blocks) for e in store.entries)
        assert used + len(store.free) == 10  # every block held once: in an entry or free
        fresh = KVCache(LAYERS, HEADS, DIM, 32, torch.float32, "cpu")
        assert store.restore([*tokens, 0], fresh) == len(tokens)
        assert _rows(fresh, len(tokens)) == tokens
        assert float(fresh.layer(2)[1][1, len(tokens) - 1, 3]) == -(tokens[-1] + 2000)
