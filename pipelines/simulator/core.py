"""The discrete-event loop: emulated engines in virtual time around the real `VersionGate` and `Orchestrator`.

It mirrors `pipelines.streaming.stream`: each turn lets the orchestrator start groups and move idle instances, asks
the gate whether the next update may start, and feeds back what finished (a group completes when its last sample
ends; its reward and advantage are taken to cost nothing, as they run on CPU workers beside the accelerators).
Turns happen when something changes, at most once per `decision_interval_s` (the driver's turn); between turns the
engines advance analytically (`pipelines.simulator.engine`).

With `versions_per_instance` = M > 1 (LoRA adapters) the orchestrator's `Concurrent(M)` strategy lets an instance
take the newest version beside older ones; its engine decodes every version's rows in one batch.

Weight loads: an instance takes a version from a peer instance that holds it (`weights_from_peer_s`, waiting for the
first holder to finish loading), else from the weight store (`weights_from_store_s`); in colocated modes the
trainer's accelerators are the rollout accelerators, so they hold each version as it is published.
"""
from __future__ import annotations

import dataclasses
import math

from dora_tasks.emulation.lengths import LengthModel
from pipelines.gate import BatchDecision, VersionGate
from pipelines.orchestrator import Load, Migrate, Orchestrator, Start
from pipelines.simulator.config import SimConfig, SimulatorError
from pipelines.simulator.engine import Engine, Seq
from pipelines.simulator.modes import SEARCH_STEPS, StepStats, mode_named
from pipelines.simulator.record import Recorder
from pipelines.switching import switching_named

INF = math.inf


def step_stats(lengths: "GroupLengths", prompts: int) -> StepStats:
    """The first step's prompts, as the split rule sees them."""
    groups = [lengths(p) for p in range(prompts)]
    return StepStats(tuple(prompt for prompt, responses in groups for _ in responses),
                     tuple(r for _, responses in groups for r in responses))


class GroupLengths:
    """(prompt tokens, response tokens of each sample) of a group, drawn once from the length model: every
    simulation of one workload (sync and DORA side by side, the searched split's short runs) shares them."""

    _shared: dict[tuple, "GroupLengths"] = {}

    def __init__(self, lengths: LengthModel, group_size: int):
        self.lengths, self.group_size = lengths, group_size
        self.drawn: dict[int, tuple[int, tuple[int, ...]]] = {}

    @classmethod
    def of(cls, lengths: LengthModel, group_size: int) -> "GroupLengths":
        key = (lengths, group_size)
        if key not in cls._shared:
            cls._shared.clear()  # one workload at a time: a sweep moves on to the next and never comes back
            cls._shared[key] = cls(lengths, group_size)
        return cls._shared[key]

    def __call__(self, group_id: int) -> tuple[int, tuple[int, ...]]:
        if group_id not in self.drawn:
            self.drawn[group_id] = self.lengths.group(group_id, self.group_size)
        return self.drawn[group_id]


def short_run(cfg: SimConfig, cost, lengths: LengthModel):
    """tokens/s of `cfg` on a given trainer size over `SEARCH_STEPS` steady steps: what the searched split compares."""
    def tokens_per_s(trainer_gpus: int) -> float:
        short = dataclasses.replace(cfg, trainer_gpus=trainer_gpus, split="rule", check=False,
                                    steps=min(cfg.steps, cfg.warmup_steps + SEARCH_STEPS))
        return Simulation(short, cost, lengths).run().result().tokens_per_s
    return tokens_per_s


