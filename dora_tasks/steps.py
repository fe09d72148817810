"""The functions Dask runs: rollout (and resume, of a response migrated from another instance), reward (and the
reward model's scoring, on a reward worker), advantage, gate, update (with its publish). Thin shells over engines
and pure code.

Each takes and returns typed records (`dora_tasks.core.records`); the driver submits them with tuple keys, e.g.
``("rollout", v, group_id)``, and resource restrictions that place them on the right workers. A rollout task is one
group; a reward task and its advantage task take every group one instance finished in one turn of the driver, so
that groups which end in the same decode step cost two tasks together, not two each.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from distributed import get_worker

from dora_tasks.core.clock import Clock
from dora_tasks.core.handover import Continuation, HandedOver, ResumedResponse, assemble_group
from dora_tasks.core.records import (Generation, Group, Migration, Prompt, PublishedWeights, TrainBatch,
                                     TrainerRestore, Trajectory, UpdatePart, UpdateResult, WeightsReceived)

if TYPE_CHECKING:
    from storage.weight_store import WeightFiles


# ---- rollout (rollout instance, label ROLLOUT) -------------------------------------------------------------------
def rollout(group_id: int, prompt: Prompt, version: int, weights_path: str, group_size: int, seed: int,
            attempt: int = 0, shipped: WeightFiles | None = None) -> Group | HandedOver:
    """Generate the G responses of one prompt on this instance, all with policy `version`; `shipped`: the version's
    weights as Dask data, copied from a peer worker that holds them (else the engine reads `weights_path`). Running
    responses handed over meanwhile (`hand_over_requests`) come back as continuations (`HandedOver`)."""
    from dora_tasks.plugins import rollout_clock, rollout_plugin, rollout_server

    server, clock = rollout_server(), rollout_clock()
    start = clock.now()
    received = None
    if shipped is not None:
        weights_path, received = shipped.local_folder(), _received(shipped)
    plugin = rollout_plugin()
    if plugin.episodes is not None:  # multi-turn: each response is an episode with the environment
        from dora_tasks.episodes import run_episodes

        trajectories = run_episodes(server, plugin.episodes, _tokenizer(plugin.model_path), prompt, version,
                                    weights_path, group_size, seed, plugin.rollout.max_new_tokens, group_id)
        return Group(group_id, prompt, version, get_worker().address, attempt, trajectories, start, clock.now(),
                     weights=received)
    gens = server.generate(version, weights_path, list(prompt.token_ids), group_size, seed,
                           request_id=request_id(group_id, attempt))
    prompt_ids = np.asarray(prompt.token_ids, dtype=np.int32)
    trajectories = [
        Trajectory(group_id, i, prompt_ids, g.token_ids, g.versions, g.logprobs, g.finished)
        for i, g in enumerate(gens) if isinstance(g, Generation)
    ]
    group = Group(group_id, prompt, version, get_worker().address, attempt, trajectories, start, clock.now(),
                  weights=received)
    handed = [g for g in gens if isinstance(g, Continuation)]  # responses handed over to another instance meanwhile
    return HandedOver(group, handed) if handed else group


def request_id(group_id: int, attempt: int) -> tuple[int, int]:
    """How a group's rollout names its request to the rollout server (what a hand-over order names)."""
    return group_id, attempt


