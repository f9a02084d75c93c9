"""Tests of policyopt.scheduler, the host side of continuous batching: admissions worked by
hand, hand-out and preemption, the progress guards, and whole generations against a NumPy
simulation of the paged pool (no model, no JAX)."""

import numpy as np
import pytest

from policyopt.models.paged import pages_for
from policyopt.scheduler import Request, Scheduler, group_pages


def scheduler(shards=1, slots_per_shard=2, group=2, page_size=4, num_pages=12, width=2):
    return Scheduler(
        shards=shards,
        slots_per_shard=slots_per_shard,
        group_size=group,
        page_size=page_size,
        num_pages=num_pages,
        admit_width=width,
        row_tokens=7 + 9,
        budget="EngineConfig.kv_tokens = 48",
    )


def request(key, length, slot=None):
    return Request(key, np.zeros(8, np.int32), length, slot)


def placed(calls):
    """Each call as (request key, slot, row0, rows, first sample) tuples."""
    return [[(a.request.key, a.slot, a.row0, a.num_rows, a.first_sample) for a in c] for c in calls]


def test_group_pages_by_hand():
    # ceil(L / ps) + (G - 1) [L % ps > 0] + G
    assert group_pages(6, 2, 4) == 2 + 1 + 2
    assert group_pages(8, 2, 4) == 2 + 0 + 2
    assert group_pages(15, 8, 16) == 1 + 7 + 8


def test_admissions_by_hand():
    """Prompts of 6, 2 and 4 tokens (groups of 2, pages of 4) take 5, 4 and 3 free pages
    to admit, of which 3, 2 and 1 stay taken. Two slots: the first two prompts in one
    call of width 2, or in two calls of width 1; the third waits for a slot."""
    for width, expected in ((2, [[(0, 0, 0, 2, 0), (1, 1, 2, 2, 0)]]), (1, None)):
        s = scheduler(width=width)
        for key, length in enumerate((6, 2, 4)):
            s.submit(request(key, length))
        calls = placed(s.admissions([12]))
        assert calls == (expected or [[(0, 0, 0, 2, 0)], [(1, 1, 2, 2, 0)]])
        assert s.running == [0, 1] and [r.key for r in s.queue] == [2]
        assert s.stats["admit_calls"] == len(calls)


def test_first_come_first_served():
    """A prompt that does not fit stops the ones behind it (6 tokens need 5 free pages,
    4 are free), though the next (1 token: 4 pages) would fit; with 8 free, the first
    keeps 3 of them and the second fits in the 5 left."""
    s = scheduler()
    s.submit(request(0, 6))
    s.submit(request(1, 1))
    assert s.admissions([4]) == [] and len(s.queue) == 2
    assert placed(s.admissions([8])) == [[(0, 0, 0, 2, 0), (1, 1, 2, 2, 0)]]


def test_requests_kept_for_a_slot_wait_on_their_own_shard_only():
    """Two shards of one slot: the request kept for slot 0 does not fit shard 0 (4 free
    pages, 5 needed) and holds back nothing on shard 1; a request free to go anywhere
    takes the first free slot that fits."""
    s = scheduler(shards=2, slots_per_shard=1)
    s.submit(request(10, 6, slot=0))
    s.submit(request(11, 6, slot=1))
    assert placed(s.admissions([4, 12])) == [[(11, 1, 2, 2, 0)]]
    with pytest.raises(ValueError, match="slot group 1 is still generating"):
        s.submit(request(12, 1, slot=1))
    free = scheduler(shards=2, slots_per_shard=1)
    free.submit(request(0, 6))
    assert placed(free.admissions([4, 12])) == [[(0, 1, 2, 2, 0)]]


