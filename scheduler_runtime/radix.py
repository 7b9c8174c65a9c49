"""Token-level radix tree: the baseline the CHT replaces (SGLang's LPM and DFS-weight orderings).

The tree is SGLang's ``RadixCache`` with page size 1, reduced to what ordering needs: nodes
hold token-id sequences, children are keyed by their first token, a match compares token by
token in Python (like ``_key_match_page_size1``) and splits the node it stops inside (like
``_match_prefix_helper``). It holds the tokens of the *active* batch, i.e. the same working set
as the CHT; a finished request's tokens leave the tree (SGLang would keep them as cache until
eviction; here the point of comparison is the batch).

Orderings (SGLang's ``python/sglang/srt/managers/schedule_policy.py``; DFS-weight's walk is
``_dfs_weight_order`` in ``python/sglang/srt/mem_cache/base_prefix_cache.py``):

* ``"lpm"``, longest prefix match: every waiting request is matched against the tree and the
  longest match wins, earliest inserted among ties (SGLang sorts stably by ``-matched``). When
  more than ``lpm_fcfs_fallback`` requests wait, SGLang skips the matching and serves FCFS
  (it uses 128); ``None`` disables that. SGLang's in-batch deprioritization of requests whose
  short cache match is shared by another waiting request is not modelled.
* ``"dfs-weight"``: every waiting request is matched; its *last node* is where its match ends.
  A node's weight is the number of waiting requests whose last node lies in its subtree. The
  order is a depth-first walk that visits children in descending weight (ties in the children
  dict's order, as SGLang's stable sort), emitting a node's own requests after its children's.
  The candidate is the first request of that order. With an empty batch every match ends at
  the root, so it is the earliest inserted request. SGLang has no FCFS fallback for it.

Both report :class:`~scheduler_runtime.prefix_index.Candidate` fields in chunks with the CHT's
definition, derived from token match lengths, so the two structures can be compared field by
field. ``w`` is read from a second radix tree over the waiting requests (counts of requests per
node, like SGLang's ``waiting_queue_radix_tree``), walked node by node, not token by token.
Cost: one decision matches every waiting request, so it grows with W x matched prompt length;
that is what the CHT avoids.
"""

from __future__ import annotations

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

__all__ = ["RadixTree"]

Ordering = Literal["lpm", "dfs-weight"]


class _Node:
    """A radix node: a run of tokens, children by first token, and request counts."""

    __slots__ = ("children", "parent", "key", "ref", "ends")

    def __init__(self, key: list[int], parent: _Node | None) -> None:
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.key = key
        self.ref = 0  # requests whose tokens pass through this whole node
        self.ends = 0  # requests whose tokens end exactly at this node's last token


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
    upper.children = {child.key[split_len]: child}
    # Same dict key as before, so the parent's children keep their order.
    parent.children[child.key[0]] = upper
    child.key = child.key[split_len:]
    child.parent = upper
    return upper


def _match(root: _Node, key: list[int]) -> tuple[int, _Node]:
    """Match ``key`` against the tree; (matched tokens, node where the match ends).

    Splits the node the match stops inside, so the end is always a node boundary.
    """
    node = root
    matched = 0
    while len(key) > 0 and key[0] in node.children:
        child = node.children[key[0]]
        prefix_len = _key_match(child.key, key)
        matched += prefix_len
        if prefix_len < len(child.key):
            node = _split(child, prefix_len)
            break
        node = child
        key = key[prefix_len:]
    return matched, node


def _add(root: _Node, key: list[int]) -> None:
    """Insert ``key``, counting one more request through each node on its path."""
    node = root
    pos = 0
    while pos < len(key):
        child = node.children.get(key[pos])
        if child is None:
            leaf = _Node(key[pos:], node)
            leaf.ref = 1
            leaf.ends = 1
            node.children[key[pos]] = leaf
            return
        prefix_len = _key_match(child.key, key[pos:])
        if prefix_len < len(child.key):
            child = _split(child, prefix_len)
        child.ref += 1
        pos += prefix_len
        node = child
    node.ends += 1


