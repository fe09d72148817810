"""Peer-to-peer weights: each policy version is one piece of Dask data, ``("weights", v, run_tag)``, that instances copy
from one another instead of each reading the weight store.

The store is read once per version, by a task on a CPU worker (`steps.read_weights`). The groups an instance runs on
a version, until one of them has finished there, take that key as an argument, so Dask copies it to the instance
before they start, from whichever worker holds it: the reader, or an instance that already received it (Dask
spreads its copies among the holders). Each copy is timed by the receiving worker and recorded with its group
(`Group.weights`, the update metrics `weights_peer_*`). Should every holder die, Dask runs the read again: the store
is the fallback. A version's key is released when the weight store lets the version go. Under `train.lora` a
version's folder is its adapter, so the copies move the adapter alone (instances hold the base from their start).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from distributed import Client, Future

from dora_tasks import steps
from pipelines.cluster import CPU
from storage.weight_store import WeightStore


@dataclass
class SharedWeights:
    client: Client
    store: WeightStore
    run_tag: str = ""  # ends the keys, as every key of the run (`Driver.task_key`)
    futures: dict[int, Future] = field(default_factory=dict)  # version -> ("weights", v, run_tag)
    loaded: set[tuple[str, int]] = field(default_factory=set)  # (instance, version) the instance holds

    def for_group(self, instance: str, version: int) -> Future | None:
        """What a group of `version` on `instance` takes along: the version's weights until the instance has them."""
        if (instance, version) in self.loaded:
            return None
        if version not in self.futures:
            self.futures[version] = self.client.submit(steps.read_weights, version, self.store.path_for(version),
                                                       key=("weights", version, self.run_tag), resources=CPU,
                                                       pure=False)
        return self.futures[version]

    def on_loaded(self, instance: str, version: int) -> None:
        """`instance` holds `version` (a group of it finished there, or the warm-up loaded it)."""
        self.loaded.add((instance, version))

    def retain(self, keep: set[int]) -> None:
        """Release the versions the weight store no longer keeps (their copies leave the workers' memory)."""
        for version in [v for v in self.futures if v not in keep]:
            del self.futures[version]
        self.loaded = {(i, v) for i, v in self.loaded if v in keep}