def test_hand_out_and_group_preemption():
    """Three groups on one shard; after a decode call in which no row moved, the newest is
    preempted: its rows evicted, it is queued at the front, and the shard admits no new
    group until one of its groups is handed out."""
    s = scheduler(slots_per_shard=3)
    for key in range(4):
        s.submit(request(key, 1))
    s.admissions([12])
    assert s.running == [0, 1, 2]
    active = np.ones(6, bool)
    finished, evict = s.settle(active, np.array([0]), np.array([0]))
    assert finished == [] and evict.tolist() == [False] * 4 + [True] * 2
    assert [r.key for r in s.queue] == [2, 3] and s.running == [0, 1]
    assert s.blocked.tolist() == [True] and s.stats["preempted_groups"] == 1
    assert s.admissions([12]) == []  # blocked
    active[[0, 1, 4, 5]] = False  # group 0 ends
    finished, evict = s.settle(active, np.array([3]), np.array([5]))
    assert [(slot, r.key) for slot, r in finished] == [(0, 0)] and not evict.any()
    assert not s.blocked.any()
    assert placed(s.admissions([12])) == [[(2, 0, 0, 2, 0), (3, 2, 4, 2, 0)]]


def test_row_preemption_with_one_group_left():
    """One group left whose rows all wait: its last running row is evicted and recomputed
    alone (its own prompt pages and one more free); a single row that cannot move
    raises."""
    s = scheduler(slots_per_shard=1)
    s.submit(request(7, 6))
    s.admissions([12])
    finished, evict = s.settle(np.array([True, True]), np.array([0]), np.array([0]))
    assert finished == [] and evict.tolist() == [False, True] and s.waiting[0] == [1]
    assert s.stats["preempted_rows"] == 1
    assert s.admissions([2]) == []  # 2 pages of prompt and one more
    assert placed(s.admissions([3])) == [[(7, 0, 1, 1, 1)]]
    with pytest.raises(
        ValueError,
        match=r"EngineConfig.kv_tokens = 48 cannot hold one row to its end: needs up to 16 "
        r"slots in pages of 4",
    ):
        s.settle(np.array([True, False]), np.array([0]), np.array([0]))


def test_a_pass_that_changes_nothing_raises():
    s = scheduler()
    s.submit(request(0, 6))
    s.admissions([4])
    with pytest.raises(
        RuntimeError,
        match=r"the engine made no progress in 1 decode call\(s\) in a row \(no token, no "
        r"group handed out, nothing admitted or preempted\): 1 prompts queued, groups running "
        r"per shard \[0\], rows running 0, rows waiting to be recomputed 0, free pages per "
        r"shard \[4\] of 12, blocked shards \[\] \(EngineConfig.kv_tokens = 48, page_size = 4, "
        r"group of 2\)$",
    ):
        s.settle(np.zeros(4, bool), np.array([0]), np.array([4]))


def test_a_shard_that_runs_nothing_and_cannot_admit_its_kept_request_raises():
    s = scheduler(shards=2, slots_per_shard=1)
    s.submit(request(0, 1, slot=1))
    s.admissions([12, 2])
    with pytest.raises(
        RuntimeError,
        match=r"cannot admit a queued group on shard\(s\) \[1\] and runs none there \(groups "
        r"queued \[0\], free pages per shard \[12, 2\] of 12, blocked shards \[\]\)",
    ):
        s.check_admissible([12, 2])
    free = scheduler(shards=2, slots_per_shard=1)
    free.submit(request(0, 6))
    free.check_admissible([4, 4])  # free to go anywhere: the guard of settle's