def resume(held: HandedOver | ResumedResponse, sample: int, weights_path: str, carries_group: bool,
           version_wait_s: float = 600.0) -> ResumedResponse:
    """Continue response `sample`, which another instance of its version handed over (`held`: that instance's
    answer), on this instance, to its end or to its next hand-over. `carries_group`: this answer also carries the
    group's trajectories that ended where it started (one response of the group does).

    A resumed response is one row of this instance's batch, not one of its slots: the task leaves the worker's
    thread pool while it waits (`secede`), so the rows a group's slot freed here can take several. The instance
    may not have loaded the version yet (its first group of it is on its way): it sleeps until the instance's engine
    loads a version, up to `version_wait_s` in all (then `VersionWaitTimeout`)."""
    from distributed import secede

    from dora_tasks.plugins import rollout_clock, rollout_plugin, rollout_server
    from dora_tasks.version_loads import resume_when_loaded

    secede()
    server, clock, here = rollout_server(), rollout_clock(), get_worker().address
    c = held.continuation(sample)
    resumed = resume_when_loaded(server, rollout_plugin().version_loads, c, weights_path, version_wait_s, here)
    cost, outcome = resumed.cost, resumed.outcome
    produced = outcome.versions[len(c.token_ids):]  # the versions of the tokens this instance produced
    served = int(produced[0]) if len(produced) and (produced == produced[0]).all() else -1  # -1: none, or mixed
    group_id, attempt = c.request_id
    moved = Migration(group_id, attempt, sample, c.version, served, held.instance, here, cost.bytes_moved,
                      cost.reprefill_tokens, cost.seconds, clock.at(cost.handed_over_at), clock.at(cost.adopted_at))
    previous = held.migrations if isinstance(held, ResumedResponse) else []
    shell = held.group if isinstance(held, ResumedResponse) else (held.group if carries_group else None)
    answer = ResumedResponse(group_id, attempt, sample, here, clock.now(), previous + [moved], group=shell)
    if isinstance(outcome, Continuation):
        answer.continuations = [outcome]
    else:
        answer.trajectory = Trajectory(group_id, sample, c.prompt_ids, outcome.token_ids, outcome.versions,
                                       outcome.logprobs, outcome.finished)
    return answer


def read_weights(version: int, path: str) -> WeightFiles:
    """A published version as Dask data (the weight store is read once; instances copy it from whoever holds it, and
    should every holder die, Dask runs this again: the store is the fallback)."""
    from storage.weight_store import WeightFiles

    return WeightFiles.read(version, path)


def _received(shipped: WeightFiles) -> WeightsReceived:
    """Where this worker copied `shipped` from and how long it took (its incoming-transfer log), found by the key of
    this task's dependency that holds it, ``("weights", version, ...)``: never a copy of an earlier run's key."""
    worker = get_worker()
    task = worker.state.tasks.get(worker.get_current_task())
    keys = {d.key for d in (task.dependencies if task is not None else ())
            if isinstance(d.key, tuple) and d.key[:2] == ("weights", shipped.version)}
    for entry in reversed(worker.transfer_incoming_log):
        if keys.intersection(entry["keys"]):
            return WeightsReceived(shipped.version, entry["who"], shipped.nbytes, entry["duration"])
    return WeightsReceived(shipped.version, "", shipped.nbytes, 0.0)  # held already (computed here)


# ---- reward (CPU worker) -----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def _tokenizer(model_path: str):
    from dora_tasks.emulation.task import SyntheticTokenizer, is_emulated_model
    from storage.objectstore import local_folder

    model_path = local_folder(model_path)  # on an object store: a copy in this worker's cache
    if is_emulated_model(model_path):  # task.name=emulated: no tokenizer, responses are synthetic
        return SyntheticTokenizer()
    from dora_tasks.model import load_tokenizer

    return load_tokenizer(model_path)


def _reward_fn(spec):
    """A dotted path is resolved once per worker; a callable comes unpickled with each task (a cache keyed by it would
    miss, or fail on an unhashable object), and reading its form again is cheap."""
    if isinstance(spec, str):
        return _reward_fn_at(spec)
    from dora_tasks.workloads.rewards import resolve_reward_fn

    return resolve_reward_fn(spec)


@functools.lru_cache(maxsize=16)
def _reward_fn_at(dotted: str):
    from dora_tasks.workloads.rewards import resolve_reward_fn

    return resolve_reward_fn(dotted)


