"""Chunked Hash Tree (CHT): Feather's index for picking the next request of a batch cheaply.

Each request is a vector ``H[0..L-1]`` of cumulative hashes of its token ids, one per chunk of
``chunk_size`` tokens (the last one may be partial), so ``L = ceil(n / chunk_size)``. Key
``(k, H[k])`` stands for the first ``k + 1`` chunks. Because the hash is cumulative, the keys
of one request form a chain, and the keys held by the active batch (the *working set*) are
closed under prefixes; every depth below is therefore a prefix length, found by binary search.

The structure keeps, exactly as ``docs/design.md`` describes:

* per request its hash vector (and the integer ids of its keys);
* the working set: a reference count per key (how many active requests hold it);
* an inverted index key -> waiting requests that hold the key (entries of requests that stopped
  waiting are skipped when read and purged lazily);
* per waiting request its *missing count* (keys not in the working set);
* a min-heap of ``(missing, insertion seq, slot)`` with lazy deletion (packed in one int);
* the shared prefix depth of the active batch (cached, recomputed by binary search).

``best_candidate()`` returns the waiting request with the fewest missing keys, earliest
inserted first among ties. With an empty batch every key is missing, so it is the prompt with
the fewest chunks (the shortest); that is the paper's rule and is kept on purpose: a batching
policy that wants another opener can pick one itself.

Cost. ``best_candidate`` is a heap peek (O(log W) amortized over the stale entries it pops) plus
two binary searches. ``activate``/``finish`` update the holder counts of the request's L keys
(a list, in a loop over its L key ids: a prompt's keys are few, one per chunk, and a numpy call
on so small an array costs more than the loop, several times more inside an engine step, whose
caches the model's forward pass has flushed), and then touch only the waiting requests that
share the first key that enters (or leaves) the working set: those are the only ones whose
missing count changes, and because keys are chained, the number of newly shared keys of each is
found with one gather of their hash rows (or a vectorized binary search when that gather would
be large). No Python loop runs per token or per waiting request (but a heap push per holder
whose missing count changed); Python loops run per chunk at insert (hashing, key lookup), at
activate/finish/remove (holder counts) and over shared keys that stop existing (a prompt's
unique tail is freed without per-key dict work: see ``_tail_owner``). Memory: one ``uint64``
row of ``max L`` hashes per request slot, and its L key ids.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np
import xxhash

from scheduler_runtime.prefix_index import (
    DEFAULT_CHUNK_SIZE,
    Candidate,
    DuplicateRequestError,
    UnknownRequestError,
    as_token_array,
    check_chunk_size,
)

__all__ = ["DEFAULT_CHUNK_SIZE", "ChunkedHashTree"]

# Inverted-index entries pack a request's slot and its insertion number (``seq``, never reused),
# so an entry left behind by a request since activated or removed is recognised as stale
# without finding and deleting it eagerly (a Python operation per key per activation). Limits:
# 2**24 requests held at once, 2**39 inserts over an index's life; packed, they fit an int64.
_SLOT_BITS = 24
_SLOT_MASK = (1 << _SLOT_BITS) - 1
_SEQ_BITS = 39
_SEQ_MASK = (1 << _SEQ_BITS) - 1
# Heap entries: missing count above the insertion number above the slot.
_MISSING_SHIFT = _SLOT_BITS + _SEQ_BITS
# Above this many hash comparisons, count shared keys by vectorized binary search instead of
# one dense gather: log(L) passes over the slots beat one pass over slots x L hashes.
_DENSE_GATHER_LIMIT = 1 << 14
# Per-key holder counts pack the active count above the waiting count.
_ACTIVE = 1 << 32
_WAITING = _ACTIVE - 1


class _Request:
    """One request's data: its slot (row in the per-slot arrays), hashes and key ids."""

    __slots__ = ("request_id", "seq", "slot", "hashes", "kids", "num_keys", "registered", "waiting",
                 "missing")

    def __init__(
        self,
        request_id: str,
        seq: int,
        slot: int,
        hashes: np.ndarray,
        kids: list[int],
        registered: int,
    ) -> None:
        self.request_id = request_id
        self.seq = seq
        self.slot = slot
        self.hashes = hashes
        self.kids = kids  # a list: one request's keys are few, and list items are cheap to read
        self.num_keys = len(kids)
        # While waiting: whether it is (the slot's _is_waiting) and its missing count (the
        # slot's _missing), also kept here: reading a numpy item costs more than an attribute.
        self.waiting = True
        self.missing = 0
        # Keys of levels < registered are in the key dict; deeper ones are this request's
        # private tail (see ChunkedHashTree._tail_owner).
        self.registered = registered


