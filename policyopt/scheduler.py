"""The host side of continuous batching: which prompt's group runs in which G rows,
admission within each shard's pool of pages, preemption when a shard's running rows all
wait for a page, hand-out of finished groups, and a guard against a loop that makes no
progress. Plain Python and NumPy; ``policyopt.engine.ContinuousBatch`` makes the device
calls, for ``Engine.generate`` and the asynchronous ``EngineSlots`` alike (docs/scale.md,
"Generation engine")."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from policyopt.models.paged import pages_for


def group_pages(prompt_length: int, group_size: int, page_size: int) -> int:
    """Free pages a shard's pool needs to admit the G rows of one prompt of L tokens:
    ceil(L / ps) + (G - 1) [L % ps > 0] + G (the prompt's pages, a copy of its partly filled
    last page for each row but the first, one page per row to decode into)."""
    partial = int(prompt_length % page_size > 0)
    return pages_for(prompt_length, page_size) + (group_size - 1) * partial + group_size


@dataclasses.dataclass(frozen=True, eq=False)
class Request:
    """A prompt whose G samples wait for rows, or run in them.

    ``key`` names it to the caller and is the prompt index its sampling keys fold in;
    ``tokens`` int32 [P] right-padded, ``length`` real tokens; ``slot`` the slot group it
    must run in (the asynchronous generator's), or None: the first free one that fits."""

    key: int
    tokens: np.ndarray
    length: int
    slot: int | None = None


@dataclasses.dataclass(frozen=True)
class Admission:
    """One prefill: ``request``'s prompt into the global rows [row0, row0 + num_rows) of
    ``slot`` on ``shard``, samples first_sample, first_sample + 1, ...: a whole group
    (G rows from sample 0) or one preempted row, recomputed."""

    request: Request
    slot: int
    shard: int
    row0: int
    num_rows: int
    first_sample: int


class Scheduler:
    """Slot groups of G rows over S shards (slot i on shard i // slots_per_shard, rows
    i G .. i G + G - 1), each shard with a pool of ``num_pages`` pages of ``page_size``.

    A pass of its driver: ``admissions`` (prefill calls), a decode call, ``settle``
    (hand-out, preemption, the no-progress guard). ``stats`` counts admission calls and
    preemptions; the driver adds its decode calls' counters to it (every key set here: a
    trainer's thread may copy the dict while the generator's thread updates it).

    Args:
      shards, slots_per_shard, group_size, page_size, num_pages: the geometry above.
      admit_width: most admissions per shard in one prefill call.
      row_tokens: the most slots a row can hold (P + N), for errors.
      budget: the setting behind ``num_pages``, as errors name it
        (``"EngineConfig.kv_tokens = 64"``).
    """

    def __init__(
        self,
        *,
        shards: int,
        slots_per_shard: int,
        group_size: int,
        page_size: int,
        num_pages: int,
        admit_width: int,
        row_tokens: int,
        budget: str,
    ):
        self.shards, self.slots_per_shard, self.group_size = shards, slots_per_shard, group_size
        self.page_size, self.num_pages, self.admit_width = page_size, num_pages, admit_width
        self.row_tokens, self.budget = row_tokens, budget
        num_slots = shards * slots_per_shard
        self.held: list[Request | None] = [None] * num_slots  # the request running in a slot
        self.running: list[int] = []  # slots admitted, oldest first
        self.waiting: list[list[int]] = [[] for _ in range(num_slots)]  # rows to recompute
        self.queue: collections.deque[Request] = collections.deque()
        # Shards that preempted a group admit no new one until one of theirs is handed out:
        # the preempted group, admitted again at once, would take the pages its elders
        # wait for, and be preempted again (a livelock seen with 3 groups in 12 pages).
        self.blocked = np.zeros(shards, bool)
        # A pass that changes nothing (admits, decodes, hands out and preempts nothing)
        # would repeat for ever; passes that make no token and hand out no group are
        # bounded too (each preempts a group or a row).
        self._idle, self._idle_limit = 0, 2 * (slots_per_shard + group_size) + 2
        self._admit_calls = 0  # since the last settle
        # Row-steps spent waiting for a page, groups and rows preempted, most pages one
        # shard held at once during decode, prefill calls, decode calls whose "pool"
        # attention read a list of the held pages (not the whole pool).
        self.stats = dict(
            waits=0,
            preempted_groups=0,
            preempted_rows=0,
            peak_pages=0,
            admit_calls=0,
            held_page_calls=0,
        )

    def shard_of(self, slot: int) -> int:
        return slot // self.slots_per_shard

    def rows_of(self, slot: int) -> slice:
        return slice(slot * self.group_size, (slot + 1) * self.group_size)

    @property
    def busy(self) -> bool:
        """Requests queued or running."""
        return bool(self.queue or self.running)

    def submit(self, request: Request) -> None:
        """Queues ``request`` behind the others."""
        if request.slot is not None and (
            self.held[request.slot] is not None or any(r.slot == request.slot for r in self.queue)
        ):
            raise ValueError(f"slot group {request.slot} is still generating")
        self.queue.append(request)

    def admissions(self, num_free) -> list[list[Admission]]:
        """Every prefill call the pools allow now, in order, each with at most
        ``admit_width`` admissions per shard, from each shard's free pages (int [S]); the
        requests admitted run from here on.

        Preempted rows of running groups come first (oldest group first), each when its
        shard has its prompt's pages and one more free. Then the queue, first come first
        served: a request goes to the first free slot it may use (its own, or any)
        whose shard is not blocked and has ``group_pages`` free; one that fits nowhere
        stops the shards it could use from admitting the requests behind it."""
        num_free = np.array(num_free, np.int64).reshape(-1)
        calls = []
        while call := self._next_call(num_free):
            calls.append(call)
        self.stats["admit_calls"] += len(calls)
        self._admit_calls += len(calls)
        return calls

    def _next_call(self, num_free: np.ndarray) -> list[Admission]:
        group, ps = self.group_size, self.page_size
        places = collections.defaultdict(list)  # shard -> its admissions in this call
        room = lambda shard: len(places[shard]) < self.admit_width
        for slot in self.running:
            request, shard = self.held[slot], self.shard_of(slot)
            pages = pages_for(request.length, ps)
            while self.waiting[slot] and room(shard) and num_free[shard] >= pages + 1:
                row = self.waiting[slot].pop(0)
                places[shard].append(Admission(request, slot, shard, row, 1, row - slot * group))
                num_free[shard] -= pages
        closed = set(np.flatnonzero(self.blocked).tolist())
        free = self.free_slots()
        for request in list(self.queue):
            if len(closed) == self.shards:
                break
            slots = free if request.slot is None else [request.slot]
            slots = [s for s in slots if self.shard_of(s) not in closed and room(self.shard_of(s))]
            need = group_pages(request.length, group, ps)
            fits = [s for s in slots if num_free[self.shard_of(s)] >= need]
            if not fits:
                closed.update(self.shard_of(s) for s in slots)
                continue
            slot = fits[0]
            shard = self.shard_of(slot)
            if request.slot is None:
                free.remove(slot)
            self.queue.remove(request)
            self.held[slot] = request
            self.running.append(slot)
            places[shard].append(Admission(request, slot, shard, slot * group, group, 0))
            num_free[shard] -= need - group  # the G pages to decode into stay free
        return [admission for shard in sorted(places) for admission in places[shard]]

    def free_slots(self) -> list[int]:
        """Slots neither running nor kept for a queued request, in order."""
        kept = {r.slot for r in self.queue if r.slot is not None}
        return [s for s, r in enumerate(self.held) if r is None and s not in kept]

    def settle(self, active, made, num_free) -> tuple[list[tuple[int, Request]], np.ndarray]:
        """After a decode call, from every row's state (bool [R], admitted and not ended),
        the tokens made per shard (int [S]) and the free pages per shard (int [S], for
        errors):

          hands out every running group whose rows have all ended (oldest first);
          on a shard where no row moved (every running row waits for a page), preempts
          its most recently admitted group (queued again at the front, to be recomputed
          from its prompt; the shard blocked until one of its groups is handed out), or,
          with one group left, its last running row (recomputed alone once pages are
          free); a single row that cannot reach its end in the whole pool raises;
          raises when the passes stop making progress.

        Returns (the groups handed out as (slot, request), the rows to evict bool [R])."""
        active, made = np.asarray(active, bool), np.asarray(made)
        finished = []
        for slot in list(self.running):
            if active[self.rows_of(slot)].any() or self.waiting[slot]:
                continue
            finished.append((slot, self.held[slot]))
            self.held[slot] = None
            self.running.remove(slot)
            self.blocked[self.shard_of(slot)] = False
        evict = np.zeros(active.shape, bool)
        for shard in range(self.shards):
            mine = [slot for slot in self.running if self.shard_of(slot) == shard]
            if made[shard] or not mine:
                continue
            if len(mine) > 1:
                self._preempt_group(mine[-1], evict)
            else:
                self._preempt_row(mine[0], active, evict)
        self._check_progress(bool(made.any()) or bool(finished), evict, active, num_free)
        return finished, evict

    def _preempt_group(self, slot: int, evict: np.ndarray) -> None:
        evict[self.rows_of(slot)] = True
        self.queue.appendleft(self.held[slot])
        self.held[slot], self.waiting[slot] = None, []
        self.running.remove(slot)
        self.blocked[self.shard_of(slot)] = True
        self.stats["preempted_groups"] += 1

    def _preempt_row(self, slot: int, active: np.ndarray, evict: np.ndarray) -> None:
        running = np.flatnonzero(active[self.rows_of(slot)])
        if running.size <= 1:
            raise ValueError(
                f"{self.budget} cannot hold one row to its end: needs up to "
                f"{self.row_tokens} slots in pages of {self.page_size}"
            )
        row = slot * self.group_size + int(running[-1])
        evict[row] = True
        self.waiting[slot].append(row)
        self.stats["preempted_rows"] += 1

    def _check_progress(self, moved: bool, evict, active, num_free) -> None:
        self._idle = 0 if moved else self._idle + 1
        changed = moved or bool(evict.any()) or self._admit_calls > 0
        self._admit_calls = 0
        if changed and self._idle <= self._idle_limit:
            return
        per_shard = [sum(self.shard_of(s) == i for s in self.running) for i in range(self.shards)]
        raise RuntimeError(
            f"the engine made no progress in {self._idle} decode call(s) in a row (no token, "
            f"no group handed out{'' if changed else ', nothing admitted or preempted'}): "
            f"{len(self.queue)} prompts queued, groups running per shard {per_shard}, rows "
            f"running {int(np.sum(active))}, rows waiting to be recomputed "
            f"{sum(map(len, self.waiting))}, free pages per shard "
            f"{np.asarray(num_free).reshape(-1).tolist()} of {self.num_pages}, blocked shards "
            f"{np.flatnonzero(self.blocked).tolist()} ({self.budget}, page_size = "
            f"{self.page_size}, group of {self.group_size})"
        )

    def check_admissible(self, num_free) -> None:
        """Raises where a request kept for a slot waits on a shard that runs nothing after
        an admission: that shard's empty pool cannot admit it, and no later call would
        (requests free to take any slot are the no-progress guard's, in ``settle``)."""
        kept = {self.shard_of(r.slot) for r in self.queue if r.slot is not None}
        stuck = sorted(kept - {self.shard_of(slot) for slot in self.running})
        if stuck:
            raise RuntimeError(
                f"the paged engine cannot admit a queued group on shard(s) {stuck} and runs "
                f"none there (groups queued {[r.key for r in self.queue]}, free pages per "
                f"shard {np.asarray(num_free).reshape(-1).tolist()} of {self.num_pages}, "
                f"blocked shards {np.flatnonzero(self.blocked).tolist()}): no decode call "
                f"would make progress ({self.budget})"
            )