def reward(rolled: list[Group | list[ResumedResponse]], model_path: str, reward_fn: str | Callable, timeout_s: float,
           isolation: str, memory_bytes: int) -> list[Group]:
    """Score every response of the groups one instance finished generating in one turn of the driver (a group whose
    responses moved comes as their resumed responses and is put together first) in the given isolation
    (`task.reward_isolation`); an exception, a timeout or a killed reward process is recorded on the trajectory,
    never raised."""
    from dora_tasks.workloads.rewards import score_isolated

    groups = [g if isinstance(g, Group) else assemble_group(g) for g in rolled]
    tokenizer, fn = _tokenizer(model_path), _reward_fn(reward_fn)
    for t in (t for g in groups for t in g.trajectories if not np.isnan(t.env_reward)):
        t.reward = t.env_reward  # an episode its environment rewarded is not scored by the reward function
    trajectories = [(g, t) for g in groups for t in g.trajectories if np.isnan(t.env_reward)]
    calls = [(g.prompt.text, tokenizer.decode(t.response_ids), g.prompt.answer, g.prompt.row_json)
             for g, t in trajectories]
    for (_, t), (value, error) in zip(trajectories, score_isolated(fn, calls, timeout_s, isolation, memory_bytes)):
        t.reward, t.reward_error = value, error
    return list(groups)


# ---- reward model (reward worker, label REWARD) -----------------------------------------------------------------
def model_reward(groups: list[Group], model_path: str) -> list[Group]:
    """Score every response of the groups one reward task scored with the reward model (`reward.model`) and combine
    its score with their rule reward (`reward.combine`). Scoring tasks running at once on this worker share forward
    passes (the plugin's batcher); each group records where it was scored and its share of the forward time."""
    from dora_tasks.plugins import reward_model_plugin
    from dora_tasks.workloads.reward_model import apply_scores, scoring_texts

    plugin = reward_model_plugin()
    scorer = plugin.scorer()
    scored = scorer.score(scoring_texts(plugin.reward, groups, _tokenizer(model_path).decode))
    return apply_scores(plugin.reward, list(groups), scored, get_worker().address, plugin.role)


def warm_up_reward_model() -> str:
    """Load the reward model and score one text before the run's clock starts; returns the worker's address."""
    from dora_tasks.plugins import reward_model_plugin

    reward_model_plugin().scorer().score(["warm-up"])
    return get_worker().address


# ---- advantage (CPU worker, complete groups) ---------------------------------------------------------------------
def advantage(groups: list[Group], estimator: str, filter_degenerate: bool = False) -> list[Group]:
    """Each group's advantages (`group_advantage`), for the groups one reward task scored."""
    return [group_advantage(g, estimator, filter_degenerate) for g in groups]


def group_advantage(group: Group, estimator: str, filter_degenerate: bool = False) -> Group:
    """Set each trajectory's advantage, one scalar from its group's rewards (`group_advantages`, the one place
    advantages are computed). Failed rewards count as 0 and stay recorded."""
    from dora_tasks.algorithms.advantages import group_advantages, group_is_degenerate

    rewards = np.nan_to_num(group.rewards, nan=0.0)
    for t, value in zip(group.trajectories, group_advantages(estimator, rewards).tolist()):
        t.advantage = value
    if filter_degenerate and group_is_degenerate(rewards):
        group.filtered = "zero_variance"
    return group


# ---- gate (CPU worker): re-checks the pure gate's decision on the actual data ------------------------------------
class StalenessViolation(RuntimeError):
    pass


