"""The benchmark's modes as small strategy objects, and the rule that splits accelerators between rollout and trainer.

A mode says where rollout and training run (`colocated`: the same accelerators, taking turns), its staleness bound
K, its batch sizes, and what happens when training starts and when a version is published. Everything else (which
groups start where, which groups an update takes) is the real `Orchestrator` and `VersionGate`.

Versions are per step: the paper's K counts steps (sync is K=0 although its 16 mini-batch updates follow one
rollout), so by default TBS is one step's prompts and the 16 mini-batch updates of a step are one `train_s` over
its 8,192 sequences. `SimConfig.train_batch_size` may be set smaller (a version per mini-batch) for DORA and partial.

* `sync` (K=0, colocated): every accelerator rolls out one step's prompts, then every accelerator trains on them.
* `one-step` (K=1, disaggregated, RBS = TBS): StreamRL/AsyncFlow; step n+1 rolls out while step n trains, batch by
  batch (a batch is dispatched once the previous one has ended), so it keeps the long-tail bubble, as the paper
  says of it; `one-step-streaming` refills ended rows with the next batch's prompts at once.
* `partial` (colocated, RBS > TBS; slime's and Kimi k1.5's partial rollout): rollout runs until TBS groups are
  complete, then training takes the accelerators; unfinished sequences wait, and at the publish every instance loads
  the new version and re-prefills them (prompt and tokens so far), their later tokens belonging to the new version
  (C1 broken on purpose). Staleness bound: counted from the version a group was dispatched on (AReaL's
  max_head_offpolicyness counts the same way), with the same K as DORA so that the two differ only in how they keep
  old work; slime and Kimi set no bound, and AReaL finds 4-8 harmless.
* `dora` (K given, disaggregated, RBS > TBS): the orchestrator's proportional instance assignment as it is, without
  request migration.

The split of a disaggregated mode (`SimConfig.trainer_gpus` unless set, by `SimConfig.split`):

* `rule` (`balanced_split`): the split whose predicted step time, max(rollout at the steady token rate, training), is
  best. It sees no long tail, so it gives the trainer more than the tail leaves it time to use.
* `searched` (`searched_split`): a hill climb over rollout sides of whole instances, from the rule's split, that keeps
  the split whose short simulation (the same configuration, `SEARCH_STEPS` steady steps) has the best tokens/s. The
  climb moves by an eighth of the accelerators, then halves its stride down to one instance, moving to the better
  neighbour while there is one. It is computed from the simulator itself, with nothing fitted to any measurement.
  It costs some ten short simulations, so `rule` stays the default.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipelines.simulator.config import SimulatorError



@dataclass(frozen=True)
class Split:
    rollout_gpus: int
    trainer_gpus: int
    predicted_step_s: float  # what the split rule expected (0 when not used)


@dataclass(frozen=True)
class StepStats:
    """One step's workload, summarised for the split rule."""

    prompt_lengths: tuple[int, ...]  # per sequence
    response_lengths: tuple[int, ...]

    @property
    def mean_context(self) -> float:
        """Cached tokens of a running row, averaged over its decode steps: a row of length l holds p + l/2 on
        average for l steps."""
        num = sum(r * (p + r / 2) for p, r in zip(self.prompt_lengths, self.response_lengths))
        return num / sum(self.response_lengths)

    @property
    def sequence_lengths(self) -> list[int]:
        return [p + r for p, r in zip(self.prompt_lengths, self.response_lengths)]


def rollout_seconds(cost, stats: StepStats, instances: int, max_rows: int) -> float:
    """A step's rollout at the steady token rate of full batches (no long-tail bubble): the split rule's estimate."""
    return RolloutTerms.of(cost, stats, max_rows).seconds(instances)


