"""Token-level radix tree: the baseline the CHT replaces (SGLang's LPM and DFS-weight orderings).

The tree is SGLang's ``RadixCache`` with page size 1, reduced to what ordering needs: nodes
hold token-id sequences, children are keyed by their first token, a match compares token by
token in Python (like ``_key_match_page_size1``) and splits the node it stops inside (like
``_match_prefix_helper``). What the tree that waiting requests are matched against holds
depends on ``cache_finished``:

* ``cache_finished=False`` (the default): the tokens of the *active* batch only, i.e. the same
  working set as the CHT; a finished request's tokens leave the tree.
* ``cache_finished=True``: SGLang's semantics, the tree is the *KV prefix cache*. It holds the
  tokens of the running requests (referenced, SGLang's ``lock_ref > 0``) and of every finished
  request (``finish`` keeps them as cached, unreferenced KV, like ``cache_finished_req``), so a
  waiting request matches its whole cached prefix, token by token, whether or not that prefix
  is in the running batch. ``remove`` (an abort) drops only the nodes that the aborted request
  alone referenced: tokens also held by an active request or cached by a finished one stay.
  Nothing is evicted unless ``cache_tokens`` is set: the KV cache is assumed large enough to
  keep everything (``benchmarks/cht_overhead.py`` relies on that). With ``cache_tokens=N``,
  whenever an activation makes the tree hold more than N tokens, unreferenced leaves are
  evicted least recently used first (SGLang's default ``lru`` policy: a match or an insert
  refreshes the nodes on its path; a parent left childless and unreferenced becomes
  evictable) until it fits or only referenced tokens remain; whole nodes go, so it may end
  below N. SGLang evicts when an allocation needs room; here the budget is on the tree alone.
  Eviction finds the evictable leaves with one walk over the tree (it runs only on activations
  that exceed the budget); SGLang keeps a set of them instead.

Orderings (SGLang's ``python/sglang/srt/managers/schedule_policy.py``; DFS-weight's walk is
``_dfs_weight_order`` in ``python/sglang/srt/mem_cache/base_prefix_cache.py``), both over the
tree above (the cache when ``cache_finished``):

* ``"lpm"``, longest prefix match: every waiting request is matched against the tree and the
  longest match wins, earliest inserted among ties (SGLang sorts stably by ``-matched``). When
  more than ``lpm_fcfs_fallback`` requests wait, SGLang skips the matching and serves FCFS
  (it uses 128); ``None`` disables that. With ``lpm_in_batch_check`` (the default, as SGLang
  ships it) each decision also runs SGLang's *in-batch prefix caching* check
  (``_compute_prefix_matches``): a temporary radix tree of the waiting queue is built from
  scratch (SGLang's ``waiting_queue_radix_tree``, reset on every scheduling pass); the waiting
  requests are visited in queue (insertion) order, and each one whose match against the tree
  above is at most ``in_batch_check_threshold`` tokens (SGLang's
  ``IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD``, 32; negative disables) is also matched, token by
  token, against that temporary tree. If that match is at least
  ``in_batch_deprioritize_threshold`` tokens (``IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD``,
  32; SGLang compares with ``>=``), an earlier waiting request already shares its prefix and it
  is deprioritized (sorted behind every other request, SGLang's ``float("inf")`` key);
  otherwise its whole prompt is inserted into the temporary tree (a second walk, as SGLang's
  ``insert``). The candidate is the longest match among the requests not deprioritized
  (earliest inserted among ties), or the earliest inserted request if all were. Requests whose
  match exceeds the check threshold are neither matched against nor inserted into the
  temporary tree. Above the FCFS fallback none of this runs, as in SGLang. The check costs up
  to two token-level walks of the shared part of every short-matched waiting prompt per
  decision, on top of the cache match. Not modelled: SGLang also runs the check for
  DFS-weight (its cost only, the order ignores it); it re-sorts its queue in place, so later
  passes visit it in the previous pass's order, not in arrival order; and its LPM sort key is
  the match capped at the prompt length minus one (``_compute_max_prefix_len``).
  With SGLang's thresholds (deprioritize >= check) the check never changes the *candidate*: a
  deprioritized request shares at least the check threshold of tokens with an earlier request
  of the temporary tree, and both matches are at most that threshold, so they are equal; the
  earliest longest match is therefore never deprioritized. It reorders the rest of the queue
  (:meth:`RadixTree.lpm_order`), which SGLang admits from within one pass, and it costs time.
  With a deprioritize threshold below the check threshold the candidate can change.
* ``"dfs-weight"``: every waiting request is matched; its *last node* is where its match ends.
  A node's weight is the number of waiting requests whose last node lies in its subtree. The
  order is a depth-first walk over the whole tree that visits children in descending weight
  (ties in the children dict's order, as SGLang's stable sort), emitting a node's own requests
  after its children's. The candidate is the first request of that order. With an empty tree
  every match ends at the root, so it is the earliest inserted request. SGLang has no FCFS
  fallback for it.

Both report :class:`~scheduler_runtime.prefix_index.Candidate` fields in chunks with the CHT's
definition, relative to the *active batch* in both modes (``depth_before``, ``depth_after``:
shared prefix of the running requests before and after adding the candidate; ``w``: other
waiting requests sharing the candidate's first ``depth_after`` chunks), so the structures can be
compared field by field. With ``cache_finished=True`` the active part of a match is read off
the cache match without matching again (the referenced nodes on its path), so the cache costs
no extra token comparisons. ``w`` is read from a second radix tree over the waiting requests
(counts of requests per node, like SGLang's ``waiting_queue_radix_tree``), walked node by node,
not token by token.

Which request is chosen may differ from the CHT's choice (the CHT picks the fewest chunks
missing from the active batch), and with ``cache_finished=True`` it may also differ from the
active-batch tree's: a request whose prefix is cached but no longer in the running batch can
win LPM, or weigh in DFS-weight. That is SGLang's behaviour, and the point of the cache.

Cost: one decision matches every waiting request, so it grows with W x matched prompt length
(with the cache, the whole cached prefix of each waiting request); LPM's in-batch check adds,
for every short-matched waiting request, a match against the temporary waiting-queue tree
(the prefix it shares with earlier waiting requests) and, unless deprioritized, an insert of
its prompt, rebuilt on every decision; DFS-weight also walks every node of the tree (with the
cache, every cached prompt's nodes). That is what the CHT avoids.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Literal

import numpy as np

from scheduler_runtime.prefix_index import (
    DEFAULT_CHUNK_SIZE,
    Candidate,
    DuplicateRequestError,
    UnknownRequestError,
    as_token_array,
    check_chunk_size,
    num_chunks,
)

__all__ = [
    "IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD",
    "IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD",
    "RADIX_ORDERINGS",
    "RadixTree",
]

Ordering = Literal["lpm", "dfs-weight"]
#: The orderings this tree computes (the names of :class:`scheduler_runtime.orderings.OrderingName`).
RADIX_ORDERINGS: tuple[Ordering, Ordering] = ("lpm", "dfs-weight")

#: SGLang's defaults (``managers/schedule_policy.py``, both overridable there by environment
#: variables of the same name): a waiting request whose cache match is at most this many tokens
#: is checked against the other waiting requests (-1 disables the check) ...
IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD = 32
#: ... and deprioritized when an earlier waiting request shares at least this many tokens.
IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD = 32


class _Node:
    """A radix node: a run of tokens, children by first token, and request counts."""

    __slots__ = ("children", "parent", "key", "ref", "ends", "cached", "last_access")

    def __init__(self, key: list[int], parent: _Node | None) -> None:
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.key = key
        self.ref = 0  # active requests whose tokens pass through this whole node
        self.ends = 0  # active requests whose tokens end exactly at this node's last token
        # A finished request's tokens cover this node: it stays (cached KV) when ref drops
        # to 0. Only set with cache_finished; a cached node's ancestors are cached too.
        self.cached = False
        self.last_access = 0  # logical clock of the last match/insert through it (for LRU)


# Prompts are kept as lists of ints, the representation the token-by-token match is fastest
# on. Ids below this bound are interned (looked up in an object array of the ints themselves)
# so that W long prompts cost one pointer (8 B) per token rather than one int object each
# (36 B): 10,000 prompts of 32K tokens take ~2.6 GB instead of ~12.
_INTERN_BOUND = 1 << 18
_interned: np.ndarray | None = None


def _as_list(tokens: np.ndarray) -> list[int]:
    global _interned
    if int(tokens.max()) >= _INTERN_BOUND:
        return tokens.tolist()
    if _interned is None:
        _interned = np.empty(_INTERN_BOUND, dtype=object)
        _interned[:] = range(_INTERN_BOUND)
    return _interned[tokens].tolist()


class _Request:
    __slots__ = ("request_id", "tokens")

    def __init__(self, request_id: str, tokens: list[int]) -> None:
        self.request_id = request_id
        self.tokens = tokens


def _key_match(key0: list[int], key1: list[int]) -> int:
    """Length of the common prefix, token by token (SGLang's ``_key_match_page_size1``)."""
    i = 0
    for k0, k1 in zip(key0, key1):  # noqa: B905 (lengths differ by design)
        if k0 != k1:
            break
        i += 1
    return i


def _split(child: _Node, split_len: int) -> _Node:
    """Cut ``child`` after ``split_len`` tokens; return the new upper node (SGLang's split)."""
    parent = child.parent
    assert parent is not None
    upper = _Node(child.key[:split_len], parent)
    upper.ref = child.ref
    upper.cached = child.cached
    upper.last_access = child.last_access
    upper.children = {child.key[split_len]: child}
    # Same dict key as before, so the parent's children keep their order.
    parent.children[child.key[0]] = upper
    child.key = child.key[split_len:]
    child.parent = upper
    return upper


def _match(root: _Node, key: list[int], stamp: int | None = None) -> tuple[int, _Node]:
    """Match ``key`` against the tree; (matched tokens, node where the match ends).

    Splits the node the match stops inside, so the end is always a node boundary. With a
    ``stamp``, the nodes on the path record it as their last access (for LRU eviction).
    """
    node = root
    matched = 0
    while len(key) > 0 and key[0] in node.children:
        child = node.children[key[0]]
        if stamp is not None:
            child.last_access = stamp
        prefix_len = _key_match(child.key, key)
        matched += prefix_len
        if prefix_len < len(child.key):
            node = _split(child, prefix_len)
            break
        node = child
        key = key[prefix_len:]
    return matched, node


def _active_depth(node: _Node) -> int:
    """Tokens of the path to ``node`` that the active batch holds (nodes with ``ref > 0``).

    Active requests pass through whole nodes, and a node's active requests pass through its
    parent, so the active part of a match is the path up to its deepest referenced node.
    """
    while node.parent is not None and node.ref == 0:
        node = node.parent
    depth = 0
    while node.parent is not None:
        depth += len(node.key)
        node = node.parent
    return depth


def _add(root: _Node, key: list[int], stamp: int | None = None) -> int:
    """Insert ``key``, counting one more request through each node on its path.

    Returns the number of tokens that were not in the tree before (the new leaf's).
    """
    node = root
    pos = 0
    while pos < len(key):
        child = node.children.get(key[pos])
        if child is None:
            leaf = _Node(key[pos:], node)
            leaf.ref = 1
            leaf.ends = 1
            if stamp is not None:
                leaf.last_access = stamp
            node.children[key[pos]] = leaf
            return len(key) - pos
        prefix_len = _key_match(child.key, key[pos:])
        if prefix_len < len(child.key):
            child = _split(child, prefix_len)
        child.ref += 1
        if stamp is not None:
            child.last_access = stamp
        pos += prefix_len
        node = child
    node.ends += 1
    return 0


def _discard(root: _Node, key: list[int]) -> int:
    """Undo ``_add(root, key)``; nodes nobody references any more and no finished request
    cached are dropped. Returns the number of tokens dropped.
    """
    node = root
    pos = 0
    while True:
        first = key[pos]
        child = node.children[first]
        child.ref -= 1
        if child.ref == 0 and not child.cached:
            # Its whole subtree counts at most child.ref requests and holds no cached node (a
            # cached node's ancestors are cached), so it is the rest of this key's path.
            del node.children[first]
            return len(key) - pos
        pos += len(child.key)
        if pos == len(key):
            child.ends -= 1
            return 0
        node = child


def _release_to_cache(root: _Node, key: list[int], stamp: int | None) -> None:
    """A finished request: unreference its path and keep it as cached (SGLang's
    ``cache_finished_req``: insert, then ``dec_lock_ref``)."""
    node = root
    pos = 0
    while True:
        child = node.children[key[pos]]
        child.ref -= 1
        child.cached = True
        if stamp is not None:
            child.last_access = stamp
        pos += len(child.key)
        if pos == len(key):
            child.ends -= 1
            return
        node = child


def _node_at(root: _Node, key: list[int], depth: int) -> _Node:
    """The node covering token ``depth`` (1-based) of ``key``, which is in the tree."""
    node = root
    pos = 0
    while pos < depth:
        node = node.children[key[pos]]
        pos += len(node.key)
    return node


def _dismantle(root: _Node) -> None:
    """Break a discarded tree's parent/child cycles, so it is freed at once, not by the cyclic
    garbage collector (which the benchmark turns off while it measures)."""
    stack = [root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        node.children = {}
        node.parent = None


def _dfs_weight_order(root: _Node, last_nodes: list[_Node]) -> list[int]:
    """SGLang's DFS-weight order of the requests whose matches end at ``last_nodes``."""
    at_node: dict[_Node, list[int]] = {}
    for index, node in enumerate(last_nodes):
        at_node.setdefault(node, []).append(index)
    weight: dict[_Node, int] = {node: len(idx) for node, idx in at_node.items()}
    # Iterative post-order: prompts can make the tree deeper than Python's recursion limit.
    stack: list[tuple[_Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            total = weight.get(node, 0)
            for child in node.children.values():
                total += weight.get(child, 0)
            weight[node] = total
            continue
        stack.append((node, True))
        for child in node.children.values():
            stack.append((child, False))
    order: list[int] = []
    stack2: list[tuple[_Node, bool]] = [(root, False)]
    while stack2:
        node, done = stack2.pop()
        if done:
            order.extend(at_node.get(node, ()))
            continue
        stack2.append((node, True))
        children = sorted(node.children.values(), key=lambda c: -weight.get(c, 0))
        for child in reversed(children):
            stack2.append((child, False))
    return order


class RadixTree:
    """Radix-tree prefix index with SGLang's LPM or DFS-weight ordering (module docstring).

    Args:
        ordering: ``"lpm"`` or ``"dfs-weight"``.
        chunk_size: tokens per chunk for the reported depths (>= 1).
        lpm_fcfs_fallback: with ``"lpm"``, serve FCFS when more requests than this wait
            (SGLang: 128); ``None`` always matches.
        cache_finished: match against SGLang's KV prefix cache (running + finished requests'
            tokens) instead of the active batch's tokens; the Candidate fields stay relative to
            the active batch, the choice may differ (module docstring).
        cache_tokens: with ``cache_finished``, the most tokens the tree keeps before evicting
            unreferenced nodes, least recently used first; ``None`` (default) never evicts.
        lpm_in_batch_check: with ``"lpm"``, run SGLang's in-batch prefix caching check on every
            decision (default ``True``, as SGLang): a waiting request whose match is short
            (<= ``in_batch_check_threshold`` tokens) and whose prefix an earlier waiting
            request shares (>= ``in_batch_deprioritize_threshold`` tokens) goes behind every
            other request (module docstring). ``False`` is plain LPM. Ignored for DFS-weight.
        in_batch_check_threshold: SGLang's ``IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD`` (32);
            negative disables the check.
        in_batch_deprioritize_threshold: SGLang's
            ``IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD`` (32).

    ``batching.py`` passes the first three arguments positionally; the rest are keyword-only.
    """

    def __init__(
        self,
        ordering: Ordering,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        lpm_fcfs_fallback: int | None = 128,
        *,
        cache_finished: bool = False,
        cache_tokens: int | None = None,
        lpm_in_batch_check: bool = True,
        in_batch_check_threshold: int = IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD,
        in_batch_deprioritize_threshold: int = IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD,
    ) -> None:
        if ordering not in RADIX_ORDERINGS:
            raise ValueError(f"ordering must be one of {RADIX_ORDERINGS}, got {ordering!r}")
        if lpm_fcfs_fallback is not None and lpm_fcfs_fallback < 0:
            raise ValueError(f"lpm_fcfs_fallback must be >= 0 or None, got {lpm_fcfs_fallback}")
        if cache_tokens is not None:
            if not cache_finished:
                raise ValueError("cache_tokens needs cache_finished=True")
            if isinstance(cache_tokens, bool) or not isinstance(cache_tokens, int | np.integer):
                raise ValueError(f"cache_tokens must be an int or None, got {cache_tokens!r}")
            if cache_tokens < 0:
                raise ValueError(f"cache_tokens must be >= 0 or None, got {cache_tokens}")
        for name, value in (
            ("in_batch_check_threshold", in_batch_check_threshold),
            ("in_batch_deprioritize_threshold", in_batch_deprioritize_threshold),
        ):
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise ValueError(f"{name} must be an int, got {value!r}")
        self.ordering: Ordering = ordering
        self.lpm_in_batch_check = bool(lpm_in_batch_check)
        self.in_batch_check_threshold = int(in_batch_check_threshold)
        self.in_batch_deprioritize_threshold = int(in_batch_deprioritize_threshold)
        self.chunk_size = check_chunk_size(chunk_size)
        self.lpm_fcfs_fallback = lpm_fcfs_fallback
        self.cache_finished = bool(cache_finished)
        self.cache_tokens = None if cache_tokens is None else int(cache_tokens)
        # Tokens of the active batch, plus the cached ones with cache_finished.
        self._root = _Node([], None)
        self._tree_tokens = 0
        self._clock = 0  # logical time of matches and inserts, only kept for LRU eviction
        self._waiting_root = _Node([], None)  # waiting requests' tokens, for w
        self._waiting: dict[str, _Request] = {}
        self._active: dict[str, _Request] = {}
        self._shared: tuple[int, bool] | None = (0, False)

    # ----------------------------------------------------------------- public API

    def insert(self, request_id: str, token_ids: np.ndarray | Sequence[int]) -> None:
        """Add a waiting request (DuplicateRequestError, ValueError as for the CHT)."""
        if request_id in self._waiting or request_id in self._active:
            raise DuplicateRequestError(f"request {request_id!r} is already in the index")
        tokens = _as_list(as_token_array(token_ids))
        _add(self._waiting_root, tokens)
        self._waiting[request_id] = _Request(request_id, tokens)

    def best_candidate(self) -> Candidate | None:
        """The next request in the configured ordering (stays waiting); None if none waits."""
        if not self._waiting:
            return None
        if self.ordering == "lpm":
            req, matched, node = self._lpm_choice()
        else:
            order, reqs, matched_lens, last_nodes = self._dfs_weight_ranking()
            req, matched, node = reqs[order[0]], matched_lens[order[0]], last_nodes[order[0]]
        if self.cache_finished:
            matched = _active_depth(node)  # the match against the active batch alone
        return self._candidate(req, matched)

    def dfs_weight_order(self) -> list[str]:
        """All waiting ids in SGLang's DFS-weight order (the first one is the candidate)."""
        order, reqs, _, _ = self._dfs_weight_ranking()
        return [reqs[i].request_id for i in order]

    def lpm_order(self) -> list[str]:
        """All waiting ids in SGLang's LPM order (the first one is the LPM candidate).

        Longest match first, ties in queue order, requests deprioritized by the in-batch check
        last (in queue order); above ``lpm_fcfs_fallback`` waiting, the queue order (FCFS).
        SGLang's ``PrefillAdder`` admits from the front of this order within one pass.
        """
        if self.lpm_fcfs_fallback is not None and len(self._waiting) > self.lpm_fcfs_fallback:
            return list(self._waiting)
        stamp = self._access_time()
        root = self._root
        check = self.lpm_in_batch_check and self.in_batch_check_threshold >= 0
        queue_root = _Node([], None)
        keyed: list[tuple[float, str]] = []
        for req in self._waiting.values():
            matched = _match(root, req.tokens, stamp)[0]
            if check and matched <= self.in_batch_check_threshold:
                if _match(queue_root, req.tokens)[0] >= self.in_batch_deprioritize_threshold:
                    keyed.append((float("inf"), req.request_id))
                    continue
                _add(queue_root, req.tokens)
            keyed.append((-matched, req.request_id))
        _dismantle(queue_root)
        keyed.sort(key=lambda item: item[0])  # stable, as SGLang's list.sort
        return [rid for _, rid in keyed]

    def match_length(self, request_id: str) -> int:
        """Tokens of a waiting request's prompt that match the tree LPM matches against: the
        active batch's tokens, or with ``cache_finished`` the cache (active + finished)."""
        req = self._waiting.get(request_id)
        if req is None:
            raise UnknownRequestError(f"request {request_id!r} is not waiting")
        return _match(self._root, req.tokens)[0]

    def activate(self, request_id: str) -> None:
        """Move a waiting request into the active batch (UnknownRequestError if not waiting)."""
        req = self._waiting.pop(request_id, None)
        if req is None:
            raise UnknownRequestError(self._state_message(request_id, "waiting"))
        _discard(self._waiting_root, req.tokens)
        self._tree_tokens += _add(self._root, req.tokens, self._access_time())
        self._active[request_id] = req
        self._shared = None
        if self.cache_tokens is not None and self._tree_tokens > self.cache_tokens:
            self._evict(self.cache_tokens)

    def finish(self, request_id: str) -> None:
        """An active request completed (UnknownRequestError if not active).

        Its tokens leave the tree, or with ``cache_finished`` stay in it as cached KV.
        """
        req = self._active.pop(request_id, None)
        if req is None:
            raise UnknownRequestError(self._state_message(request_id, "active"))
        if self.cache_finished:
            _release_to_cache(self._root, req.tokens, self._access_time())
        else:
            self._tree_tokens -= _discard(self._root, req.tokens)
        self._shared = None

    def remove(self, request_id: str) -> None:
        """Abort a waiting or active request (UnknownRequestError if neither).

        An aborted active request's tokens leave the tree, except those another active
        request holds or (with ``cache_finished``) a finished request cached.
        """
        req = self._active.pop(request_id, None)
        if req is not None:
            self._tree_tokens -= _discard(self._root, req.tokens)
            self._shared = None
            return
        req = self._waiting.pop(request_id, None)
        if req is None:
            raise UnknownRequestError(self._state_message(request_id, "waiting or active"))
        _discard(self._waiting_root, req.tokens)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_tree_tokens(self) -> int:
        """Tokens held by the tree waiting requests are matched against (O(1))."""
        return self._tree_tokens

    @property
    def num_cached_tokens(self) -> int:
        """Tokens of that tree no active request references: the cached, evictable KV.

        Always 0 without ``cache_finished``. Walks the whole tree (for tests and reports).
        """
        total = 0
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.ref == 0:
                total += len(node.key)
            stack.extend(node.children.values())
        return total

    @property
    def shared_depth(self) -> int:
        """Largest k such that every active request has the same first k chunks (0 if none)."""
        tokens, identical = self._shared_prefix()
        if identical:
            return num_chunks(tokens, self.chunk_size)
        return tokens // self.chunk_size

    def waiting_ids(self) -> list[str]:
        return list(self._waiting)

    def active_ids(self) -> list[str]:
        return list(self._active)

    def is_empty_tree(self) -> bool:
        """True when neither tree holds any node (everything finished or removed, and with
        ``cache_finished`` nothing cached: only aborts, or everything evicted)."""
        return not self._root.children and not self._waiting_root.children

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._waiting or request_id in self._active

    def __len__(self) -> int:
        return len(self._waiting) + len(self._active)

    # ------------------------------------------------------------------ internals

    def _access_time(self) -> int | None:
        """A new access time for LRU, or None when nothing is ever evicted."""
        if self.cache_tokens is None:
            return None
        self._clock += 1
        return self._clock

    def _lpm_choice(self) -> tuple[_Request, int, _Node]:
        fallback = self.lpm_fcfs_fallback
        stamp = self._access_time()
        if fallback is not None and len(self._waiting) > fallback:
            req = next(iter(self._waiting.values()))
            return req, *_match(self._root, req.tokens, stamp)
        root = self._root
        if self.lpm_in_batch_check and self.in_batch_check_threshold >= 0:
            return self._lpm_choice_in_batch_checked(stamp)
        best: _Request | None = None
        best_len = -1
        best_node = root
        for req in self._waiting.values():
            matched, node = _match(root, req.tokens, stamp)
            if matched > best_len:
                best, best_len, best_node = req, matched, node
        assert best is not None
        return best, best_len, best_node

    def _lpm_choice_in_batch_checked(self, stamp: int | None) -> tuple[_Request, int, _Node]:
        """LPM with SGLang's in-batch prefix caching check (``_compute_prefix_matches`` +
        ``_sort_by_longest_prefix``): the longest match among the requests not deprioritized."""
        root = self._root
        check_threshold = self.in_batch_check_threshold
        deprioritize_threshold = self.in_batch_deprioritize_threshold
        queue_root = _Node([], None)  # SGLang's waiting_queue_radix_tree, reset every pass
        best: _Request | None = None
        best_len = -1
        best_node = root
        first_deprioritized: tuple[_Request, int, _Node] | None = None
        for req in self._waiting.values():
            tokens = req.tokens
            matched, node = _match(root, tokens, stamp)
            if matched <= check_threshold:
                if _match(queue_root, tokens)[0] >= deprioritize_threshold:
                    if first_deprioritized is None:
                        first_deprioritized = (req, matched, node)
                    continue
                _add(queue_root, tokens)
            if matched > best_len:
                best, best_len, best_node = req, matched, node
        _dismantle(queue_root)
        if best is None:  # all deprioritized: SGLang's stable sort keeps the queue order
            assert first_deprioritized is not None
            return first_deprioritized
        return best, best_len, best_node

    def _dfs_weight_ranking(self) -> tuple[list[int], list[_Request], list[int], list[_Node]]:
        reqs = list(self._waiting.values())
        last_nodes: list[_Node] = []
        matched_lens: list[int] = []
        stamp = self._access_time()
        for req in reqs:
            matched, node = _match(self._root, req.tokens, stamp)
            matched_lens.append(matched)
            last_nodes.append(node)
        return _dfs_weight_order(self._root, last_nodes), reqs, matched_lens, last_nodes

    def _evict(self, budget: int) -> None:
        """Drop unreferenced leaves, least recently used first, until the tree fits ``budget``
        tokens or nothing unreferenced is left (SGLang's ``RadixCache.evict``)."""
        heap: list[tuple[int, int, _Node]] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.ref == 0:
                heap.append((node.last_access, len(heap), node))
        heapq.heapify(heap)
        serial = len(heap)
        while self._tree_tokens > budget and heap:
            leaf = heapq.heappop(heap)[2]
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self._tree_tokens -= len(leaf.key)
            if parent is not self._root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_access, serial, parent))
                serial += 1

    def _shared_prefix(self) -> tuple[int, bool]:
        """(tokens every active request shares, whether they are all that long exactly)."""
        if self._shared is None:
            if not self._active:
                self._shared = (0, False)
                return self._shared
            n_active = len(self._active)
            # Nodes every active request passes through lie on any one active request's path
            # (walking it, not the children, skips the cached branches beside it).
            key = next(iter(self._active.values())).tokens
            node = self._root
            depth = 0
            while depth < len(key):
                nxt = node.children[key[depth]]
                if nxt.ref != n_active:
                    break
                depth += len(nxt.key)
                node = nxt
            self._shared = (depth, depth > 0 and node.ends == n_active)
        return self._shared

    def _candidate(self, req: _Request, matched: int) -> Candidate:
        """Fields for ``req``; ``matched`` is its token match against the active batch."""
        chunk = self.chunk_size
        n = len(req.tokens)
        depth_before = self.shared_depth
        if not self._active:
            depth_after = num_chunks(n, chunk)
        else:
            shared_tokens, identical = self._shared_prefix()
            along_shared = min(matched, shared_tokens)
            if identical and n == shared_tokens == along_shared:
                # Identical to every active prompt: it shares the partial last chunk too.
                depth_after = depth_before
            else:
                depth_after = min(depth_before, along_shared // chunk)
        if depth_after == 0:
            sharing = len(self._waiting)
        elif depth_after * chunk > n:
            # Depth includes the candidate's partial last chunk: only identical prompts share it.
            sharing = _node_at(self._waiting_root, req.tokens, n).ends
        else:
            sharing = _node_at(self._waiting_root, req.tokens, depth_after * chunk).ref
        return Candidate(req.request_id, depth_before, depth_after, sharing - 1)

    def _state_message(self, request_id: str, wanted: str) -> str:
        if request_id in self._waiting:
            state = "waiting"
        elif request_id in self._active:
            state = "active"
        else:
            state = "unknown"
        return f"request {request_id!r} is {state}, expected {wanted}"
