"""One emulated rollout instance in virtual time: a continuous-batching engine within its KV-cache budget.

Simplified from vLLM, and why:

* every running row decodes one token per step and a step costs `CostModel.decode_step_s(rows, context)`; between
  batch changes the time of n steps is summed in closed form (`CostModel.decode_steps_s`), so a 30K-token response
  costs a handful of events, not 30K;
* admission is FIFO from the waiting queue, at a step boundary, while rows < `max_rows` (vLLM's max_num_seqs) and the
  sequence's tokens fit in the free cache above a 1% watermark (vLLM's block manager default); an admitted sequence
  is prefilled (its prompt and the tokens it already has) in the next step, beside the decode rows (chunked
  prefill): the batch pays what the prefill's FLOPs add to that step (`CostModel.chunked_prefill_s`), one step
  standing for the chunks vLLM would spread over several;
* when the next step would overflow the cache, the most recently admitted sequence is preempted (vLLM's recompute
  preemption): its cache is dropped and it waits at the head of the queue, keeping its tokens;
* the instance holds one version, or with several versions per instance (LoRA) one adapter per version, each row
  decoded under its own group's version in the one batch, a step paying for the batch's distinct adapters
  (`CostModel.adapter_step_s`); a weight or adapter load or a pause (colocated training) stops decoding meanwhile.

Times are lazy: the engine stays at its last step boundary `t` until asked to move (`advance_to`, `sync`).
"""
from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from dataclasses import dataclass, field

INF = math.inf


@dataclass
class Seq:
    """One trajectory: `target` response tokens to produce after a `prompt`-token prompt."""

    group: int
    sample: int
    prompt: int
    target: int
    tokens: int = 0  # response tokens as of step `joined` (running) or now (waiting)
    joined: int = 0
    versions: list = field(default_factory=list)  # [version, tokens generated on it] segments
    migrated: bool = False  # its cache arrives from another instance instead of being prefilled
    version: int | None = None  # its group's version with several versions per instance; None: the engine's


@dataclass
class Usage:
    """Seconds an engine spent on each activity (all of its life)."""

    decode: float = 0.0
    prefill: float = 0.0
    load: float = 0.0
    paused: float = 0.0
    transfer: float = 0.0  # receiving migrated requests' KV caches


