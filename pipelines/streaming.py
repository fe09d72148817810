"""Multi-version streaming rollout as a growing Dask graph: the whole dataflow on one screen.

    prompts ──► rollout(v)* ──► reward(groups) ──► advantage(groups) ──► gate(u) ──► update(u) + publish(u+1)
                  ROLLOUT            CPU                 CPU                 CPU        TRAINER
                                      └─► reward-model(groups) ─┘ REWARD, with `reward.model`

The graph is never precomputed. Each turn of the loop (1) lets the orchestrator, told which responses the rollout
servers reported ended (their rows are free), start new groups on the newest version, move idle instances and
(`rollout.switching=migrate`) move running responses between instances of their version, (2) asks the version gate
whether update `u` may start, submitting gate -> update (which publishes u + 1) if so (with `dora.update_lookahead`,
the batch of `u + 1` can be handed over while `u` still trains), then records what was published (store rows,
metrics, evaluation, checkpoint: after the trainer has its next batch), (3) waits for whichever future finishes first,
and (4) scores the groups whose rollout ended, with one reward and one advantage task for those of one instance. Groups
of several versions are in flight at once; finished groups stream into the next batch; the gate keeps every batch
within K versions.
"""
from __future__ import annotations

from pipelines.driver import Driver
from pipelines.events import UpdatePartTask
from pipelines.orchestrator import Migrate, Start
from pipelines.run import open_run

TICK_S = 0.5


def stream(d: Driver, on_turn=None) -> None:
    """Drive the run to `dora.num_updates`; `on_turn(driver)` is called once a turn (tests inject faults there)."""
    while d.gate.next_update < d.cfg.dora.num_updates:
        d.sync_instances()
        d.take_server_reports()  # responses that ended free their rows; KV tokens held, where requests migrate
        for action in d.orchestrator.decide(d.gate.capacity()):  # new prompts -> newest version
            if isinstance(action, Start):
                d.submit_group(action)  # rollout(v)
            elif isinstance(action, Migrate):
                d.migrate(action)  # hand-over(source) -> resume(v, group, sample)* on the target
            else:
                d.emit(action)  # Load: an instance assigned a version
        d.send_orders()  # one hand-over order per source
        while d.may_hand_over() and (decision := d.gate.decide()) is not None:
            d.submit_update(decision)  # gate(u) -> update(u) + publish(u+1)
        d.acted()  # the driver's reaction lag: from a future's end to these decisions
        d.record_published()  # store rows, metrics, evaluation, checkpoint: after the trainer has its next batch
        for future in d.wait_any(TICK_S):  # whichever finishes first
            d.on_done(future)
        d.stream_in_scored()  # streamed updates: the stragglers scored this turn go together, once the trainer is free
        d.acted((UpdatePartTask.__name__,))  # a part is acted on: the next one went, or the trainer waits for data
        d.submit_scoring()  # the groups that finished rolling out -> reward [-> reward model] -> advantage
        d.end_turn()
        if on_turn is not None:
            on_turn(d)
    d.record_published()


def run_pipeline(cfg, inputs=None) -> "RunSummary":  # noqa: F821
    """Run a job from scratch; returns its summary (paths, metrics, audit). `inputs`: the Python objects of
    `pipelines.api.Pipeline` (`RunInputs`)."""
    with open_run(cfg, inputs=inputs) as run:
        stream(run.driver)
        return run.finish()


def resume_pipeline(run_dir: str, overrides: list[str] | None = None, inputs=None) -> "RunSummary":  # noqa: F821
    """Continue a run from its last checkpoint (the driver was killed, or its trainer died)."""
    with open_run(None, resume_dir=run_dir, overrides=overrides or [], inputs=inputs) as run:
        stream(run.driver)
        return run.finish()