def gate(update: int, max_staleness: int, group_size: int, allow_mixed_versions: bool,
         groups: list[Group]) -> TrainBatch:
    """Pass the batch to update `update` only if it keeps C1, C2 and C3; raise otherwise (nothing is trained)."""
    for g in groups:
        if not 0 <= update - g.version <= max_staleness:
            raise StalenessViolation(f"group {g.group_id} of version {g.version} in update {update} "
                                     f"(K={max_staleness})")
        if len(g.trajectories) != group_size:
            raise StalenessViolation(f"group {g.group_id} has {len(g.trajectories)} of {group_size} trajectories")
        mixed = [t.sample_idx for t in g.trajectories if t.distinct_versions - {g.version}]
        if mixed and not allow_mixed_versions:
            raise StalenessViolation(f"group {g.group_id}: trajectories {mixed} hold tokens of another version")
    return TrainBatch(update, list(groups), max_staleness)


# ---- update and publish (trainer, label TRAINER) -----------------------------------------------------------------
def update(batch: TrainBatch, weight_store: str) -> UpdateResult:
    """One policy update from version `batch.update`, then the publish of version `batch.update + 1`, in one task.

    One task, so that the trainer goes from one update straight to the next: with update lookahead the next batch
    reached the trainer (its gate finished, its data fetched) while this update trained, and its update starts when
    this task ends, without a round trip through the scheduler. The weights of version `batch.update + 1` are written
    before any later update changes them because both run on the trainer's one TRAINER slot, in version order: an
    update whose version the engine has not reached yet (an earlier batch's data is still on its way) goes back to
    the scheduler (`Reschedule`) and comes back after it."""
    from distributed import Reschedule

    from dora_tasks.plugins import trainer_plugin

    plugin = trainer_plugin()
    engine = plugin.engine_at(batch.update)  # TrainerLost on a restarted trainer
    if engine is None:
        raise Reschedule()
    start = plugin.clock.now()
    trainable = [g for g in batch.groups if not g.filtered]
    metrics = _stepped(engine, lambda: engine.train_step(TrainBatch(batch.update, trainable, batch.max_staleness)),
                       len(batch.groups), len(batch.groups) - len(trainable))
    end = plugin.clock.now()
    return UpdateResult(batch.update, metrics, start, end, publish(engine, weight_store, plugin.clock))


def update_part(batch: TrainBatch, before: UpdatePart | None, stragglers: bool) -> UpdatePart:
    """A streamed update (`dora.stream_updates`): compute one part of update `batch.update`'s batch, after the parts
    before it (`before`, a Dask dependency, so they run in order on the trainer's one TRAINER slot)."""
    from distributed import Reschedule

    from dora_tasks.plugins import trainer_plugin

    plugin = trainer_plugin()
    engine = plugin.engine_at(batch.update)
    if engine is None:
        raise Reschedule()
    start = plugin.clock.now()
    trainable = [g for g in batch.groups if not g.filtered]
    engine.accumulate(TrainBatch(batch.update, trainable, batch.max_staleness), stragglers)
    so_far = before or UpdatePart(batch.update)
    return UpdatePart(batch.update, so_far.filtered + len(batch.groups) - len(trainable),
                      so_far.spans + ((start, plugin.clock.now(), len(batch.groups)),))


def finish_update(parts: UpdatePart, weight_store: str) -> UpdateResult:
    """The optimizer step of a streamed update over every part computed, then the publish of `parts.update + 1`."""
    from dora_tasks.plugins import trainer_plugin

    plugin = trainer_plugin()
    engine = plugin.engine_at(parts.update)
    if engine is None:
        raise RuntimeError(f"update {parts.update}: the trainer left its version while its parts were computed")
    metrics = _stepped(engine, engine.finish_update, parts.groups, parts.filtered)
    end = plugin.clock.now()
    return UpdateResult(parts.update, metrics, parts.start_time, end, publish(engine, weight_store, plugin.clock),
                        busy_s=parts.busy_s, parts=parts.spans)


def _stepped(engine, step: Callable[[], dict], groups: int, filtered: int) -> dict[str, float]:
    """The optimizer step's metrics, or a skipped step (the version still advances) when an algorithmic filter left
    none of the update's groups in the loss."""
    metrics = step() if filtered < groups else {}
    if filtered == groups:
        engine.skip_step()
    return {**{k: float(v) for k, v in metrics.items()}, "groups_filtered": float(filtered)}


