"""Random operation sequences against PagedKVCache (numpy backend, small shapes) and a plain-Python
model: extend / write / fork / free / swap / prefix reuse, plus failing calls.

After every step: block accounting (in use + evictable + free = all blocks, nothing in two
places, no block twice in a table), reference counts equal the number of tables holding each
block, fill counts, and the K/V of every token equals what the model says was written there.

The written value of a token is a function of its whole prefix of token ids (as in a real
model), so reusing a block from the prefix cache is right exactly when the prefixes agree.
Without prefix caching the model also predicts the allocator exactly: which blocks are shared
(up to renaming), how many are free, and when extend / swap_in must fail.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import cupa
from cupa.cache.blocks import OutOfBlocksError

# The smallest shapes PagedKVCache accepts (those cupa.decode serves).
LAYERS, BLOCKS, BLOCK_SIZE, HEAD_SIZE = 2, 12, 8, 64
MAX_NEW = 2 * BLOCK_SIZE + 2  # tokens per sequence and extend: 0 to 2 blocks and a bit
ALPHABET = 2  # few token ids, so that prefixes repeat and the prefix cache gets hits
SHARED_PROMPT = [1, 0, 1, 1, 0, 0, 1, 0, 0, 1, 1, 0, 1, 0, 0, 0, 1, 1]
# A new sequence's salt (tenant): prefixes of different salts must never share a block.
SALTS = [None, None, None, None, "tenant-a", b"tenant-b"]
STEPS = {"max_examples": 150, "stateful_step_count": 50}  # x 2 machines: ~14,000 steps
executed_steps = {"count": 0, "machines": 0}


def row_value(codes: np.ndarray, layer: int) -> np.ndarray:
    """K rows (last axis) of tokens whose prefixes have ids `codes` (exact in float32); their V
    rows are -K - 1."""
    return (codes * 8.0 + layer + np.arange(HEAD_SIZE) / 128).astype(np.float32)


def as_bytes(salt):
    return salt.encode() if isinstance(salt, str) else salt


def as_other_type(salt):
    """The same salt as str if bytes and as bytes if str (the cache takes str as UTF-8)."""
    if salt is None:
        return None
    return salt.decode() if isinstance(salt, bytes) else salt.encode()


class ModelSeq:
    def __init__(self):
        self.codes: list[int] = []       # prefix id of every token
        self.blocks: list[int] = []      # abstract block ids (exact model only)
        self.swapped = False
        self.cached_tokens = 0
        self.salt = None

    def copy(self):
        twin = ModelSeq()
        twin.codes, twin.blocks = list(self.codes), list(self.blocks)
        twin.salt = self.salt  # a fork keeps its parent's salt
        twin.cached_tokens = self.cached_tokens  # a fork inherits its parent's history
        return twin


class CacheMachine(RuleBasedStateMachine):
    prefix_caching = False

    def __init__(self):
        super().__init__()
        executed_steps["machines"] += 1  # the invariants also run once before the first step
        self.cache = cupa.PagedKVCache(LAYERS, BLOCKS, BLOCK_SIZE, 1, HEAD_SIZE, "float32",
                                       backend="numpy",
                                       enable_prefix_caching=self.prefix_caching)
        self.seqs: dict[int, ModelSeq] = {}
        self.prefix_ids: dict[tuple, int] = {}  # (parent code, token) -> code
        self.refs: dict[int, int] = {}          # abstract block -> users (exact model)
        self.next_block = 0
        self.next_seq = 0

    # --- model helpers ---------------------------------------------------------------------

    def code_after(self, parent: int, token: int) -> int:
        return self.prefix_ids.setdefault((parent, token), len(self.prefix_ids) + 1)

    def root_code(self, salt) -> int:
        """Prefix id of the empty prefix under a salt: str salts are their UTF-8 bytes."""
        return 0 if salt is None else self.code_after(0, ("salt", as_bytes(salt)))

    def new_block(self) -> int:
        self.next_block += 1
        self.refs[self.next_block] = 1
        return self.next_block

    def model_free(self) -> int:
        return BLOCKS - len(self.refs)

    def on_device(self):
        return sorted(s for s, m in self.seqs.items() if not m.swapped)

    def snapshot(self):
        alloc = self.cache._allocator
        return ({s: (self.cache.seq_len(s), None if m.swapped else
                     self.cache.block_table(s).tolist()) for s, m in self.seqs.items()},
                alloc.refcount.copy(), alloc.fill.copy(), alloc.free_blocks(),
                alloc.evictable_blocks(), self.cache._keys.copy(), self.cache._values.copy())

    def assert_unchanged(self, before):
        after = self.snapshot()
        assert before[0] == after[0] and before[3:5] == after[3:5]
        for a, b in zip(before[1:3] + before[5:], after[1:3] + after[5:]):
            assert np.array_equal(a, b)

    def plan_exact(self, ids, counts):
        """Model extend (no prefix caching): new abstract tables and refs, or None if it must
        fail. Works on copies; the caller commits."""
        refs, seqs, needed = dict(self.refs), {}, 0
        for s, n in zip(ids, counts):
            m = self.seqs[s].copy() if s in self.seqs else ModelSeq()
            length = len(m.codes)
            if n and length % BLOCK_SIZE and refs[m.blocks[-1]] > 1:
                refs[m.blocks[-1]] -= 1
                m.blocks[-1] = ("new", len(seqs), "cow")
                needed += 1
            fresh = -(-(length + n) // BLOCK_SIZE) - len(m.blocks)
            m.blocks += [("new", len(seqs), i) for i in range(fresh)]
            needed += fresh
            seqs[s] = m
        return (seqs, refs) if needed <= self.model_free() else None

    # --- rules -----------------------------------------------------------------------------

    @rule(data=st.data())
    def extend(self, data):
        existing = self.on_device()
        ids = data.draw(st.lists(st.sampled_from(existing), unique=True, max_size=3)
                        if existing else st.just([]))
        if not ids or data.draw(st.booleans()):
            ids.append(self.next_seq)
            self.next_seq += 1
        counts = data.draw(st.lists(st.integers(0, MAX_NEW), min_size=len(ids),
                                    max_size=len(ids)))
        # Two times in three a new sequence starts like the shared prompt, as chat requests do.
        tokens = [SHARED_PROMPT[:n] if s not in self.seqs and data.draw(st.integers(0, 2)) else
                  data.draw(st.lists(st.integers(0, ALPHABET - 1), min_size=n, max_size=n))
                  for s, n in zip(ids, counts)]
        with_ids = data.draw(st.sampled_from([True, True, True, False]))
        # New sequences draw a salt; existing ones repeat theirs (as str or bytes) or pass None.
        salts = [data.draw(st.sampled_from(SALTS)) if s not in self.seqs else
                 data.draw(st.sampled_from([None, self.seqs[s].salt, as_other_type(
                     self.seqs[s].salt)])) for s in ids]
        before = self.snapshot()
        exact = None if self.prefix_caching else self.plan_exact(ids, counts)
        try:
            slots = self.cache.extend(ids, counts, token_ids=tokens if with_ids else None,
                                      salts=salts)
        except OutOfBlocksError:
            self.assert_unchanged(before)
            if not self.prefix_caching:
                assert exact is None, "extend failed though the model had room"
            else:  # even with every token in a fresh block it had to fit otherwise
                assert self.worst_case_need(ids, counts) > self.cache.num_free_blocks
            for s in ids:
                assert s in self.seqs or s not in self.cache
            return
        assert self.prefix_caching or exact is not None, "extend succeeded beyond capacity"
        assert len(slots) == sum(counts)
        self.commit_extend(ids, counts, tokens, salts, slots, exact)

    def worst_case_need(self, ids, counts):
        alloc, need, users = self.cache._allocator, 0, {}
        for s, n in zip(ids, counts):
            length = self.cache.seq_len(s) if s in self.seqs else 0
            table = self.cache.block_table(s) if s in self.seqs else []
            if n and length % BLOCK_SIZE:
                last = int(table[-1])
                users.setdefault(last, int(alloc.refcount[last]))
                if users[last] > 1:
                    users[last] -= 1
                    need += 1
            need += -(-(length + n) // BLOCK_SIZE) - len(table)
        return need

    def commit_extend(self, ids, counts, tokens, salts, slots, exact):
        start = 0
        new_codes = []
        for s, n, toks, salt in zip(ids, counts, tokens, salts):
            if s not in self.seqs:
                self.seqs[s] = ModelSeq()
                self.seqs[s].salt = as_bytes(salt)
            m = self.seqs[s]
            if exact is not None:
                m.blocks = exact[0][s].blocks
            mine = slots[start:start + n]
            reused = int((mine < 0).sum())
            # Reused tokens: a leading run of whole blocks, never the last new token.
            assert (mine[:reused] < 0).all() and reused % BLOCK_SIZE == 0
            assert reused == 0 or (len(m.codes) % BLOCK_SIZE == 0 and reused < n)
            assert self.prefix_caching or reused == 0
            m.cached_tokens += reused
            for t in toks:
                m.codes.append(self.code_after(m.codes[-1] if m.codes else
                                               self.root_code(m.salt), t))
            new_codes += m.codes[len(m.codes) - n:]
            start += n
        if exact is not None:
            self.rename_new_blocks(exact)
        for layer in range(LAYERS):
            keys = row_value(np.asarray(new_codes, np.float32).reshape(-1, 1, 1), layer)
            self.cache.write(layer, slots, keys, -keys - 1)

    def rename_new_blocks(self, exact):
        seqs, refs = exact
        names = {}
        for m in self.seqs.values():
            m.blocks = [names.setdefault(b, self.new_block()) if isinstance(b, tuple) else b
                        for b in m.blocks]
        self.refs = {b: r for b, r in refs.items() if r > 0}
        self.refs.update({b: 1 for b in names.values()})

    @precondition(lambda self: self.on_device())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.on_device()))
        child = self.next_seq
        self.next_seq += 1
        self.cache.fork(parent, child)
        self.seqs[child] = self.seqs[parent].copy()
        for b in self.seqs[child].blocks:
            self.refs[b] += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(sorted(self.seqs)))
        self.cache.free(s)
        m = self.seqs.pop(s)
        if not m.swapped:
            self.drop_refs(m.blocks)
        with pytest.raises(KeyError, match=str(s)):
            self.cache.free(s)

    def drop_refs(self, blocks):
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]

    @precondition(lambda self: self.on_device())
    @rule(data=st.data())
    def swap_out(self, data):
        s = data.draw(st.sampled_from(self.on_device()))
        self.cache.swap_out(s)
        m = self.seqs[s]
        m.swapped = True
        self.drop_refs(m.blocks)
        m.blocks = []
        with pytest.raises(ValueError, match="swapped out"):
            self.cache.extend([s], 1)

    @precondition(lambda self: any(m.swapped for m in self.seqs.values()))
    @rule(data=st.data())
    def swap_in(self, data):
        s = data.draw(st.sampled_from(sorted(k for k, m in self.seqs.items() if m.swapped)))
        m = self.seqs[s]
        needed = -(-len(m.codes) // BLOCK_SIZE)
        before = self.snapshot()
        try:
            self.cache.swap_in(s)
        except OutOfBlocksError:
            self.assert_unchanged(before)
            assert needed > self.cache.num_free_blocks
            assert self.prefix_caching or needed > self.model_free()
            return
        assert self.prefix_caching or needed <= self.model_free()
        m.swapped = False
        m.blocks = [self.new_block() for _ in range(needed)]

    @precondition(lambda self: self.on_device())
    @rule(data=st.data())
    def refused_salt_change(self, data):
        """A sequence's salt is fixed when it is created: another one is refused."""
        s = data.draw(st.sampled_from(self.on_device()))
        salt = data.draw(st.sampled_from([x for x in (b"tenant-a", "tenant-b", b"tenant-c")
                                          if as_bytes(x) != self.seqs[s].salt]))
        before = self.snapshot()
        with pytest.raises(ValueError, match="salt"):
            self.cache.extend([s], 1, token_ids=[[0]], salts=[salt])
        self.assert_unchanged(before)

    @precondition(lambda self: self.on_device())
    @rule(data=st.data())
    def refused_write(self, data):
        """Writes the cache must refuse: a token past what was reserved, or a shared block."""
        s = data.draw(st.sampled_from(self.on_device()))
        table, length = self.cache.block_table(s), self.cache.seq_len(s)
        if length % BLOCK_SIZE == 0:
            return
        slot = int(table[-1]) * BLOCK_SIZE + length % BLOCK_SIZE
        rows = np.zeros((1, 1, HEAD_SIZE), np.float32)
        before = self.snapshot()
        with pytest.raises(ValueError, match="slots"):
            self.cache.write(0, np.array([slot]), rows, rows)
        self.assert_unchanged(before)

    @rule()
    def padding_write_changes_nothing(self):
        rows = np.full((3, 1, HEAD_SIZE), 7.0, np.float32)
        before = self.snapshot()
        self.cache.write(1, np.array([-1, -5, -1]), rows, rows)
        self.assert_unchanged(before)

    # --- invariants ------------------------------------------------------------------------

    @invariant()
    def count_step(self):
        executed_steps["count"] += 1

    @invariant()
    def block_accounting(self):
        alloc = self.cache._allocator
        tables = {s: self.cache.block_table(s) for s in self.on_device()}
        uses = np.zeros(BLOCKS, np.int64)
        for s, table in tables.items():
            assert len(set(table.tolist())) == len(table), f"block twice in table of {s}"
            assert len(table) == -(-self.cache.seq_len(s) // BLOCK_SIZE)
            np.add.at(uses, table, 1)
        np.testing.assert_array_equal(alloc.refcount, uses)
        free, evictable = alloc.free_blocks(), alloc.evictable_blocks()
        in_use = set(np.flatnonzero(uses).tolist())
        assert len(set(free)) == len(free) and len(set(evictable)) == len(evictable)
        assert not (set(free) & set(evictable)) and not (in_use & (set(free) | set(evictable)))
        assert len(free) + len(evictable) + len(in_use) == BLOCKS
        assert self.cache.num_free_blocks == BLOCKS - len(in_use)
        # Fill counts: reserved tokens of every block, the same for every table holding it.
        for s, table in tables.items():
            n = self.cache.seq_len(s)
            for i, b in enumerate(table):
                assert alloc.fill[b] == min(BLOCK_SIZE, n - i * BLOCK_SIZE)
        if not self.prefix_caching:
            assert self.cache.num_cached_blocks == 0
            assert self.cache.num_free_blocks == self.model_free()
            # Sharing matches the model up to renaming: abstract <-> real is a bijection.
            pairs = {(a, int(r)) for s, table in tables.items()
                     for a, r in zip(self.seqs[s].blocks, table)}
            assert len({a for a, _ in pairs}) == len(pairs) == len({r for _, r in pairs})
            for a, r in pairs:
                assert self.refs[a] == uses[r]

    @invariant()
    def contents_match_model(self):
        for s in self.on_device():
            m = self.seqs[s]
            assert self.cache.seq_len(s) == len(m.codes)
            assert self.cache.num_cached_tokens(s) == m.cached_tokens
            table = self.cache.block_table(s)
            positions = np.arange(len(m.codes))
            blocks, offsets = table[positions // BLOCK_SIZE], positions % BLOCK_SIZE
            codes = np.asarray(m.codes, np.float32).reshape(-1, 1)
            for layer in range(LAYERS):
                want = row_value(codes, layer)
                got_k = self.cache.key_cache(layer)[blocks, 0, offsets]
                got_v = self.cache.value_cache(layer)[blocks, 0, offsets]
                assert np.array_equal(got_k, want), f"keys of {s}, layer {layer}"
                assert np.array_equal(got_v, -want - 1), f"values of {s}, layer {layer}"
        for s, m in self.seqs.items():
            assert self.cache.is_swapped(s) == m.swapped


class PrefixCacheMachine(CacheMachine):
    prefix_caching = True


_settings = settings(deadline=None, database=None, **STEPS,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = _settings
TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = _settings


def test_enough_steps_ran():
    """Runs after the machines (file order): together they took >= 10,000 steps."""
    steps = executed_steps["count"] - executed_steps["machines"]
    if executed_steps["machines"] == 0:
        pytest.skip("the state machines did not run in this session")
    print(f"state machine steps: {steps}")
    assert steps >= 10_000