class Pool:
    """A NumPy model of the engine's paged pool for the scheduler to drive: each shard's
    free pages; a group's full prompt pages shared by its rows (freed with the last), each
    row's own pages; a decode step grants pages in row order while they last (a row
    refused waits); a row ends after its planned number of tokens."""

    def __init__(self, s: Scheduler, lengths, targets):
        self.s, self.lengths, self.targets = s, lengths, targets
        rows = s.shards * s.slots_per_shard * s.group_size
        self.free = np.full(s.shards, s.num_pages)
        self.active = np.zeros(rows, bool)
        self.count = np.zeros(rows, int)
        self.tokens = np.zeros(rows, int)  # slots held
        self.own = np.zeros(rows, int)  # pages held alone
        self.shared = {}  # slot -> [full prompt pages, rows holding them]
        self.key = np.full(rows, -1)

    def shard(self, row):
        return row // (self.s.slots_per_shard * self.s.group_size)

    def admit(self, admission):
        ps, length = self.s.page_size, self.lengths[admission.request.key]
        rows = range(admission.row0, admission.row0 + admission.num_rows)
        share = admission.num_rows > 1
        if share:
            self.shared[admission.slot] = [length // ps, admission.num_rows]
        for row in rows:
            self.own[row] = (length % ps > 0) if share else pages_for(length, ps)
            self.tokens[row], self.count[row] = length, 0
            self.active[row], self.key[row] = True, admission.request.key
        taken = pages_for(length, ps) + (admission.num_rows - 1) * (length % ps > 0)
        self.free[admission.shard] -= taken
        assert self.free[admission.shard] >= 0

    def release(self, row):
        self.free[self.shard(row)] += self.own[row]
        self.own[row], self.active[row] = 0, False
        slot = row // self.s.group_size
        if slot in self.shared:
            self.shared[slot][1] -= 1
            if self.shared[slot][1] == 0:
                self.free[self.shard(row)] += self.shared.pop(slot)[0]

    def decode(self, steps):
        made = np.zeros(self.s.shards, int)
        for _ in range(steps):
            for row in np.flatnonzero(self.active):
                if self.tokens[row] % self.s.page_size == 0:  # its next slot opens a page
                    if self.free[self.shard(row)] == 0:
                        continue  # waits
                    self.free[self.shard(row)] -= 1
                    self.own[row] += 1
                self.tokens[row] += 1
                self.count[row] += 1
                made[self.shard(row)] += 1
                if self.count[row] == self.targets[self.key[row]]:
                    self.release(row)
        return made


def generation(seed: int, kept: bool) -> dict:
    """One random generation through the ``Pool``: prompts free to take any slot, all
    queued at once (``Engine.generate``), or each kept for the slot it was given when that
    slot was free (``EngineSlots``). Returns the scheduler's stats."""
    rng = np.random.default_rng(seed)
    shards, group, ps = 1 + seed % 2, 1 + seed % 3, 2 + seed % 3
    num = 12
    lengths = rng.integers(1, 9, num)
    targets = rng.integers(1, 12, num)
    one_row = max(pages_for(int(a + b), ps) for a, b in zip(lengths, targets))
    need = max(max(group_pages(int(a), group, ps) for a in lengths), one_row)
    s = Scheduler(
        shards=shards,
        slots_per_shard=3,
        group_size=group,
        page_size=ps,
        num_pages=need + int(rng.integers(0, 8)),
        admit_width=2,
        row_tokens=8 + 11,
        budget="budget",
    )
    pool = Pool(s, lengths, targets)
    queue = list(range(num))
    done = {}
    for _ in range(10_000):
        if kept:
            for slot in s.free_slots():
                if queue:
                    key = queue.pop(0)
                    s.submit(request(key, int(lengths[key]), slot=slot))
        else:
            while queue:
                key = queue.pop(0)
                s.submit(request(key, int(lengths[key])))
        if not s.busy:
            break
        for call in s.admissions(pool.free.copy()):
            for admission in call:
                pool.admit(admission)
        s.check_admissible(pool.free.copy())
        made = pool.decode(steps=3)
        finished, evict = s.settle(pool.active.copy(), made, pool.free.copy())
        for slot, req in finished:
            assert req.key not in done and (not kept or req.slot == slot)
            done[req.key] = pool.count[s.rows_of(slot)].copy()
        for row in np.flatnonzero(evict):
            pool.release(row)
    assert sorted(done) == list(range(num))
    for key, counts in done.items():
        assert np.all(counts == targets[key]), key
    np.testing.assert_array_equal(pool.free, s.num_pages)
    return s.stats


@pytest.mark.parametrize("kept", [False, True], ids=["any_slot", "kept_slot"])
def test_generations_finish_and_every_page_comes_back(kept):
    """Random prompt and response lengths, groups of 1 to 3 rows, 1 or 2 shards, through
    pools from the most one group or one row needs up: every prompt is handed out once,
    with all its tokens, and every page returns; groups and rows were preempted."""
    stats = [generation(seed, kept) for seed in range(8)]
    assert sum(x["preempted_groups"] for x in stats) > 0
    assert sum(x["preempted_rows"] for x in stats) > 0
