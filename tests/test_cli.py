"""`dora` command line: bad input is one line + exit 2 (no traceback), `dora config` prints resolved YAML, every
subcommand has --help, and the commands hand the right arguments to the modules they call."""
from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import yaml

from dora_tasks.core.config import load_config
from pipelines import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "configs")
SUBCOMMANDS = ("run", "warmstart", "resume", "audit", "plots", "config")


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, named", [
    (["config", "dora.max_staleness=x"], "dora.max_staleness"),  # wrong type
    (["config", "dora.nonsense=1"], "dora.nonsense"),  # unknown key
    (["config", "dora.max_staleness=-1"], "dora.max_staleness"),  # out of range
    (["config", "dora.rollout_batch_size=2"], "dora.rollout_batch_size"),  # RBS < TBS
    (["config", "--config", "no/such/file.yaml"], "no/such/file.yaml"),  # missing config file
    (["config", "dora.max_staleness"], "dora.max_staleness"),  # malformed override
    (["config", "max_staleness=1"], "max_staleness=1"),  # malformed override: no section
    (["run", "--config", "no/such/file.yaml"], "no/such/file.yaml"),
    (["warmstart", "train.engine=jax"], "train.engine"),
    (["config", "train.advantage=gae"], "train.advantage: got 'gae', allowed: dapo, "),  # the registry's names
    (["run", "train.loss=sft"], "train.loss: got 'sft', allowed: decoupled_ppo, "),  # checked on load, before work
    (["resume", "no/such/run"], "no/such/run"),
    (["resume", ".", "oops"], "oops"),
    (["audit", "no/such/store.zarr"], "no/such/store.zarr"),
    (["audit", "tests"], "no root zarr.json"),  # a folder that is not a store
    (["run", "task.reward_fn=no_such_module.fn"], "no_such_module"),  # checked before any cluster starts
    (["plots", "no/such/run"], "no/such/run"),
    (["run", "--bogus"], "--bogus"),
    (["frobnicate"], "frobnicate"),
    ([], "COMMAND"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, named):
    code, out, err = run_main(capsys, *argv)
    assert code == 2
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dora: error: ") and named in lines[0], err
    assert "Traceback" not in err


