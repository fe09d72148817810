"""What a version switch moves and costs: a LoRA adapter against the full model, measured and projected.

    python benchmarks/lora_sync.py                  # the long-tail benchmark's model, rank 8, 20 repetitions
    python benchmarks/lora_sync.py --rank 16 --reps 50

Measured on this machine, on the model of `configs/longtail_bench.yaml` (its `model` section, fresh weights: sizes
and times do not depend on their values), the median over `--reps` versions of each step a version takes from the
trainer to a rollout instance of the transformers engine: publish (`steps.publish`: the trainer writes the version
into the weight store), read (`WeightFiles.read`: the store read once, the bytes every peer copy moves) and load
(`HFRolloutEngine.load_version`: the full model copied in, or the adapter merged into the base).

Projected for a 32B model by bytes over bandwidth with the emulation's cost model (`dora_tasks/emulation`, the
`emulation` config defaults: accelerator, tensor parallelism, store bandwidth): a version moved to an instance from a
peer (network bandwidth of each of its `tp` accelerators) or from the weight store.

Output: benchmarks/results/lora_sync.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def measure(model_cfg, rank: int, reps: int, work: str) -> dict[str, dict[str, float]]:
    """{"full"|"adapter": {bytes, publish_s, read_s, load_s}}: medians over `reps` published versions."""
    import torch

    from dora_tasks.core.config import RolloutConfig, TrainConfig
    from dora_tasks.core.config_lora import LoraConfig
    from dora_tasks.engines.hf_rollout import HFRolloutEngine
    from dora_tasks.engines.torch_trainer import TorchTrainEngine
    from dora_tasks.model import CharTokenizer, build_model, save_policy

    torch.set_num_threads(1)
    tokenizer = CharTokenizer()
    base = save_policy(build_model(model_cfg, tokenizer.vocab_size), tokenizer, os.path.join(work, "base"))
    rollout = HFRolloutEngine(base, RolloutConfig())
    results = {}
    for kind, lora_cfg in (("full", LoraConfig()), ("adapter", LoraConfig(rank=rank, alpha=2.0 * rank))):
        trainer = TorchTrainEngine(base, TrainConfig(lora=lora_cfg), base_path=base)
        results[kind] = _switches(trainer, rollout, os.path.join(work, kind), reps)
    return results


def _switches(trainer, rollout, store_root: str, reps: int) -> dict[str, float]:
    from dora_tasks import steps
    from storage.weight_store import WeightFiles

    samples: dict[str, list[float]] = {"publish_s": [], "read_s": [], "load_s": [], "bytes": []}
    for version in range(1, reps + 1):
        trainer.version = version
        published = steps.publish(trainer, store_root)
        start = time.perf_counter()
        files = WeightFiles.read(version, published.path)
        read = time.perf_counter() - start
        folder = files.local_folder()
        start = time.perf_counter()
        rollout.load_version(version, folder)
        samples["load_s"].append(time.perf_counter() - start)
        samples["publish_s"].append(published.seconds)
        samples["read_s"].append(read)
        samples["bytes"].append(float(files.nbytes))
    return {key: statistics.median(values) for key, values in samples.items()}


def projected(rank: int) -> dict:
    """Seconds to move a version of Qwen2.5-32B to one instance, full model vs adapter, peer and store paths."""
    from dora_tasks.core.config_emulation import EmulationConfig
    from dora_tasks.emulation.cost_model import cost_model_from

    emulation = EmulationConfig(model="qwen2.5-32b")
    cost = cost_model_from(emulation)
    m, tp = cost.model, cost.tp
    full = m.weight_bytes
    adapter = m.adapter_bytes(rank)  # rank-r adapters on every attention and MLP projection
    peer, store = tp * cost.accelerator.network_bandwidth, tp * cost.store_bandwidth
    return {"model": m.name, "accelerator": cost.accelerator.name, "tp": tp, "rank": rank,
            "full_bytes": full, "adapter_bytes": adapter,
            "full_peer_s": full / peer, "adapter_peer_s": adapter / peer,
            "full_store_s": full / store, "adapter_store_s": adapter / store}


def markdown(measured: dict, projection: dict, setup: dict) -> str:
    full, adapter = measured["full"], measured["adapter"]
    lines = [f"## Version switch: LoRA adapter vs full model ({time.strftime('%Y-%m-%d %H:%M')})", "",
             (f"Measured: the model of `configs/longtail_bench.yaml` ({setup['model']}), LoRA rank {setup['rank']} on "
              f"every projection, median of {setup['reps']} versions, transformers engine, local weight store."), "",
             "| what moves | bytes | publish s | read s | load s | total s |", "|---|---|---|---|---|---|"]
    for name, row in (("full model", full), ("adapter", adapter)):
        total = row["publish_s"] + row["read_s"] + row["load_s"]
        lines.append(f"| {name} | {row['bytes']:.0f} | {row['publish_s']:.4f} | {row['read_s']:.4f} | "
                     f"{row['load_s']:.4f} | {total:.4f} |")
    p = projection
    lines += ["", (f"Projected: {p['model']} on {p['accelerator']} instances of tp={p['tp']}, LoRA rank {p['rank']} "
                   "on every projection, bytes over bandwidth (emulation defaults)."), "",
              "| what moves | bytes | from a peer s | from the store s |", "|---|---|---|---|",
              f"| full model | {p['full_bytes']:.3g} | {p['full_peer_s']:.3f} | {p['full_store_s']:.2f} |",
              f"| adapter | {p['adapter_bytes']:.3g} | {p['adapter_peer_s']:.4f} | {p['adapter_store_s']:.3f} |"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "longtail_bench.yaml"))
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()

    from dora_tasks.core.config import load_config

    model_cfg = load_config(args.config).model
    with tempfile.TemporaryDirectory(prefix="lora-sync-") as work:
        measured = measure(model_cfg, args.rank, args.reps, work)
    projection = projected(args.rank)
    setup = {"model": f"hidden {model_cfg.hidden_size}, {model_cfg.num_layers} layers, {model_cfg.num_heads} heads",
             "rank": args.rank, "reps": args.reps}
    text = markdown(measured, projection, setup)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "lora_sync.json"), "w") as f:
        json.dump({"setup": setup, "measured": measured, "projected": projection}, f, indent=1)
    with open(os.path.join(args.out, "lora_sync.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
