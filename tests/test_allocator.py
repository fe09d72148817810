"""The nanny's MALLOC_TRIM_THRESHOLD_ makes every tensor above 128 KiB an mmap of fresh pages; the engines' workers
undo it (`dora_tasks/allocator.py`). Measured as page faults of a loop that allocates and frees 1 MiB tensors."""
from __future__ import annotations

import subprocess
import sys

import pytest
from distributed import Client, LocalCluster

from dora_tasks.core.config import TrainConfig
from dora_tasks.plugins import TrainerPlugin

ALLOCATIONS = 200  # of 1 MiB: 256 pages each when mmapped


def page_faults_of_allocations() -> int:
    import resource

    import torch

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(ALLOCATIONS):
        torch.ones(1 << 18).sum()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def faults_in_subprocess(relax: bool) -> int:
    code = ("import sys; sys.path.insert(0, '.'); from tests.test_allocator import page_faults_of_allocations as f\n"
            + ("from dora_tasks.allocator import relax_malloc_trimming as r; assert r()\n" if relax else "")
            + "f(); print(f())")
    out = subprocess.run([sys.executable, "-c", code], env={"MALLOC_TRIM_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",
                                                            "PATH": ""}, capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_relaxed_thresholds_keep_freed_tensors_on_the_heap():
    trimmed, relaxed = faults_in_subprocess(False), faults_in_subprocess(True)
    assert trimmed > ALLOCATIONS * 100  # each allocation faulted its pages in again
    assert relaxed < trimmed / 20


@pytest.mark.slow
def test_the_trainer_worker_of_a_nanny_cluster_gets_the_relaxed_thresholds(tmp_path):
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, resources={"GPU": 1, "TRAINER": 1},
                      dashboard_address=None) as cluster, Client(cluster) as client:
        assert set(client.run(lambda: __import__("os").environ.get("MALLOC_TRIM_THRESHOLD_")).values()) == {"65536"}
        client.submit(page_faults_of_allocations, pure=False).result()  # warm
        before = client.submit(page_faults_of_allocations, pure=False).result()
        client.register_plugin(TrainerPlugin(str(tmp_path / "weights"), TrainConfig()))
        client.submit(page_faults_of_allocations, pure=False).result()
        after = client.submit(page_faults_of_allocations, pure=False).result()
    assert before > ALLOCATIONS * 100 and after < before / 20, (before, after)