class ChunkedHashTree:
    """Feather's Chunked Hash Tree over waiting and active requests (see the module docstring).

    Args:
        chunk_size: tokens per chunk (>= 1). Depths, ``delta`` and ``w`` are in chunks.
    """

    def __init__(self, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        self.chunk_size = check_chunk_size(chunk_size)
        self._waiting: dict[str, _Request] = {}
        self._active: dict[str, _Request] = {}
        self._next_seq = 0
        # Every key has a small integer id (kid), so that per-key counters are numpy arrays
        # that a whole request's keys update in one vectorized operation. A key is (level, hash),
        # encoded as the int ``level << 64 | hash`` (a bijection, cheaper to hash than a tuple).
        #
        # The dict finds the kid of a key for later inserts. Keys only one request holds are
        # mostly the unique tail of a prompt, and deleting each of them from a large dict when
        # the request finishes was the largest cost of a decision; so a new prompt registers
        # only its first new key, and the rest stay its private tail, reachable through
        # _tail_owner[kid of the last registered key] (at most one private tail hangs below any
        # key). An insert that misses the dict compares its next hash with that tail and, where
        # they agree, registers the tail's keys then: the index stays exact.
        self._key_to_kid: dict[int, int] = {}
        self._kid_key: list[int] = []
        self._tail_owner: list[_Request | None] = []
        self._inv: list[list[int]] = []  # kid -> packed (slot, seq) of waiting holders
        self._free_kids: list[int] = []
        # kid -> holders, packed as ``active * _ACTIVE + waiting``: the active count is the
        # working set's reference count. One number, so activate() updates both at once. A list:
        # a request's keys are few (one per chunk), and per-key list updates in a loop cost less
        # than a numpy call on a small array, several times less in an engine step, whose caches
        # the model's forward pass has flushed. (Not for very long prompts: at 256 keys, a 32K-
        # token prompt, the loop costs about twice what the numpy calls did, in a warm loop.)
        self._count: list[int] = []
        # Per-slot state; a slot is a request's row for its whole life (waiting then active).
        self._slot_req: list[_Request | None] = []
        self._free_slots: list[int] = []
        self._is_waiting = np.zeros(0, dtype=bool)
        self._missing = np.zeros(0, dtype=np.int64)
        self._seq = np.zeros(0, dtype=np.int64)
        # Row per slot: the request's hashes, zero-padded. Real hashes are odd, so padding never
        # equals one and a row compares as "not shared" past the end of its prompt.
        self._hmat = np.zeros((0, 0), dtype=np.uint64)
        self._heap: list[int] = []  # _heap_entry(missing, seq, slot)
        self._shared_depth: int | None = 0
        # The last best_candidate() answer: activating that request right after (the common
        # case) sets the new shared depth to its depth_after without another binary search.
        self._last_candidate: tuple[str, int] | None = None

    # ----------------------------------------------------------------- public API

    def insert(self, request_id: str, token_ids: np.ndarray | Sequence[int]) -> None:
        """Add a waiting request.

        Raises:
            DuplicateRequestError: ``request_id`` is already waiting or active.
            ValueError: the prompt is empty or not a 1-D array of ids in ``[0, 2**31)``.
        """
        if request_id in self._waiting or request_id in self._active:
            raise DuplicateRequestError(f"request {request_id!r} is already in the index")
        self.insert_hashed(request_id, self.hash_prompt(token_ids))

    def hash_prompt(self, token_ids: np.ndarray | Sequence[int]) -> np.ndarray:
        """The cumulative chunk hashes :meth:`insert` keys a prompt by (for :meth:`insert_hashed`).

        Raises:
            ValueError: the prompt is empty or not a 1-D array of ids in ``[0, 2**31)``.
        """
        return self._hash_tokens(as_token_array(token_ids))

    def insert_hashed(self, request_id: str, hashes: np.ndarray) -> None:
        """:meth:`insert` with the prompt's :meth:`hash_prompt` already computed (by this tree's
        chunk size), for callers that insert the same prompts again (the environment's episodes).

        Raises:
            DuplicateRequestError: ``request_id`` is already waiting or active.
            ValueError: ``hashes`` is not a non-empty 1-D uint64 array.
        """
        if request_id in self._waiting or request_id in self._active:
            raise DuplicateRequestError(f"request {request_id!r} is already in the index")
        if not isinstance(hashes, np.ndarray) or hashes.dtype != np.uint64 or hashes.ndim != 1 \
                or hashes.size == 0:
            raise ValueError("hashes must be a non-empty 1-D uint64 array from hash_prompt()")
        num_keys = len(hashes)
        slot = self._alloc_slot(num_keys)
        seq = self._next_seq
        self._next_seq += 1
        packed = slot | (seq << _SLOT_BITS)
        # Set before the key loop: a purge inside it must keep this request's entries.
        self._is_waiting[slot] = True
        self._seq[slot] = seq

        key_to_kid = self._key_to_kid
        tail_owner = self._tail_owner
        inv = self._inv
        hash_list = hashes.tolist()
        kid_list: list[int] = []
        # Keys that some request already holds: registered, or in the private tail below the
        # previous key (which then becomes registered).
        parent = -1
        level = 0
        while level < num_keys:
            h = hash_list[level]
            key = (level << 64) | h
            kid = key_to_kid.get(key)
            if kid is None:
                owner = tail_owner[parent] if parent >= 0 else None
                if owner is None or int(owner.hashes[level]) != h:
                    break
                kid = owner.kids[level]
                self._register_tail_key(owner, level, parent, kid, key)
            holders = inv[kid]
            holders.append(packed)
            # Stale entries (of requests since activated) are dropped lazily; bound them here so
            # a long-lived key (a system prompt) does not grow without limit.
            if len(holders) > 32 and len(holders) > 4 * (self._count[kid] & _WAITING) + 4:
                self._purge_holders(kid)
            kid_list.append(kid)
            parent = kid
            level += 1
        registered = num_keys
        if level < num_keys:
            # The prompt diverges here from every request in the index, so this key and all
            # deeper ones are new: register the first, keep the rest as the private tail.
            registered = level + 1
            for depth in range(level, num_keys):
                kid = self._new_kid((depth << 64) | hash_list[depth], register=depth == level)
                inv[kid].append(packed)
                kid_list.append(kid)
        # Working set is prefix-closed, so the keys already held are exactly a prefix.
        count = self._count
        covered = 0
        for kid in kid_list:
            c = count[kid]
            if c >= _ACTIVE:
                covered += 1
            count[kid] = c + 1
        req = _Request(request_id, seq, slot, hashes, kid_list, registered)
        if registered < num_keys:
            tail_owner[kid_list[registered - 1]] = req
        self._slot_req[slot] = req
        self._missing[slot] = req.missing = num_keys - covered
        self._hmat[slot, :num_keys] = hashes
        self._hmat[slot, num_keys:] = 0
        self._waiting[request_id] = req
        heapq.heappush(self._heap, _heap_entry(num_keys - covered, seq, slot))

    def best_candidate(self) -> Candidate | None:
        """The waiting request with the fewest missing keys (earliest inserted among ties).

        It stays in the queue: ``activate`` moves it. None when nothing is waiting.
        """
        heap, slot_req = self._heap, self._slot_req
        while heap:  # the heap's top, its stale entries dropped
            entry = heap[0]
            # the slot's _is_waiting, _seq and _missing, as its request keeps them
            req = slot_req[entry & _SLOT_MASK]
            if (
                req is not None
                and req.waiting
                and req.seq == (entry >> _SLOT_BITS) & _SEQ_MASK
                and req.missing == entry >> _MISSING_SHIFT
            ):
                return self._candidate(req)
            heapq.heappop(heap)
        return None

    def candidate(self, request_id: str) -> Candidate:
        """What adding waiting request ``request_id`` would do to the batch (any waiting request,
        not only the best: the baselines' candidates are observed with the same definition).

        Raises:
            UnknownRequestError: it is not waiting.
        """
        req = self._waiting.get(request_id)
        if req is None:
            raise UnknownRequestError(self._state_message(request_id, "waiting"))
        return self._candidate(req)

    def _candidate(self, req: _Request) -> Candidate:
        # the hot path of every decision: shared_depth's cached value, and the largest k with
        # a[:k] == b[:k] by binary search (chained keys: equality is prefix-closed), inline
        depth_before = self._shared_depth
        if depth_before is None:
            depth_before = self.shared_depth
        if not self._active:
            depth_after = req.num_keys
        else:
            a, b = req.kids, next(iter(self._active.values())).kids
            lo, hi = 0, min(depth_before, req.num_keys)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if a[mid - 1] == b[mid - 1]:
                    lo = mid
                else:
                    hi = mid - 1
            depth_after = lo
        if depth_after:
            w = (self._count[req.kids[depth_after - 1]] & _WAITING) - 1
        else:
            w = len(self._waiting) - 1
        self._last_candidate = (req.request_id, depth_after)
        return Candidate(req.request_id, depth_before, depth_after, w)

    def activate(self, request_id: str) -> None:
        """Move a waiting request into the active batch.

        Raises:
            UnknownRequestError: ``request_id`` is not waiting.
        """
        req = self._waiting.pop(request_id, None)
        if req is None:
            raise UnknownRequestError(self._state_message(request_id, "waiting"))
        slot = req.slot
        covered = req.num_keys - req.missing
        self._is_waiting[slot] = False
        req.waiting = False
        kids = req.kids
        count = self._count
        for kid in kids:
            count[kid] += _ACTIVE - 1  # one more active holder, one fewer waiting
        self._active[request_id] = req
        last = self._last_candidate
        self._shared_depth = last[1] if last is not None and last[0] == request_id else None
        self._last_candidate = None
        # Keys [covered, L) just entered the working set; a waiting request shares some of
        # them iff it holds the first one (keys are chained), so most activations stop here.
        if covered < req.num_keys and count[kids[covered]] & _WAITING:
            self._shift_missing(req, covered, -1)
        if not self._waiting:
            self._heap.clear()

    def finish(self, request_id: str) -> None:
        """Drop an active request that completed.

        Raises:
            UnknownRequestError: ``request_id`` is not active.
        """
        req = self._active.pop(request_id, None)
        if req is None:
            raise UnknownRequestError(self._state_message(request_id, "active"))
        self._last_candidate = None
        count = self._count
        # Along one request's chain both holder counts shrink with depth, so the keys still in
        # the working set (an active holder left) form a prefix, and so do the keys that anyone
        # still holds: count both in one pass (prompts are a few keys long at the usual chunk).
        covered = alive = 0
        for kid in req.kids:
            c = count[kid] - _ACTIVE
            count[kid] = c
            if c:
                alive += 1
                if c >= _ACTIVE:
                    covered += 1
        self._shared_depth = None if self._active else 0
        if covered < alive:  # key ``covered`` has holders, all waiting: they miss it again
            self._shift_missing(req, covered, +1)
        if alive < req.num_keys:
            self._forget_keys(req, alive)
        self._slot_req[req.slot] = None  # _free_slot, inline
        self._free_slots.append(req.slot)

    def remove(self, request_id: str) -> None:
        """Abort a request, waiting or active.

        Raises:
            UnknownRequestError: ``request_id`` is neither waiting nor active.
        """
        if request_id in self._active:
            self.finish(request_id)
            return
        req = self._waiting.pop(request_id, None)
        if req is None:
            raise UnknownRequestError(self._state_message(request_id, "waiting or active"))
        self._last_candidate = None
        slot = req.slot
        self._is_waiting[slot] = False
        req.waiting = False
        count = self._count
        alive = 0
        for kid in req.kids:
            c = count[kid] - 1
            count[kid] = c
            if c:
                alive += 1  # a prefix, as in finish
        if alive < req.num_keys:
            self._forget_keys(req, alive)
        self._slot_req[slot] = None  # _free_slot, inline
        self._free_slots.append(slot)
        if not self._waiting:
            self._heap.clear()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_keys(self) -> int:
        """Distinct keys held by any waiting or active request (0 once everything is gone)."""
        return len(self._kid_key) - len(self._free_kids)

    @property
    def shared_depth(self) -> int:
        """Largest k such that every active request has the same first k chunks (0 if none)."""
        if self._shared_depth is None:
            # A key of the reference request is shared by the whole batch iff all active
            # requests hold it; that predicate holds on a prefix of levels: binary search.
            ref = next(iter(self._active.values()))
            n_active = len(self._active)
            count, kids = self._count, ref.kids
            everyone = n_active * _ACTIVE  # a key held by all active requests counts >= this
            lo, hi = 0, ref.num_keys
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if count[kids[mid - 1]] >= everyone:
                    lo = mid
                else:
                    hi = mid - 1
            self._shared_depth = lo
        return self._shared_depth

    def waiting_ids(self) -> list[str]:
        """Waiting request ids in insertion order."""
        return list(self._waiting)

    def active_ids(self) -> list[str]:
        """Active request ids in activation order."""
        return list(self._active)

    def missing_count(self, request_id: str) -> int:
        """Keys of the request not held by the active batch (0 for an active request)."""
        req = self._waiting.get(request_id)
        if req is not None:
            return req.missing
        if request_id in self._active:
            return 0
        raise UnknownRequestError(self._state_message(request_id, "waiting or active"))

    def hash_vector(self, request_id: str) -> np.ndarray:
        """A copy of the request's cumulative chunk hashes ``H[0..L-1]`` (``uint64``)."""
        req = self._waiting.get(request_id) or self._active.get(request_id)
        if req is None:
            raise UnknownRequestError(self._state_message(request_id, "waiting or active"))
        return req.hashes.copy()

    def prefix_hash(self, request_id: str, chunks: int) -> int:
        """The request's cumulative hash of its first ``chunks`` chunks (of its whole prompt when
        it is shorter): equal for two requests exactly when those chunks are equal."""
        req = self._waiting.get(request_id) or self._active.get(request_id)
        if req is None:
            raise UnknownRequestError(self._state_message(request_id, "waiting or active"))
        return int(req.hashes[min(chunks, len(req.hashes)) - 1])

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._waiting or request_id in self._active

    def __len__(self) -> int:
        return len(self._waiting) + len(self._active)

    def check_consistency(self) -> None:
        """Recompute every counter from the per-request vectors; AssertionError on mismatch.

        O(total keys); for tests and debugging, not for the scheduling path.
        """
        rc: dict[int, int] = {}
        cntw: dict[int, int] = {}
        for req in self._active.values():
            for kid in req.kids:
                rc[kid] = rc.get(kid, 0) + 1
        for req in self._waiting.values():
            for kid in req.kids:
                cntw[kid] = cntw.get(kid, 0) + 1
        live = set(rc) | set(cntw)
        for kid in live:
            packed = self._count[kid]
            assert packed >> 32 == rc.get(kid, 0), f"refcount of key {kid}"
            assert packed & _WAITING == cntw.get(kid, 0), f"waiting count of key {kid}"
        dead = [k for k in range(len(self._kid_key)) if k not in live]
        assert sorted(self._free_kids) == dead, "leftover or lost key ids"
        assert not any(self._count[k] for k in dead), "counts on freed keys"
        # Exactly the keys of levels < registered are findable, each under one kid; a private
        # tail key has its owner as only holder and hangs below the owner's last registered key.
        findable: dict[int, int] = {}
        owners: dict[int, _Request] = {}
        for req in (*self._waiting.values(), *self._active.values()):
            assert 1 <= req.registered <= req.num_keys
            kids = req.kids
            for level, h in enumerate(req.hashes.tolist()):
                key, kid = (level << 64) | h, kids[level]
                assert self._kid_key[kid] == key, "key of a key id"
                if level < req.registered:
                    assert findable.setdefault(key, kid) == kid, "one key, two ids"
                else:
                    assert key not in self._key_to_kid, "private key registered"
                    assert rc.get(kid, 0) + cntw.get(kid, 0) == 1, "private key shared"
            if req.registered < req.num_keys:
                assert kids[req.registered - 1] not in owners, "two private tails below a key"
                owners[kids[req.registered - 1]] = req
        assert findable == self._key_to_kid, "key dict"
        for kid in live:
            assert self._tail_owner[kid] is owners.get(kid), "private tail owner"
        for req in self._waiting.values():
            assert req.waiting, "waiting flag"
            held = sum(1 for kid in req.kids if rc.get(kid, 0) > 0)
            assert int(self._missing[req.slot]) == req.num_keys - held, "missing count"
            assert req.missing == int(self._missing[req.slot]), "missing count of the request"
            entry = _heap_entry(int(self._missing[req.slot]), req.seq, req.slot)
            assert entry in self._heap, "heap entry"
        live_slots = {r.slot for r in self._waiting.values()} | {
            r.slot for r in self._active.values()
        }
        assert int(self._is_waiting.sum()) == len(self._waiting)
        assert sum(r is not None for r in self._slot_req) == len(live_slots)
        if not self._waiting:
            assert not self._heap, "heap not empty with no waiting request"

    # ------------------------------------------------------------------ internals

    def _hash_tokens(self, tokens: np.ndarray) -> np.ndarray:
        """Cumulative chunk hashes: xxh3 of each chunk's bytes, seeded with the previous one.

        One C call per chunk, none per token (a 32K-token prompt is 64 calls at 512 tokens).
        The low bit is forced to 1 so that 0 can pad the hash matrix (see ``_hmat``).
        """
        data = memoryview(tokens.tobytes())
        step = 4 * self.chunk_size
        digest = xxhash.xxh3_64_intdigest
        out = []
        h = 0
        for start in range(0, len(data), step):
            h = digest(data[start : start + step], h) | 1
            out.append(h)
        return np.array(out, dtype=np.uint64)

    def _shift_missing(self, req: _Request, start: int, sign: int) -> None:
        """Keys ``start..L-1`` of ``req`` entered (sign -1) or left (+1) the working set.

        A waiting request shares some of those keys iff it holds key ``start`` (keys are
        chained), and then it shares a prefix of them: count it per holder and shift the
        holders' missing counts by that amount. Callers check that key ``start`` has holders.
        """
        slots = self._waiting_holders(req.kids[start])
        stop = req.num_keys
        span = stop - start
        if len(slots) * span <= _DENSE_GATHER_LIMIT:
            shared = np.count_nonzero(self._hmat[slots, start:stop] == req.hashes[start:], axis=1)
        else:
            shared = self._shared_levels_bsearch(slots, req.hashes, start, stop)
        self._missing[slots] += sign * shared
        heap, slot_req = self._heap, self._slot_req
        for m, q, slot in zip(
            self._missing[slots].tolist(), self._seq[slots].tolist(), slots.tolist(), strict=True
        ):
            slot_req[slot].missing = m
            heapq.heappush(heap, _heap_entry(m, q, slot))
        # Every shift leaves one stale entry behind per holder; rebuild once they dominate.
        if len(heap) > 2 * len(self._waiting) + 64:
            self._rebuild_heap()

    def _shared_levels_bsearch(
        self, slots: np.ndarray, hashes: np.ndarray, start: int, stop: int
    ) -> np.ndarray:
        """Per slot, how many of levels ``start..stop-1`` equal ``hashes`` (all match at start).

        Vectorized binary search for the first mismatch; valid because matches form a prefix.
        """
        lo = np.full(len(slots), start + 1, dtype=np.int64)  # levels < lo are known to match
        hi = np.full(len(slots), stop, dtype=np.int64)
        hmat = self._hmat
        while True:
            todo = lo < hi
            if not todo.any():
                break
            mid = (lo + hi + 1) // 2
            probe = np.where(todo, mid - 1, start)
            ok = hmat[slots, probe] == hashes[probe]
            lo = np.where(todo & ok, mid, lo)
            hi = np.where(todo & ~ok, mid - 1, hi)
        return lo - start

    def _waiting_holders(self, kid: int) -> np.ndarray:
        """Slots of the waiting requests holding key ``kid`` (dropping stale entries)."""
        packed = np.array(self._inv[kid], dtype=np.int64)
        slots = packed & _SLOT_MASK
        valid = self._is_waiting[slots] & (self._seq[slots] == (packed >> _SLOT_BITS))
        if not valid.all():
            self._inv[kid] = packed[valid].tolist()
            slots = slots[valid]
        return slots

    def _purge_holders(self, kid: int) -> None:
        self._waiting_holders(kid)

    def _forget_keys(self, req: _Request, alive: int) -> None:
        """Drop ``req``'s keys of levels >= ``alive``, which nobody holds any more.

        Keys held by anyone else are registered, so ``alive <= req.registered``: only the
        registered dead keys cost a dict deletion, the private tail just frees its ids.
        """
        kids = req.kids
        if alive < req.registered:
            key_to_kid, kid_key = self._key_to_kid, self._kid_key
            for kid in kids[alive : req.registered]:
                del key_to_kid[kid_key[kid]]
        if req.registered < req.num_keys:
            self._tail_owner[kids[req.registered - 1]] = None
        self._free_kids.extend(kids[alive:])

    def _register_tail_key(
        self, owner: _Request, level: int, parent: int, kid: int, key: int
    ) -> None:
        """Another prompt shares ``owner``'s private key at ``level``: make it findable."""
        self._key_to_kid[key] = kid
        owner.registered = level + 1
        self._tail_owner[parent] = None
        if level + 1 < owner.num_keys:
            self._tail_owner[kid] = owner

    def _new_kid(self, key: int, register: bool) -> int:
        if self._free_kids:
            kid = self._free_kids.pop()
            self._kid_key[kid] = key
            self._inv[kid] = []
            self._tail_owner[kid] = None
        else:
            kid = len(self._kid_key)
            self._kid_key.append(key)
            self._inv.append([])
            self._tail_owner.append(None)
            self._count.append(0)
        if register:
            self._key_to_kid[key] = kid
        return kid

    def _alloc_slot(self, num_keys: int) -> int:
        if num_keys > self._hmat.shape[1]:
            cols = max(num_keys, 2 * self._hmat.shape[1])
            grown = np.zeros((self._hmat.shape[0], cols), dtype=np.uint64)
            grown[:, : self._hmat.shape[1]] = self._hmat
            self._hmat = grown
        if self._free_slots:
            return self._free_slots.pop()
        slot = len(self._slot_req)
        if slot > _SLOT_MASK:
            raise OverflowError(f"more than {_SLOT_MASK + 1} requests in one index")
        self._slot_req.append(None)
        if slot >= len(self._missing):
            cap = max(64, 2 * len(self._missing))
            self._is_waiting = _grow(self._is_waiting, cap)
            self._missing = _grow(self._missing, cap)
            self._seq = _grow(self._seq, cap)
            grown = np.zeros((cap, self._hmat.shape[1]), dtype=np.uint64)
            grown[: self._hmat.shape[0]] = self._hmat
            self._hmat = grown
        return slot

    def _free_slot(self, slot: int) -> None:
        # The next occupant gets a new seq, which invalidates this one's index entries.
        self._slot_req[slot] = None
        self._free_slots.append(slot)

    def _rebuild_heap(self) -> None:
        slots = np.flatnonzero(self._is_waiting)
        self._heap = [
            _heap_entry(m, q, slot)
            for m, q, slot in zip(
                self._missing[slots].tolist(),
                self._seq[slots].tolist(),
                slots.tolist(),
                strict=True,
            )
        ]
        heapq.heapify(self._heap)

    def _state_message(self, request_id: str, wanted: str) -> str:
        if request_id in self._waiting:
            state = "waiting"
        elif request_id in self._active:
            state = "active"
        else:
            state = "unknown"
        return f"request {request_id!r} is {state}, expected {wanted}"


def _heap_entry(missing: int, seq: int, slot: int) -> int:
    """One int ordering like ``(missing, seq)``; ints compare about twice as fast as tuples."""
    return (missing << _MISSING_SHIFT) | (seq << _SLOT_BITS) | slot



def _grow(arr: np.ndarray, cap: int) -> np.ndarray:
    out = np.zeros(cap, dtype=arr.dtype)
    out[: len(arr)] = arr
    return out