class Engine:
    def __init__(self, name: str, cost, max_rows: int):
        self.name, self.cost, self.max_rows = name, cost, max_rows
        self.capacity = cost.kv_capacity_tokens()
        self.watermark = self.capacity // 100
        self.t = 0.0  # last step boundary (or end of the last busy stretch)
        self.busy_until = 0.0  # loading weights or prefilling until then
        self.paused_at: float | None = None  # colocated training holds the devices
        self.step = 0
        self.context = 0  # cached tokens of the running rows at `step`
        self.running: dict[int, Seq] = {}  # admission order
        self.finish: list[tuple[int, int]] = []  # (step at which it ends, seq key)
        self.waiting: deque[Seq] = deque()
        self.version: int | None = None
        self.row_versions: Counter = Counter()  # version -> running rows decoded under it
        self.usage = Usage()
        self._next_key = 0
        self.next_change = INF
        # held tokens per group, kept as rows come and go: running rows hold base + rows * step, waiting ones a sum
        self._held_base: Counter = Counter()  # group -> sum of prompt + tokens - joined over its running rows
        self._held_rows: Counter = Counter()  # group -> its running rows
        self._held_waiting: Counter = Counter()  # group -> sum of prompt + tokens over its waiting rows
        self._waiting_rows: Counter = Counter()
        self.held_changed = True  # `held_tokens` may differ from when this was last cleared

    # ---- queries ----------------------------------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    @property
    def adapters(self) -> int:
        """Distinct versions (LoRA adapters) of the running rows."""
        return len(self.row_versions)

    def tokens_of(self, seq: Seq) -> int:
        return seq.tokens + self.step - seq.joined

    def held_tokens(self) -> dict[int, int]:
        """Group -> KV tokens its unfinished sequences here hold or will hold (prompt and tokens so far)."""
        held = {g: base + self._held_rows[g] * self.step for g, base in self._held_base.items()}
        for g, tokens in self._held_waiting.items():
            held[g] = held.get(g, 0) + tokens
        return held

    def _hold(self, seq: Seq, rows: int) -> None:
        """Count a running row in (`rows` 1) or out (-1) of the held tokens, as of its `tokens` and `joined`."""
        self._tally(self._held_base, self._held_rows, seq.group, rows * (seq.prompt + seq.tokens - seq.joined), rows)

    def _hold_waiting(self, seqs, rows: int) -> None:
        for seq in seqs:
            self._tally(self._held_waiting, self._waiting_rows, seq.group, rows * (seq.prompt + seq.tokens), rows)

    def _tally(self, sums: Counter, counts: Counter, group: int, tokens: int, rows: int) -> None:
        self.held_changed = True
        counts[group] += rows
        if counts[group]:
            sums[group] += tokens
        else:
            del counts[group], sums[group]

    def _refresh(self) -> None:
        """Time of the next internal batch change (a row ends, the cache fills, a busy stretch ends, admission)."""
        if self.paused_at is not None:
            self.next_change = INF
        elif self.busy_until > self.t:
            self.next_change = self.busy_until
        elif self.waiting and self._admissible(self.waiting[0]):
            self.next_change = self.t
        elif self.running:
            self.next_change = self.t + self.cost.decode_steps_s(len(self.running), self.context,
                                                                 self._steps_to_change(), self.adapters)
        else:
            self.next_change = INF

    def _steps_to_change(self) -> int:
        while self.finish[0][1] not in self.running:  # left by a preemption or a migration
            heapq.heappop(self.finish)
        ends = self.finish[0][0] - self.step
        fits = (self.capacity - self.context) // len(self.running)
        return max(1, min(ends, fits))

    def _admissible(self, seq: Seq) -> bool:
        held = self.context + seq.prompt + seq.tokens + 1
        return len(self.running) < self.max_rows and held + self.watermark * bool(self.running) <= self.capacity

    # ---- moving time ------------------------------------------------------------------------------------------------
    def advance_to(self, until: float) -> list[Seq]:
        """Run every batch change up to `until`; returns the sequences that ended."""
        ended: list[Seq] = []
        while self.next_change <= until:
            self._change(ended)
            self._refresh()
        return ended

    def sync(self, now: float) -> list[Seq]:
        """Advance to the first step boundary at or after `now`, so the batch may be changed at `now`."""
        ended = self.advance_to(now)
        if self.paused_at is not None or self.busy_until > now:
            return ended
        if self.running:
            if self.t < now:  # the step in progress completes first
                self._settle(self._steps_within(now - self.t) + 1, ended)
        else:
            self.t = max(self.t, now)
        self._refresh()
        return ended

    def _steps_within(self, seconds: float) -> int:
        """Whole steps of the current batch that end within `seconds`."""
        rows, lo, hi = len(self.running), 0, self._steps_to_change()
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.cost.decode_steps_s(rows, self.context, mid, self.adapters) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _change(self, ended: list[Seq]) -> None:
        if self.busy_until > self.t:
            self.t = self.busy_until
            return
        if self.waiting and self._admissible(self.waiting[0]):
            self._admit()
            return
        self._settle(self._steps_to_change(), ended)

    def _settle(self, steps: int, ended: list[Seq]) -> None:
        """Decode `steps` steps, then let the rows that ended go and preempt while the next step would overflow."""
        self._decode(steps)
        while self.finish and self.finish[0][0] <= self.step:
            key = heapq.heappop(self.finish)[1]
            if key in self.running:
                ended.append(self._drop(key))
        while self.running and self.context + len(self.running) > self.capacity:
            self._preempt()

    def _decode(self, steps: int) -> None:
        seconds = self.cost.decode_steps_s(len(self.running), self.context, steps, self.adapters)
        self.t += seconds
        self.usage.decode += seconds
        self.context += len(self.running) * steps
        self.step += steps
        self.held_changed = self.held_changed or bool(steps and self.running)

    def _admit(self) -> None:
        """Admit every waiting sequence that fits; the next step pays for their prefill (or cache copy)."""
        tokens = copied = 0
        rows, context = len(self.running), self.context
        while self.waiting and self._admissible(self.waiting[0]):
            seq = self.waiting.popleft()
            self._hold_waiting((seq,), -1)
            held = seq.prompt + seq.tokens
            copied += held if seq.migrated else 0
            tokens += 0 if seq.migrated else held
            seq.migrated = False
            key, self._next_key = self._next_key, self._next_key + 1
            seq.joined = self.step
            self.running[key] = seq
            self._hold(seq, 1)
            self.context += held
            heapq.heappush(self.finish, (self.step + seq.target - seq.tokens, key))
            self._on_version(seq)
        prefill = self.cost.chunked_prefill_s(tokens, rows, context) if tokens else 0.0
        transfer = self.cost.kv_transfer_s(copied) if copied else 0.0
        self.busy_until = self.t + prefill + transfer
        self.usage.prefill += prefill
        self.usage.transfer += transfer

    def _on_version(self, seq: Seq) -> None:
        version = self.version if seq.version is None else seq.version
        if not seq.versions or seq.versions[-1][0] != version:
            seq.versions.append([version, 0])
        self.row_versions[version] += 1

    def _drop(self, key: int) -> Seq:
        seq = self.running.pop(key)
        self._hold(seq, -1)
        version = seq.versions[-1][0]
        self.row_versions[version] -= 1
        if not self.row_versions[version]:
            del self.row_versions[version]
        done = self.tokens_of(seq)
        seq.versions[-1][1] += done - seq.tokens
        seq.tokens = done
        self.context -= seq.prompt + done
        return seq

    def _preempt(self) -> None:
        key = next(reversed(self.running))
        self._queue_first([self._drop(key)])

    def _queue_first(self, seqs: list[Seq]) -> None:
        """Put `seqs` at the head of the queue, in their order."""
        self.waiting.extendleft(reversed(seqs))
        self._hold_waiting(seqs, 1)

    # ---- changes from outside ---------------------------------------------------------------------------------------
    def submit(self, seqs: list[Seq], migrated: bool = False) -> None:
        """Queue sequences (call `sync(now)` first); migrated ones go first, those that were running with their
        caches copied, not prefilled (`take` marks them)."""
        if migrated:
            self._queue_first(seqs)
        else:
            self.waiting.extend(seqs)
            self._hold_waiting(seqs, 1)
        self._refresh()

    def take(self, group: int) -> list[Seq]:
        """Hand over the unfinished sequences of `group` (request migration; call `sync(now)` first)."""
        keys = [k for k, s in self.running.items() if s.group == group]
        moved = [self._drop(k) for k in keys]
        for seq in moved:
            seq.migrated = True  # its cache goes with it
        queued = [s for s in self.waiting if s.group == group]  # queued: no cache, prefilled where it lands
        if queued:
            self._hold_waiting(queued, -1)
            self.waiting = deque(s for s in self.waiting if s.group != group)
        moved += queued
        self._refresh()
        return moved

    def holds_rows(self) -> bool:
        return bool(self.running or self.waiting)

    def load(self, version: int, seconds: float) -> None:
        """Take `version`'s weights (call `sync(now)` first); decoding stops for `seconds`."""
        self.version = version
        self._busy(seconds, "load")

    def reprefill(self, version: int) -> None:
        """Partial rollout: the running rows continue on `version`, their caches re-encoded under it (on admission)."""
        self._queue_first([self._drop(key) for key in list(self.running)])  # back to the head, in admission order
        self.finish = []
        self.version = version
        self._refresh()

    def pause(self) -> None:
        """Colocated training takes the devices (call `sync(now)` first)."""
        self.paused_at = max(self.t, self.busy_until)
        self._refresh()

    def resume(self, now: float) -> None:
        if self.paused_at is not None:
            self.usage.paused += max(0.0, now - self.paused_at)
            self.t = max(self.t, now)
            self.busy_until = max(self.busy_until, self.t)
            self.paused_at = None
        self._refresh()

    def _busy(self, seconds: float, kind: str) -> None:
        start = max(self.t, self.busy_until)
        self.busy_until = start + seconds
        setattr(self.usage, kind, getattr(self.usage, kind) + seconds)
        self._refresh()
