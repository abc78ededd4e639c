"""A two-tier (GPU / host) radix tree of KV cache, the simulator's model of SGLang's HiCache tree.

Keys are sequences of *units* with a token count each: a unit is one token in the differential
test against SGLang's RadixCache, and one prompt segment (a run of tokens with a stable id) in the
simulator, so the tree does the same work per segment that SGLang does per token. Prefixes match
unit by unit; nodes split at unit boundaries.

Tiers (SGLang's HiCache with write-through):
- a node is on the GPU, on the host, or both; GPU residency is closed under parents (a GPU
  node's parent is on the GPU), so a matched path is a GPU prefix followed by host-only nodes;
- GPU eviction takes unlocked nodes with no child on the GPU; a node with a host copy becomes
  host-only, one without is deleted with its (host-only) subtree;
- host eviction deletes host-only nodes that have no children.

Eviction order comes from a policy object with one method, `priority(node)`, smaller first, as
in SGLang's `EvictionStrategy.get_priority`. The tree keeps one heap per tier with an entry for
each evictable node; an entry is pushed whenever a node becomes evictable or its priority may
have changed (`refresh`), and stale entries are skipped on pop. Evicting a node therefore costs
O(log n), with no scan over the tree. An entry is one flat tuple, the priority's items, then a
number that orders equal priorities by entry (the node's latest), then the node: it compares as
(priority, number) does, since a policy's priorities all have one length (EvictionPolicy.priority),
with one tuple comparison rather than one inside another (the nested ones were 12% of a pbkv
replay's instructions). A refresh only marks the node; the marked nodes are entered
in the heaps, in the order of their latest marks, just before the next pop (`_flush`). A node
refreshed several times between two evictions (matched, locked, inserted, unlocked, re-scored)
is then entered once, with the priority and the place among equal priorities that its last
refresh would have given it, so the order of evictions is exactly that of entering it every time.

Clock: a logical clock that ticks once per operation and once per node created, mirroring where
SGLang reads `time.monotonic()` (access stamp first, then node creation), so LRU orders agree.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Iterable, Sequence

import cython

from serving_integration.cache.workload import ROOT_KEY, chain, first_and_last_key

class Node:
    __slots__ = ("id", "parent", "children", "units", "lens", "num_tokens", "on_gpu", "on_host",
                 "lock_ref", "gpu_children", "last_access_time", "creation_time", "hit_count", "key_id", "end_key",
                 "depth_tokens", "max_depth_tokens", "priority", "_gpu_entry", "_host_entry")

    def __init__(self, node_id: int, parent: "Node | None", units: tuple, lens: tuple):
        self.id = node_id
        self.parent = parent
        self.children: dict = {}
        self.units, self.lens = units, lens
        self.num_tokens = sum(lens)
        self.on_gpu = self.on_host = False
        self.lock_ref = 0
        self.gpu_children = 0
        self.last_access_time = 0.0
        self.creation_time = 0.0  # SGLang's TreeNode.creation_time (FIFO, FILO; a split prefix keeps it)
        self.hit_count = 0
        self.priority = 0
        self.key_id = self.end_key = ROOT_KEY
        # tokens from the root through this node, and the deepest such depth ever seen below
        # it (SGLang's T-LRU "history length", which does not shrink when the tail is evicted)
        self.depth_tokens = self.max_depth_tokens = 0
        self._gpu_entry = self._host_entry = -1

    def __repr__(self) -> str:
        return f"Node({self.id}, {self.num_tokens} tok, gpu={self.on_gpu}, host={self.on_host})"


class RadixTree:
    def __init__(self, gpu_tokens: int, host_tokens: int = 0,
                 priority: Callable[[Node], tuple] | None = None,
                 on_delete: Callable[[Node], None] | None = None,
                 on_split: Callable[[Node, Node], None] | None = None,
                 on_evict: Callable[[Node], None] | None = None, partial_eviction: bool = False):
        self.gpu_capacity, self.host_capacity = gpu_tokens, host_tokens
        self.partial_eviction = partial_eviction  # SimConfig.partial_eviction: evict a victim's tail only
        self.priority = priority or (lambda node: (node.last_access_time,))
        self.on_delete = on_delete or (lambda node: None)
        self.on_split = on_split or (lambda prefix, suffix: None)
        self.on_evict = on_evict or (lambda node: None)
        self._ids = itertools.count(1)
        self._seq = itertools.count()
        self.clock = 0.0
        self.root = Node(0, None, (), ())
        self.root.on_gpu = self.root.on_host = True
        self.root.lock_ref = 1
        self.gpu_used = 0  # tokens of tree nodes on the GPU
        self.host_used = 0
        self.private_gpu = 0  # tokens held by running requests outside the tree
        self.gpu_locked = 0  # tokens of locked GPU nodes (what gpu_evictable_tokens leaves out)
        self._gpu_heap: list = []
        self._host_heap: list = []
        self._dirty: dict[Node, None] = {}  # nodes refreshed since the last flush, latest refresh last
        self.by_key: dict[int, Node] = {}  # prefix identity (see `chain`) -> node starting there
        self.by_id: dict[int, Node] = {}

    # ------------------------------------------------------------------ clock and heaps

    def tick(self) -> float:
        self.clock += 1.0
        return self.clock

    def gpu_evictable(self, node: Node) -> bool:
        return node.on_gpu and node.lock_ref == 0 and node.gpu_children == 0 and node is not self.root

    def host_evictable(self, node: Node) -> bool:
        return (node.on_host and not node.on_gpu and not node.children and node.lock_ref == 0
                and node is not self.root)

    def refresh(self, node: Node) -> None:
        """The node may have become evictable, or not, or its priority may have changed: it is
        re-entered in the heaps it belongs to, with its priority then, before the next eviction."""
        dirty = self._dirty
        if node in dirty:
            del dirty[node]  # its place among equal priorities is that of its latest refresh
        dirty[node] = None

    @cython.locals(node=Node)
    def _flush(self) -> None:
        """Enter every node refreshed since the last flush (gpu_evictable / host_evictable, inlined:
        this is the simulator's hottest loop)."""
        dirty = self._dirty
        if not dirty:
            return
        seq, priority = self._seq, self.priority
        for node in dirty:
            if node.parent is None:  # deleted since (or the root)
                continue
            if node.on_gpu:
                node._host_entry = -1
                if node.lock_ref == 0 and node.gpu_children == 0:
                    node._gpu_entry = s = next(seq)
                    heapq.heappush(self._gpu_heap, (*priority(node), s, node))
                else:
                    node._gpu_entry = -1
            else:
                node._gpu_entry = -1
                if node.on_host and not node.children and node.lock_ref == 0:
                    node._host_entry = s = next(seq)
                    heapq.heappush(self._host_heap, (*priority(node), s, node))
                else:
                    node._host_entry = -1
        dirty.clear()

    def reprioritize(self) -> None:
        """Every priority changed at once (a policy switched its order): rebuild both heaps from
        the evictable nodes, O(n)."""
        self._dirty.clear()  # every node is entered anew here
        gpu, host = [], []
        for node in self.nodes():
            node._gpu_entry = node._host_entry = -1
            if self.gpu_evictable(node):
                node._gpu_entry = seq = next(self._seq)
                gpu.append((*self.priority(node), seq, node))
            if self.host_evictable(node):
                node._host_entry = seq = next(self._seq)
                host.append((*self.priority(node), seq, node))
        heapq.heapify(gpu)
        heapq.heapify(host)
        self._gpu_heap, self._host_heap = gpu, host

    def reprioritize_ids(self, node_ids: Iterable[int]) -> None:
        """These nodes' priorities changed at once: re-entered now, with their priorities now (as
        `reprioritize` would, for the nodes whose priority it would change); none named, nothing
        entered (a node refreshed before waits for the next eviction, as always)."""
        node_ids = list(node_ids)
        if node_ids:
            self.refresh_ids(node_ids)
            self._flush()

    def refresh_many(self, nodes: Iterable[Node]) -> None:
        for node in nodes:
            if node.parent is not None:
                self.refresh(node)

    def refresh_ids(self, node_ids: Iterable[int]) -> None:
        for node_id in node_ids:
            node = self.by_id.get(node_id)
            if node is not None:
                self.refresh(node)

    # ------------------------------------------------------------------ structure

    @cython.locals(node=Node, cur=Node)
    def _new_node(self, parent: Node, units: tuple, lens: tuple) -> Node:
        node = Node(next(self._ids), parent, units, lens)
        node.last_access_time = node.creation_time = self.tick()
        node.depth_tokens = parent.depth_tokens + node.num_tokens
        node.max_depth_tokens = node.depth_tokens
        node.key_id, node.end_key = first_and_last_key(units, parent.end_key)
        self.by_key[node.key_id] = node
        self.by_id[node.id] = node
        parent.children[units[0]] = node
        cur: Node | None = parent
        while cur is not None and cur.max_depth_tokens < node.depth_tokens:
            cur.max_depth_tokens = node.depth_tokens
            cur = cur.parent
        return node

    @cython.locals(node=Node, prefix=Node, parent=Node)
    def _split(self, node: Node, at: int) -> Node:
        """Split `node` after `at` units; returns the new prefix node (the parent of `node`)."""
        parent = node.parent
        assert parent is not None, f"{node} is not in the tree"
        prefix = Node(next(self._ids), parent, node.units[:at], node.lens[:at])
        prefix.last_access_time = self.tick()
        prefix.on_gpu, prefix.on_host, prefix.lock_ref = node.on_gpu, node.on_host, node.lock_ref
        prefix.hit_count, prefix.max_depth_tokens = node.hit_count, node.max_depth_tokens
        prefix.creation_time, prefix.priority = node.creation_time, node.priority
        prefix.depth_tokens = parent.depth_tokens + prefix.num_tokens
        prefix.key_id = node.key_id
        prefix.end_key = first_and_last_key(prefix.units, parent.end_key)[1]
        node.units, node.lens = node.units[at:], node.lens[at:]
        node.num_tokens -= prefix.num_tokens
        node.parent = prefix
        node.key_id = chain(prefix.end_key, node.units[0])
        self.by_key[prefix.key_id] = prefix
        self.by_key[node.key_id] = node
        self.by_id[prefix.id] = prefix
        prefix.children[node.units[0]] = node
        prefix.gpu_children = int(node.on_gpu)
        parent.children[prefix.units[0]] = prefix
        self.on_split(prefix, node)
        self.refresh(prefix)
        self.refresh(node)
        return prefix

    @cython.locals(parent=Node)
    def _delete(self, node: Node) -> None:
        """Remove a node and its subtree from the tree (both tiers)."""
        for child in list(node.children.values()):
            self._delete(child)
        parent = node.parent
        assert parent is not None, f"{node} is not in the tree"
        del parent.children[node.units[0]]
        if node.on_gpu:
            self.gpu_used -= node.num_tokens
            parent.gpu_children -= 1
        if node.on_host:
            self.host_used -= node.num_tokens
        if self.by_key.get(node.key_id) is node:
            del self.by_key[node.key_id]
        del self.by_id[node.id]
        node._gpu_entry = node._host_entry = -1
        node.parent = None
        self.on_delete(node)

    # ------------------------------------------------------------------ match and insert

    @cython.locals(node=Node, child=Node, n=cython.Py_ssize_t, i=cython.Py_ssize_t)
    def match(self, units: Sequence, lens: Sequence[int]) -> list[Node]:
        """Longest cached prefix: the path of nodes (GPU nodes, then host-only nodes).

        Marks the path accessed (LRU time). A match that ends inside a node splits it, as
        SGLang does."""
        now = self.tick()
        self.root.last_access_time = now
        node, i, path = self.root, 0, []
        while i < len(units) and units[i] in node.children:
            child = node.children[units[i]]
            child.last_access_time = now
            n = _common(child.units, units, i)
            if n < len(child.units):
                path.append(self._split(child, n))
                break
            path.append(child)
            self.refresh(child)
            node, i = child, i + n
        return path

    def peek(self, units: Sequence) -> tuple[int, int]:
        """Units of the longest cached prefix held on GPU, and in all (GPU then host), without
        touching the tree (no access time, no split): what a router may ask of a replica."""
        _, on_gpu, matched = self.peek_path(units)
        return on_gpu, matched

    def peek_path(self, units: Sequence) -> tuple[list[Node], int, int]:
        """`peek`'s walk: the nodes of the longest cached prefix (the last one perhaps read only in
        part), and its units on GPU and in all, without touching the tree."""
        node, i, on_gpu, path = self.root, 0, 0, []
        while i < len(units) and units[i] in node.children:
            child = node.children[units[i]]
            path.append(child)
            n = _common(child.units, units, i)
            i += n
            if child.on_gpu:
                on_gpu = i
            if n < len(child.units):
                break
            node = child
        return path, on_gpu, i

    @cython.locals(node=Node, child=Node, leaf=Node, n=cython.Py_ssize_t, i=cython.Py_ssize_t)
    def insert(self, units: Sequence, lens: Sequence[int], refresh: bool = True) -> tuple[int, list[Node]]:
        """Insert a key whose KV the caller holds on the GPU; returns (tokens the tree already
        had on the GPU, which the caller frees as duplicates, and the path). Nodes the key
        passes through that were host-only take the caller's copy, as HiCache's insert does;
        new nodes go on the GPU and, write-through, to the host when it has room. With
        refresh=False the caller refreshes the path itself (`refresh_many`) before the next
        eviction, once it has updated what their priorities read."""
        now = self.tick()
        self.root.last_access_time = now
        node, i, duplicate, path = self.root, 0, 0, []
        while i < len(units) and units[i] in node.children:
            child = node.children[units[i]]
            child.last_access_time = now
            n = _common(child.units, units, i)
            if n < len(child.units):
                child = self._split(child, n)
            child.hit_count += 1
            if child.on_gpu:
                duplicate += child.num_tokens
            else:
                self._set_gpu(child, True)
            path.append(child)
            node, i = child, i + n
        if i < len(units):
            leaf = self._new_node(node, tuple(units[i:]), tuple(lens[i:]))
            leaf.hit_count = 1
            self._set_gpu(leaf, True)
            self.backup(leaf)
            path.append(leaf)
        if refresh:
            self.refresh_many(path)
        return duplicate, path

    # ------------------------------------------------------------------ tiers

    @cython.locals(parent=Node)
    def _set_gpu(self, node: Node, on: bool) -> None:
        if node.on_gpu == on:
            return
        node.on_gpu = on
        delta = 1 if on else -1
        self.gpu_used += delta * node.num_tokens
        if node.lock_ref:  # a locked host-only node of a matched path, loaded back
            self.gpu_locked += delta * node.num_tokens
        parent = node.parent
        assert parent is not None, f"{node} is not in the tree"
        parent.gpu_children += delta
        if parent is not self.root:
            self.refresh(parent)

    def backup(self, node: Node) -> bool:
        """Write-through: give the node a host copy if the host tier can make room."""
        if node.on_host or self.host_capacity <= 0:
            return node.on_host
        if self.host_capacity - self.host_used < node.num_tokens:
            self.evict_host(node.num_tokens - (self.host_capacity - self.host_used))
        if self.host_capacity - self.host_used < node.num_tokens:
            return False
        node.on_host = True
        self.host_used += node.num_tokens
        return True

    def load_back(self, path: list[Node]) -> int:
        """Bring the host-only nodes of a path onto the GPU (space must be free); returns tokens."""
        loaded = 0
        for node in path:
            if not node.on_gpu:
                self._set_gpu(node, True)
                loaded += node.num_tokens
                self.refresh(node)
        return loaded

    def gpu_free(self) -> int:
        return self.gpu_capacity - self.gpu_used - self.private_gpu

    def gpu_evictable_tokens(self) -> int:
        """GPU tokens an eviction could free: those of unlocked nodes (a lock covers a node's
        ancestors, so an unlocked node's subtree is unlocked and leaves first, whole). SGLang's
        `evictable_size()`, which its scheduler adds to the free tokens before admitting."""
        return self.gpu_used - self.gpu_locked

    @cython.locals(node=Node, entry=tuple)
    def evict_gpu(self, tokens: int, allow: Callable[[Node], bool] | None = None) -> list[Node]:
        """Evict whole nodes in policy order until `tokens` are freed; `allow` can veto a node
        (conservative prefetch frees only retired cache). Returns the evicted nodes."""
        evicted, freed, vetoed = [], 0, []
        self._flush()
        while freed < tokens and self._gpu_heap:
            entry = heapq.heappop(self._gpu_heap)
            node = entry[-1]
            if node._gpu_entry != entry[-2]:
                continue
            if allow is not None and not allow(node):
                vetoed.append(node)
                continue
            if self.partial_eviction and node.num_tokens > tokens - freed:
                self._split_off_tail(node, tokens - freed)
            node._gpu_entry = -1
            freed += node.num_tokens
            evicted.append(node)
            self.on_evict(node)
            parent = node.parent
            if node.on_host:
                self._set_gpu(node, False)
                self.refresh(node)
            else:
                self._set_gpu(node, False)
                self._delete(node)
            if parent is not self.root:
                self.refresh(parent)
            self._flush()  # the parent may be next
        for node in vetoed:
            self.refresh(node)
        return evicted

    def _split_off_tail(self, node: Node, tokens: int) -> None:
        """Partial eviction: split `node` so that it keeps only its shortest tail of whole units that
        holds `tokens`; the prefix before it stays in the tree with the node's place in the order
        (its access time and priority), and the caller evicts the tail. A node of one unit, or one
        whose every unit is needed, is left whole."""
        tail = units = 0
        for size in reversed(node.lens):
            tail += size
            units += 1
            if tail >= tokens:
                break
        if units < len(node.units):
            self._split(node, len(node.units) - units).last_access_time = node.last_access_time

    @cython.locals(node=Node, entry=tuple)
    def evict_host(self, tokens: int) -> int:
        freed = 0
        self._flush()
        while freed < tokens and self._host_heap:
            entry = heapq.heappop(self._host_heap)
            node = entry[-1]
            if node._host_entry != entry[-2]:
                continue
            parent = node.parent
            freed += node.num_tokens
            self._delete(node)
            self.refresh(parent)
            self._flush()
        return freed

    # ------------------------------------------------------------------ locks

    # A lock is held on a path's last node and covers its ancestors, walked at lock and unlock
    # time (as SGLang's inc/dec_lock_ref do), so a split of a locked node stays locked.

    @cython.locals(parent=Node)
    def lock(self, node: Node) -> None:
        while node is not self.root:
            node.lock_ref += 1
            if node.lock_ref == 1:
                if node.on_gpu:
                    self.gpu_locked += node.num_tokens
                self.refresh(node)
            parent = node.parent
            assert parent is not None, f"{node} is not in the tree"
            node = parent

    @cython.locals(parent=Node)
    def unlock(self, node: Node) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                if node.on_gpu:
                    self.gpu_locked -= node.num_tokens
                self.refresh(node)
            parent = node.parent
            assert parent is not None, f"{node} is not in the tree"
            node = parent

    # ------------------------------------------------------------------ inspection

    def nodes(self) -> Iterable[Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _common(node_units: tuple, units: Sequence, start: int) -> int:
    n, limit = 0, min(len(node_units), len(units) - start)
    while n < limit and node_units[n] == units[start + n]:
        n += 1
    return n


def audit(tree: RadixTree) -> None:
    """Check the tree's invariants (O(n); for tests): tier accounting and capacities, GPU
    residency closed under parents, locks only on the GPU, and a valid heap entry for exactly
    the evictable nodes (once the pending refreshes are entered)."""
    tree._flush()
    gpu = host = locked = 0
    for node in tree.nodes():
        gpu += node.num_tokens * node.on_gpu
        locked += node.num_tokens * (node.on_gpu and node.lock_ref > 0)
        host += node.num_tokens * node.on_host
        assert node.on_gpu or node.on_host, f"{node} is on neither tier"
        assert not node.on_gpu or (node.parent is not None and node.parent.on_gpu), f"{node} is on the GPU but its parent is not"
        assert node.lock_ref == 0 or node.on_gpu, f"{node} is locked but not on the GPU"
        assert node.gpu_children == sum(c.on_gpu for c in node.children.values()), f"{node} gpu_children"
        assert (node._gpu_entry >= 0) == tree.gpu_evictable(node), f"{node} GPU heap entry"
        assert (node._host_entry >= 0) == tree.host_evictable(node), f"{node} host heap entry"
        assert tree.by_id[node.id] is node
    assert gpu == tree.gpu_used, f"GPU tokens {gpu} != accounted {tree.gpu_used}"
    assert host == tree.host_used, f"host tokens {host} != accounted {tree.host_used}"
    assert locked == tree.gpu_locked, f"locked GPU tokens {locked} != accounted {tree.gpu_locked}"
    assert tree.gpu_used + tree.private_gpu <= tree.gpu_capacity, "GPU capacity exceeded"
    assert tree.host_used <= tree.host_capacity, "host capacity exceeded"
