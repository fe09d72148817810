"""A multi-turn pipeline defined in Python: the policy may call a calculator tool before it answers.

    python examples/tool_environment.py                       # a short run on the embedded cluster
    python examples/tool_environment.py dora.num_updates=60   # any config override

The task is the built-in arithmetic one (`47*86=` -> `4042`), whose warm start shows the tool on half of the prompts.
The environment is a class written here, given as a Python object: an episode's model turn that ends with
`<calc>expression</calc>` gets `<result>value</result>` back (environment tokens: stored, masked out of the loss),
up to `MAX_CALLS` calls per episode, after which the tool answers `<result>no more calls</result>`. Each episode gets
its own instance (the class is the factory). The task's reward scores the final answer; the summary's `episodes:`
line gives the turns per episode and the tool calls.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from dora_tasks.workloads.calculator import CalculatorError, evaluate, show
from dora_tasks.workloads.environments import Environment, Step
from pipelines import Pipeline

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "cpu_demo.yaml"
SETTINGS = [  # a few minutes on a laptop's CPU; override any of them on the command line
    "storage.run_dir=runs/example_tool_environment", "task.name=arithmetic", "dora.num_updates=20",
    "rollout.max_new_tokens=48", "task.max_turns=3", "task.eval_prompts=32", "task.eval_interval=10",
    "storage.checkpoint_interval=10",
]
MAX_CALLS = 2
CALL = re.compile(r"<calc>(.*?)</calc>\s*$", re.DOTALL)


class BudgetCalculator(Environment):
    """A calculator with a budget of MAX_CALLS calls per episode."""

    stop = ("</calc>",)

    def __init__(self) -> None:
        self.calls = 0

    def step(self, turn: str) -> Step:
        call = CALL.search(turn)
        if call is None:  # no tool call: this turn is the answer
            return Step(done=True)
        self.calls += 1
        if self.calls > MAX_CALLS:
            return Step(observation="<result>no more calls</result>", tool_call=True)
        try:
            result = show(evaluate(call.group(1)))
        except CalculatorError:
            result = "error"
        return Step(observation=f"<result>{result}</result>", tool_call=True)


def main(overrides: list[str]) -> int:
    summary = Pipeline(CONFIG, overrides=SETTINGS + overrides, environment=BudgetCalculator).run()
    print(summary.to_text())
    return 0 if summary.audit_ok else 1


if __name__ == "__main__":  # worker processes start by importing this file: the run starts only from here
    sys.exit(main(sys.argv[1:]))