@dataclass(frozen=True)
class RolloutTerms:
    """What `rollout_seconds` needs of a step, summed once: a split's instance count then costs two divisions."""

    rows: int  # rows of a full batch
    step_s: float  # one decode step of a full batch
    response_tokens: int
    prefill_s: float  # every prompt's prefill, on one instance

    @classmethod
    def of(cls, cost, stats: StepStats, max_rows: int) -> "RolloutTerms":
        ctx = stats.mean_context
        rows = max(1, min(max_rows, int(cost.kv_capacity_tokens() // ctx)))
        return cls(rows, cost.decode_step_s(rows, int(rows * ctx)), sum(stats.response_lengths),
                   sum(cost.prefill_s(p) for p in stats.prompt_lengths))

    def seconds(self, instances: int) -> float:
        rate = instances * self.rows / self.step_s
        return self.response_tokens / rate + self.prefill_s / instances


def balanced_split(gpus: int, cost, stats: StepStats, max_rows: int) -> Split:
    """The split with the best predicted step time, max(rollout at the steady rate, training): the rollout side in
    whole instances of `tp` accelerators; ties go to the larger rollout side."""
    best = None
    rollout_terms = RolloutTerms.of(cost, stats, max_rows)
    lengths = stats.sequence_lengths
    total, square = sum(lengths), sum(n * n for n in lengths)
    for rollout in range(cost.tp, gpus, cost.tp):
        trainer = gpus - rollout
        step = max(rollout_terms.seconds(rollout // cost.tp), cost.train_s_of_sums(total, square, trainer))
        if best is None or step <= best.predicted_step_s:
            best = Split(rollout, trainer, step)
    if best is None:
        raise SimulatorError(f"{gpus} accelerators cannot be split into rollout instances of {cost.tp} and a trainer")
    return best


SEARCH_STEPS = 3  # steady steps of each simulation the search compares


def searched_split(gpus: int, tp: int, start: Split, tokens_per_s) -> Split:
    """The split with the best `tokens_per_s(trainer_gpus)` found by a hill climb from `start` over rollout sides of
    whole instances (multiples of `tp`, leaving the trainer at least one accelerator)."""
    scores: dict[int, float] = {}

    def score(rollout: int) -> float:
        if rollout not in scores:
            scores[rollout] = tokens_per_s(gpus - rollout)
        return scores[rollout]

    best, stride = start.rollout_gpus, tp * max(1, gpus // (8 * tp))
    while True:
        better = [r for r in (best - stride, best + stride) if tp <= r < gpus and score(r) > score(best)]
        if better:
            best = max(better, key=score)
        elif stride == tp:
            return Split(best, gpus - best, 0.0)
        else:
            stride = max(tp, stride // (2 * tp) * tp)


class Mode:
    name = ""
    colocated = False
    max_staleness = 0

    def batches(self, cfg) -> tuple[int, int]:
        """(TBS, RBS) in groups."""
        return cfg.prompts_per_step, cfg.prompts_per_step

    def split(self, cfg, cost, stats: StepStats, tokens_per_s) -> Split:
        """`tokens_per_s(trainer_gpus)`: a short simulation of this configuration, for the searched split."""
        if self.colocated:
            return Split(cfg.gpus, cfg.gpus, 0.0)
        if cfg.trainer_gpus:
            return Split(cfg.gpus - cfg.trainer_gpus, cfg.trainer_gpus, 0.0)
        rule = balanced_split(cfg.gpus, cost, stats, cfg.max_rows)
        return rule if cfg.split == "rule" else searched_split(cfg.gpus, cost.tp, rule, tokens_per_s)

    def capacity(self, sim: "Simulation") -> int:
        """New groups the orchestrator may dispatch now."""
        return sim.gate.capacity()

    def on_train_start(self, sim: "Simulation") -> None:
        if self.colocated:
            for engine in sim.engines.values():
                sim.sync(engine)
                engine.pause()

    def on_publish(self, sim: "Simulation", version: int) -> None:
        if self.colocated:
            for engine in sim.engines.values():
                engine.resume(sim.now)


class Sync(Mode):
    name, colocated, max_staleness = "sync", True, 0


class OneStep(Mode):
    name, max_staleness = "one-step", 1

    def capacity(self, sim):
        return 0 if sim.orchestrator.in_flight else sim.gate.capacity()


class OneStepStreaming(Mode):
    name, max_staleness = "one-step-streaming", 1


class Dora(Mode):
    name = "dora"

    def __init__(self, max_staleness: int):
        self.max_staleness = max_staleness

    def batches(self, cfg):
        return cfg.train_batch_size, cfg.rollout_batch_size


class Partial(Dora):
    name, colocated = "partial", True

    def on_publish(self, sim, version):
        super().on_publish(sim, version)
        for engine in sim.engines.values():
            sim.sync(engine)
            engine.reprefill(version)
            engine.load(version, sim.load_seconds(version))
        sim.orchestrator.relabel(version)


MODES = ("sync", "one-step", "one-step-streaming", "partial", "dora")


def mode_named(name: str, max_staleness: int) -> Mode:
    makers = {"sync": Sync, "one-step": OneStep, "one-step-streaming": OneStepStreaming, "partial": lambda: Partial(max_staleness),
              "dora": lambda: Dora(max_staleness)}
    if name not in makers:
        raise SimulatorError(f"mode: got {name!r}, allowed: {', '.join(MODES)}")
    return makers[name]()