class Simulation:
    def __init__(self, cfg: SimConfig, cost, lengths: LengthModel):
        self.cfg, self.cost, self.lengths = cfg.validate(), cost, lengths
        self.mode = mode_named(cfg.mode, cfg.max_staleness)
        self.tbs, rbs = self.mode.batches(cfg)
        self.group_lengths = GroupLengths.of(lengths, cfg.group_size)
        self.split = self.mode.split(cfg, cost, step_stats(self.group_lengths, cfg.prompts_per_step),
                                     short_run(cfg, cost, lengths))
        instances = self.split.rollout_gpus // cost.tp
        if cfg.versions_per_instance > 1 and cost.lora_rank <= 0:
            raise SimulatorError(f"versions_per_instance: {cfg.versions_per_instance} needs one LoRA adapter per "
                                 "version: set emulation.lora_rank > 0")
        if instances < 1:
            raise SimulatorError(f"no rollout instance: {self.split.rollout_gpus} accelerators, tp {cost.tp}")
        self.updates = cfg.steps * cfg.prompts_per_step // self.tbs
        K = self.mode.max_staleness
        self.gate = VersionGate(K, self.tbs, stream=cfg.stream_updates)
        self.orchestrator = Orchestrator(rbs, group_budget=(self.updates + K + 2) * self.tbs,
                                         switching=switching_named(cfg.switching, cfg.versions_per_instance),
                                         group_size=cfg.group_size)
        self.engines = {f"r{i:05d}": Engine(f"r{i:05d}", cost, cfg.max_rows) for i in range(instances)}
        for name in self.engines:  # its share of RBS, in groups (its engine queues what it cannot run yet)
            self.orchestrator.add_instance(name, math.ceil(rbs / instances), cost.kv_capacity_tokens(), cfg.max_rows)
        self.now = 0.0
        self.groups: dict[int, list[Seq]] = {}
        self.left: dict[int, int] = {}  # group -> samples still running
        self.moved: set[int] = set()  # running groups that moved (their request ends are reported in any case)
        self.in_transit: list[tuple[float, str, int, list[Seq]]] = []  # (arrival, target, group, its requests)
        self.training: BatchDecision | None = None
        self.train_end = INF
        self.trainer_free = 0.0  # when the trainer has computed every group of the batch it holds so far
        self.streaming: set[int] = set()  # groups of the training batch not yet complete (streamed updates)
        self.streamed_in: list[int] = []  # of those, the ones that completed while the trainer was busy
        self.ready: dict[int, float] = {}  # version -> when a peer holds it
        self.ended: list[Seq] = []  # rows that ended while an engine was synced for a change
        self.queued_loads: dict[str, tuple[int, list[Seq]]] = {}  # instance -> (next version, groups queued for it)
        self.record = Recorder(self)

    # ---- the loop ---------------------------------------------------------------------------------------------------
    def run(self) -> "Recorder":
        self._decide()
        while self.gate.next_update < self.updates:
            self.now = self._next_time()
            self._turn()
        return self.record

    def _next_time(self) -> float:
        engines = min([e.next_change for e in self.engines.values()] + [t for t, *_ in self.in_transit])
        t = min(self.train_end, max(self.now + self.cfg.decision_interval_s, engines))
        if t == INF:
            raise SimulatorError(f"stuck at {self.now:.1f} s: nothing runs and the gate takes nothing "
                                 f"(update {self.gate.next_update}, {len(self.gate.complete)} groups complete)")
        return t

    def _turn(self) -> None:
        for engine in self.engines.values():
            if engine.next_change <= self.now:
                self.ended += engine.advance_to(self.now)
        changed = self._collect()
        if self.in_transit:
            changed = self._arrive() or changed
        if self.queued_loads:
            self._load_drained()
        if self.train_end <= self.now and self.streamed_in:
            self._feed()
        elif self.train_end <= self.now:
            self._publish()
            changed = True
        if changed:
            self._decide()

    def _collect(self) -> bool:
        """Rows that ended: a group whose last sample ended is complete."""
        done = False
        for seq in self.ended:
            if self.cfg.reports == "request" or seq.group in self.moved:
                self.orchestrator.on_request_done(seq.group, seq.sample)
                done = True  # its row is free
            self.left[seq.group] -= 1
            if self.left[seq.group] == 0:
                done = True
                self.moved.discard(seq.group)
                self.orchestrator.on_group_done(seq.group)
                self.gate.on_complete(seq.group)
                if seq.group in self.streaming:
                    self._stream_in(seq.group)
        self.ended = []
        return done

    def _arrive(self) -> bool:
        """Moved groups whose hand-over time has passed join their target's engine."""
        due = [m for m in self.in_transit if m[0] <= self.now]
        self.in_transit = [m for m in self.in_transit if m[0] > self.now]
        for _, address, group, seqs in due:
            target = self.engines[address]
            self.sync(target)
            target.submit(seqs, migrated=True)
            if self.cfg.reports == "request":
                self.orchestrator.on_arrived(group)
        return bool(due)

    def _decide(self) -> None:
        # where a migrated group's cache fits (an engine unchanged holds as before)
        if self.cfg.switching == "migrate" and self.cfg.reports == "request":
            for engine in self.engines.values():
                if engine.held_changed:
                    engine.held_changed = False
                    for group, tokens in engine.held_tokens().items():
                        self.orchestrator.on_progress(group, tokens)
        for action in self.orchestrator.decide(self.mode.capacity(self)):
            self._act(action)
        self.record.on_dispatch(self.now)
        self.record.on_gate(self.now, closed=self.mode.capacity(self) <= 0)
        if self.training is None and (self.cfg.stream_updates or len(self.gate.complete) >= self.tbs):
            decision = self.gate.decide()
            if decision is not None:
                self._train(decision)
        if self.cfg.check:
            self.gate.validate()
            self.orchestrator.validate()

    # ---- actions ----------------------------------------------------------------------------------------------------
    def _act(self, action: Load | Start | Migrate) -> None:
        if isinstance(action, Migrate):
            source, target = self.engines[action.source], self.engines[action.target]
            self.sync(source)
            self.sync(target)
            seqs = source.take(action.group_id)
            self.moved.add(action.group_id)
            self.record.migrations[0] += 1
            self.record.moved_responses += len(seqs)
            if self.cfg.handover_s > 0:
                self.in_transit.append((self.now + self.cfg.handover_s, action.target, action.group_id, seqs))
                return
            target.submit(seqs, migrated=True)
            if self.cfg.reports == "request":
                self.orchestrator.on_arrived(action.group_id)  # a move takes no time here
            return
        engine = self.engines[action.instance]
        self.sync(engine)
        if isinstance(action, Start):
            if action.new:
                self.gate.on_dispatch(action.group_id, action.version)
            seqs = self._group(action.group_id, action.version)
            if action.instance in self.queued_loads:
                self.queued_loads[action.instance][1].extend(seqs)
            else:
                engine.submit(seqs)
        elif self.cfg.switching == "queue" and engine.holds_rows():  # C1: the load waits for the older rows to end
            self.queued_loads[action.instance] = (action.version, [])
        else:
            engine.load(action.version, self.load_seconds(action.version))

    def _load_drained(self) -> None:
        """Queued switching: an instance whose older rows have all ended loads its next version and takes the groups
        that queued behind them."""
        for name, (version, seqs) in list(self.queued_loads.items()):
            engine = self.engines[name]
            self.sync(engine)
            if not engine.holds_rows():
                del self.queued_loads[name]
                engine.load(version, self.load_seconds(version))
                engine.submit(seqs)

    def sync(self, engine: Engine) -> None:
        self.ended += engine.sync(self.now)

    def _group(self, group_id: int, version: int) -> list[Seq]:
        prompt, responses = self.group_lengths(group_id)
        own = version if self.cfg.versions_per_instance > 1 else None  # else decoded on the engine's version
        seqs = [Seq(group_id, s, prompt, target, version=own) for s, target in enumerate(responses)]
        self.groups[group_id] = seqs
        self.left[group_id] = len(seqs)
        return seqs

    def load_seconds(self, version: int) -> float:
        """Waiting for a peer that holds `version` and taking it from there, or reading it from the store; with LoRA
        a version after the base moves as its adapter."""
        adapter = version > 0
        if version in self.ready:
            return max(0.0, self.ready[version] - self.now) + self.cost.weights_from_peer_s(adapter)
        seconds = self.cost.weights_from_store_s(adapter)
        self.ready[version] = self.now + seconds
        return seconds

    def _train(self, decision: BatchDecision) -> None:
        """The trainer computes the batch's complete groups now and, with streamed updates, the pending stragglers as
        they complete (those complete whenever it is free, together); it publishes after the last. The cost model's
        training time adds up over sequences, so streaming splits an update's work and adds to it only `_compute`'s
        floor."""
        self.training, self.streaming, self.streamed_in = decision, set(decision.pending), []
        self.trainer_free = self.now
        self.record.on_train(decision, self.now)
        self._compute([g for g in decision.group_ids if g not in self.streaming])
        self.mode.on_train_start(self)

    def _stream_in(self, group_id: int) -> None:
        """A straggler completed: it goes to the trainer once it is free, with every other completed by then (those
        of one instant together, as the Dask driver sends those of one turn)."""
        self.streaming.discard(group_id)
        self.streamed_in.append(group_id)
        self.train_end = max(self.now, self.trainer_free)  # wake up to feed them in

    def _feed(self) -> None:
        groups, self.streamed_in = self.streamed_in, []
        self._compute(groups, streamed=True)

    def _compute(self, group_ids: list[int], streamed: bool = False) -> None:
        """The trainer computes these groups after what it holds; `streamed`: stragglers computed after the rest
        (`CostModel.straggler_train_s`)."""
        lengths = [s.prompt + s.target for g in group_ids for s in self.groups[g]]
        start = max(self.now, self.trainer_free)
        self.trainer_free = start + (self.cost.straggler_train_s if streamed else self.cost.train_s)(
            lengths, self.split.trainer_gpus)
        self.record.on_compute(start, self.trainer_free, tuple(group_ids), streamed)
        self.train_end = INF if self.streaming else self.trainer_free

    def _publish(self) -> None:
        decision, self.training, self.train_end = self.training, None, INF
        self.gate.on_update_done(decision.update)
        version = decision.update + 1
        self.orchestrator.on_publish(version)
        if self.mode.colocated:
            self.ready[version] = self.now
        self.mode.on_publish(self, version)
        self.record.on_publish(decision, self.now)
        self.record.on_gate(self.now, closed=self.mode.capacity(self) <= 0)
