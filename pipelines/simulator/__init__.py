"""A discrete-event simulator in virtual time: the real `VersionGate` and `Orchestrator` driven by emulated engines
whose time comes from `dora_tasks.emulation` (the cost model and the DAPO-Math-like lengths), for sweeps no machine
here can emulate (thousands of accelerators, K from 0 to 8). `dora simulate` is its command line.

Modules: `engine` (one continuous-batching instance, advanced analytically), `modes` (sync, one-step, partial, dora
as strategies, and the rollout/trainer split rule), `core` (the event loop around the gate and orchestrator),
`record` (the metrics), `config` (settings).
"""
from __future__ import annotations

from pipelines.simulator.config import SimConfig, SimulatorError
from pipelines.simulator.record import SimResult


def simulate(cfg: SimConfig, cost, lengths) -> SimResult:
    """Run one configuration to its last step and return its steady-state figures."""
    from pipelines.simulator.core import Simulation

    return Simulation(cfg, cost, lengths).run().result()


__all__ = ["SimConfig", "SimResult", "SimulatorError", "simulate"]
