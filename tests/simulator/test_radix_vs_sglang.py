"""Differential test: our radix tree against SGLang 0.5.23's own RadixCache (CPU), under LRU.

Random streams of insert / match / lock / unlock / evict run on both trees; every match must
return the same length and every evict must remove the same nodes in the same order. SGLang's
clock (time.monotonic) is replaced by a counter so that no two stamps tie, as on a real machine;
the allocator is a counter of freed slots (create_simulated's documented mock_allocator: no GPU).
"""

import itertools
import random
import types
from array import array

import pytest

from serving_integration.simulator.radix import RadixTree
from serving_integration.server.compat import install_torchvision_guard

install_torchvision_guard()
import sglang.srt.mem_cache.radix_cache as radix_cache  # noqa: E402  (the real package; CI installs it)
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402


class FreedSlots:
    device = "cpu"

    def __init__(self):
        self.freed = 0

    def free_segment(self, value, start_pos=0):
        self.freed += len(value) - start_pos


@pytest.fixture
def sglang_tree(monkeypatch):
    ticks = itertools.count(1)
    monkeypatch.setattr(radix_cache, "time", types.SimpleNamespace(
        monotonic=lambda: float(next(ticks)), perf_counter=radix_cache.time.perf_counter))
    tree = radix_cache.RadixCache.create_simulated(mock_allocator=FreedSlots())
    evicted = []
    delete_leaf = tree._delete_leaf

    def recording_delete_leaf(node):
        evicted.append(tuple(node.key.token_ids))
        delete_leaf(node)

    tree._delete_leaf = recording_delete_leaf
    return tree, evicted


def key(tokens):
    return radix_cache.RadixKey(token_ids=array("q", tokens))


@pytest.mark.parametrize("seed", range(40))
def test_same_matches_and_evictions_as_sglang(sglang_tree, seed):
    theirs, their_evicted = sglang_tree
    ours = RadixTree(gpu_tokens=10**9)
    rng = random.Random(seed)
    locked = []  # (their node, our node)
    for _ in range(300):
        op = rng.random()
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
        if op < 0.4:
            theirs.insert(InsertParams(key=key(tokens)))
            ours.insert(tokens, [1] * len(tokens))
        elif op < 0.7:
            result = theirs.match_prefix(MatchPrefixParams(key=key(tokens)))
            path = ours.match(tokens, [1] * len(tokens))
            assert sum(n.num_tokens for n in path) == result.device_prefix_len
            if path and rng.random() < 0.3:
                theirs.inc_lock_ref(result.last_device_node)
                ours.lock(path[-1])
                locked.append((result.last_device_node, path[-1]))
        elif op < 0.8 and locked:
            their_node, our_node = locked.pop(rng.randrange(len(locked)))
            theirs.dec_lock_ref(their_node)
            ours.unlock(our_node)
        else:
            n = rng.randint(1, 10)
            before = len(their_evicted)
            freed = theirs.evict(EvictParams(num_tokens=n)).num_tokens_evicted
            nodes = ours.evict_gpu(n)
            assert [tuple(x.units) for x in nodes] == their_evicted[before:]
            assert sum(x.num_tokens for x in nodes) == freed
        assert ours.gpu_used == theirs.total_size()