def test_invalid_yaml_file_is_one_line(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("dora:\n  max_staleness: [1,\n")
    code, _, err = run_main(capsys, "config", "--config", str(bad))
    assert code == 2 and len(err.splitlines()) == 1 and str(bad) in err


def test_no_traceback_through_the_real_entry_point(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", "run", "--config", str(tmp_path / "missing.yaml")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("dora: error: config file") and "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1


def test_real_bugs_keep_their_traceback(monkeypatch):
    monkeypatch.setattr(cli, "load", lambda args: int("not a number"))  # a plain ValueError is a bug, not input
    with pytest.raises(ValueError, match="invalid literal"):
        cli.main(["config"])


def test_config_prints_resolved_yaml_that_loads_back(capsys, tmp_path):
    path = os.path.join(CONFIGS, "cpu_demo.yaml")
    code, out, err = run_main(capsys, "config", "--config", path, "dora.max_staleness=3", "rollout.instances=3")
    assert code == 0 and err == ""
    printed = yaml.safe_load(out)
    expected = load_config(path, ["dora.max_staleness=3", "rollout.instances=3"])
    assert printed == expected.to_dict()
    again = tmp_path / "resolved.yaml"
    again.write_text(out)
    assert load_config(again) == expected  # the printed YAML is itself a complete config


def test_overrides_may_come_before_options(capsys):
    code, out, _ = run_main(capsys, "config", "dora.num_updates=5", "--config", os.path.join(CONFIGS, "cpu_demo.yaml"))
    assert code == 0 and yaml.safe_load(out)["dora"]["num_updates"] == 5


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(capsys, command):
    code, out, _ = run_main(capsys, command, "--help")
    assert code == 0
    assert out.startswith(f"usage: dora {command}") and len(out.splitlines()) > 4


def test_top_level_help_lists_the_subcommands(capsys):
    code, out, _ = run_main(capsys, "--help")
    assert code == 0 and all(c in out for c in SUBCOMMANDS)


@pytest.mark.parametrize("name", ["cpu_demo", "longtail_bench", "gpu_qwen_math"])
def test_shipped_configs_load(name):
    path = os.path.join(CONFIGS, f"{name}.yaml")
    if name == "gpu_qwen_math":  # its model folder exists only on the GPU cluster
        with pytest.raises(ValueError, match="model.path"):
            load_config(path)
        cfg = load_config(path, ["model.path="])
        assert (cfg.rollout.engine, cfg.train.engine, cfg.train.zero_stage) == ("vllm", "deepspeed", 2)
        assert cfg.task.dataset == "hf:BytedTsinghua-SIA/DAPO-Math-17k"
        assert cfg.task.reward_fn == "dora_tasks.workloads.rewards.math_verify_reward"
        assert cfg.cluster.scheduler_address.startswith("tcp://")
    else:
        cfg = load_config(path)
        assert cfg.model.path == "" and cfg.task.name == "countdown" and cfg.dora.max_staleness == 2
    with open(path) as f:
        assert f.read().lstrip().startswith("#"), "each shipped config opens with a comment saying what it is"


def test_cpu_demo_is_the_default_config(capsys):
    code, out, _ = run_main(capsys, "config")
    assert code == 0 and yaml.safe_load(out) == load_config(os.path.join(CONFIGS, "cpu_demo.yaml")).to_dict()


def fake_module(monkeypatch, name: str, **attrs) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)


def test_run_and_resume_call_the_pipeline(capsys, monkeypatch, tmp_path):
    calls = []
    summary = types.SimpleNamespace(to_text=lambda: "SUMMARY")
    fake_module(monkeypatch, "pipelines.streaming",
                run_pipeline=lambda cfg, inputs: calls.append(("run", cfg.dora.max_staleness)) or summary,
                resume_pipeline=lambda run_dir, overrides, inputs: calls.append(("resume", run_dir, overrides))
                or summary)
    assert run_main(capsys, "run", "--config", os.path.join(CONFIGS, "cpu_demo.yaml"), "dora.max_staleness=0")[:2] \
        == (0, "SUMMARY\n")
    assert run_main(capsys, "resume", str(tmp_path), "dora.num_updates=20")[0] == 0
    assert calls == [("run", 0), ("resume", str(tmp_path), ["dora.num_updates=20"])]


def test_run_reports_project_input_errors_in_one_line(capsys, monkeypatch):
    class DatasetError(ValueError):
        pass

    DatasetError.__module__ = "dora_tasks.workloads.datasets"

    def run_pipeline(cfg, inputs):
        raise DatasetError("'data.jsonl' row 3: missing key 'answer'")

    fake_module(monkeypatch, "pipelines.streaming", run_pipeline=run_pipeline)
    code, _, err = run_main(capsys, "run")
    assert code == 2 and err == "dora: error: 'data.jsonl' row 3: missing key 'answer'\n"


def test_unreachable_cluster_is_one_line_but_other_runtime_errors_are_not(capsys, monkeypatch):
    from pipelines.cluster import ClusterError

    def unreachable(cfg, inputs):
        raise ClusterError("cannot reach cluster.scheduler_address 'tcp://nowhere:8786'")

    fake_module(monkeypatch, "pipelines.streaming", run_pipeline=unreachable)
    code, _, err = run_main(capsys, "run")
    assert code == 2 and err.startswith("dora: error: cannot reach cluster.scheduler_address")
    fake_module(monkeypatch, "pipelines.streaming", run_pipeline=lambda cfg, inputs: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        cli.main(["run"])


def test_warmstart_and_audit_arguments(capsys, monkeypatch, tmp_path):
    seen = {}
    fake_module(monkeypatch, "dora_tasks.warmstart", warm_start=lambda cfg, out: seen.setdefault("out", out))
    fake_module(monkeypatch, "pipelines.run", initial_policy=lambda cfg: seen.setdefault("cached", "/cache/x"))
    fake_module(monkeypatch, "storage.audit", main=lambda argv, **_: seen.setdefault("argv", argv) and 1)
    code, out, _ = run_main(capsys, "warmstart", "--out", str(tmp_path / "ws"))
    assert code == 0 and seen["out"] == str(tmp_path / "ws") and f"model.path={tmp_path / 'ws'}" in out
    code, out, _ = run_main(capsys, "warmstart", "model.warmstart_steps=10")
    assert code == 0 and "model.path=/cache/x" in out
    assert run_main(capsys, "audit", str(tmp_path), "--max-staleness", "2", "--json")[0] == 1
    assert seen["argv"] == [str(tmp_path), "--max-staleness", "2", "--json"]


def test_plots_command_draws_from_a_store(capsys, tmp_path):
    from storage.synthetic import simulate_run
    from storage.trajectory_store import TrajectoryStore

    with TrajectoryStore.create(str(tmp_path / "trajectories.zarr"), {"group_size": 4, "max_staleness": 1}) as store:
        simulate_run(store, updates=4, group_size=4, max_staleness=1)
    code, out, err = run_main(capsys, "plots", str(tmp_path))
    assert code == 0, err
    assert sorted(os.listdir(tmp_path / "plots")) == ["learning.png", "staleness.png", "throughput.png",
                                                      "timeline.png"]
    assert out.count(".png") == 4


def test_ctrl_c_is_one_line_naming_the_folder_to_resume(capsys, monkeypatch, tmp_path):
    def interrupted(cfg, inputs):
        raise KeyboardInterrupt

    fake_module(monkeypatch, "pipelines.streaming", run_pipeline=interrupted)
    code, out, err = run_main(capsys, "run", f"storage.run_dir={tmp_path}")
    assert (code, out) == (130, "") and err == f"dora: stopped (Ctrl-C); continue with: dora resume {tmp_path}\n"