def publish(engine, weight_store: str, clock: Clock = Clock()) -> PublishedWeights:
    """Write the engine's weights, as the version it now holds, to the weight store (seconds on the run's clock)."""
    from storage.weight_store import WeightStore

    published = WeightStore(weight_store).publish(engine.version, engine.save_weights, overwrite=True)
    return PublishedWeights(published.version, published.path, clock.span(published.seconds))


def save_trainer_checkpoint(folder: str) -> str:
    from dora_tasks.plugins import trainer_plugin
    from storage.objectstore import staged

    with staged(folder) as local:  # on an object store: written locally, then uploaded
        trainer_plugin().held_engine().save_checkpoint(local)
    return folder


def load_trainer_checkpoint(folder: str, version: int) -> int:
    from dora_tasks.plugins import trainer_plugin
    from storage.objectstore import fetched

    engine = trainer_plugin().get_engine(version)
    with fetched(folder) as local:  # on an object store: a temporary local copy
        engine.load_checkpoint(local)
    return engine.version


def restore_trainer(version: int, checkpoint_folder: str | None) -> TrainerRestore:
    """A restarted trainer: a new engine on the published weights of `version`, with the optimizer state of the
    checkpoint in `checkpoint_folder` when there is one and the backend can take it alone (else a fresh one)."""
    from dora_tasks.plugins import trainer_plugin
    from storage.objectstore import fetched

    engine = trainer_plugin().start_engine(version)
    with fetched(checkpoint_folder) as local:  # on an object store: a temporary local copy
        taken = bool(local) and engine.load_optimizer_state(local)
    return TrainerRestore(get_worker().address, engine.version, optimizer_from=checkpoint_folder if taken else "")


# ---- warm-up: engines are created before the clock starts -----------------------------------------------------
def warm_up_rollout(version: int, weights_path: str, prompt_ids: list[int]) -> int:
    """Create this instance's engine, load `version` and generate once (first calls are slow)."""
    from dora_tasks.plugins import rollout_server

    server = rollout_server()
    server.generate(version, weights_path, prompt_ids, 1, 0)
    server.reload(weights_path)  # the first weight load of a process is slow too
    return version


def warm_up_trainer(version: int) -> int:
    """Create the train engine and save its weights once (the first save of a process is slow)."""
    import shutil
    import tempfile

    from dora_tasks.plugins import trainer_plugin

    engine = trainer_plugin().get_engine(version)
    scratch = tempfile.mkdtemp(prefix="dora-warm-up-")
    try:
        engine.save_weights(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return engine.version


# ---- held-out evaluation (CPU worker) ----------------------------------------------------------------------------
def evaluate(weights_path: str, prompts: list[Prompt], model_path: str, reward_fn: str, max_new_tokens: int,
             seed: int, timeout_s: float, isolation: str, memory_bytes: int) -> float:
    """Greedy held-out accuracy of a published version (the tokenizer comes from the initial model folder), its
    rewards under the same timeout and isolation as the run's; of an emulated model, the synthetic accuracy."""
    from dora_tasks.emulation.task import is_emulated_model, synthetic_accuracy
    from storage.objectstore import local_folder

    weights_path = local_folder(weights_path)  # on an object store: a copy in this worker's cache
    if is_emulated_model(weights_path):
        return synthetic_accuracy(prompts, _reward_fn(reward_fn))
    from dora_tasks.warmstart import evaluate as evaluate_policy

    return evaluate_policy(weights_path, prompts, _reward_fn(reward_fn), greedy=True, seed=seed,
                           max_new_tokens=max_new_tokens, tokenizer=_tokenizer(model_path),
                           reward_timeout_s=timeout_s, reward_isolation=isolation, reward_memory_bytes=memory_bytes)