def _discard(root: _Node, key: list[int]) -> None:
    """Undo ``_add(root, key)``; nodes no request passes through any more are dropped."""
    node = root
    pos = 0
    while True:
        first = key[pos]
        child = node.children[first]
        child.ref -= 1
        pos += len(child.key)
        if child.ref == 0:
            # Its whole subtree counts at most child.ref requests, so it is empty too.
            del node.children[first]
            return
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
    """

    def __init__(
        self,
        ordering: Ordering,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        lpm_fcfs_fallback: int | None = 128,
    ) -> None:
        if ordering not in ("lpm", "dfs-weight"):
            raise ValueError(f"ordering must be 'lpm' or 'dfs-weight', got {ordering!r}")
        if lpm_fcfs_fallback is not None and lpm_fcfs_fallback < 0:
            raise ValueError(f"lpm_fcfs_fallback must be >= 0 or None, got {lpm_fcfs_fallback}")
        self.ordering: Ordering = ordering
        self.chunk_size = check_chunk_size(chunk_size)
        self.lpm_fcfs_fallback = lpm_fcfs_fallback
        self._root = _Node([], None)  # active batch's tokens
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
            req, matched = self._lpm_choice()
        else:
            order, reqs, matched_lens = self._dfs_weight_ranking()
            req, matched = reqs[order[0]], matched_lens[order[0]]
        return self._candidate(req, matched)

    def dfs_weight_order(self) -> list[str]:
        """All waiting ids in SGLang's DFS-weight order (the first one is the candidate)."""
        order, reqs, _ = self._dfs_weight_ranking()
        return [reqs[i].request_id for i in order]

    def match_length(self, request_id: str) -> int:
        """Tokens of a waiting request's prompt that match the active batch's tree."""
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
        _add(self._root, req.tokens)
        self._active[request_id] = req
        self._shared = None

    def finish(self, request_id: str) -> None:
        """Drop an active request that completed (UnknownRequestError if not active)."""
        req = self._active.pop(request_id, None)
        if req is None:
            raise UnknownRequestError(self._state_message(request_id, "active"))
        _discard(self._root, req.tokens)
        self._shared = None

    def remove(self, request_id: str) -> None:
        """Abort a waiting or active request (UnknownRequestError if neither)."""
        if request_id in self._active:
            self.finish(request_id)
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
        """True when neither tree holds any node (everything finished or removed)."""
        return not self._root.children and not self._waiting_root.children

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._waiting or request_id in self._active

    def __len__(self) -> int:
        return len(self._waiting) + len(self._active)

    # ------------------------------------------------------------------ internals

    def _lpm_choice(self) -> tuple[_Request, int]:
        fallback = self.lpm_fcfs_fallback
        if fallback is not None and len(self._waiting) > fallback:
            req = next(iter(self._waiting.values()))
            return req, _match(self._root, req.tokens)[0]
        best: _Request | None = None
        best_len = -1
        for req in self._waiting.values():
            matched, _ = _match(self._root, req.tokens)
            if matched > best_len:
                best, best_len = req, matched
        assert best is not None
        return best, best_len

    def _dfs_weight_ranking(self) -> tuple[list[int], list[_Request], list[int]]:
        reqs = list(self._waiting.values())
        last_nodes: list[_Node] = []
        matched_lens: list[int] = []
        for req in reqs:
            matched, node = _match(self._root, req.tokens)
            matched_lens.append(matched)
            last_nodes.append(node)
        return _dfs_weight_order(self._root, last_nodes), reqs, matched_lens

    def _shared_prefix(self) -> tuple[int, bool]:
        """(tokens every active request shares, whether they are all that long exactly)."""
        if self._shared is None:
            n_active = len(self._active)
            node = self._root
            depth = 0
            while True:
                nxt = next((c for c in node.children.values() if c.ref == n_active), None)
                if nxt is None:
                    break
                depth += len(nxt.key)
                node = nxt
            self._shared = (depth, depth > 0 and node.ends == n_active)
        return self._shared

    def _candidate(self, req: _Request, matched: int) -> Candidate:
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
