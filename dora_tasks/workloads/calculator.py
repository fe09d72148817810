"""A calculator tool and the arithmetic task it helps with: the built-in multi-turn environment.

Task (`task.name=arithmetic`): prompt `47*86=`, answer `4042`, products of two numbers in [10, 99]. A tiny policy
rarely multiplies right in its head, but it can copy: with the tool its episode is

    model:       <calc>47*86</calc>          (the turn ends at the stop string `</calc>`)
    environment: <result>4042</result>       (environment tokens: stored, left out of the loss)
    model:       4042<eos>

Reward (`reward`): 1.0 when the response without its `<calc>...</calc>` and `<result>...</result>` spans is exactly
the answer, else 0.0; the tool's result alone earns nothing, the model has to state it. The warm start imitates
demonstrations that use the tool on half of the prompts and answer directly on the other half
(`demonstration`), so the warm-started policy sometimes calls the tool and RL can learn when it pays. Without
`task.environment` (the no-tool baseline) the same policy still writes `<calc>`, and then has to write the result
itself.

The calculator (`evaluate`) is an arithmetic evaluator over Python's syntax tree, not `eval`: integer and decimal
numbers, + - * / // %, unary signs and parentheses only, at most MAX_EXPRESSION_CHARS characters and results
within MAX_MAGNITUDE; anything else answers `<result>error</result>` (still a tool call).
"""
from __future__ import annotations

import ast
import json
import operator
import re

import numpy as np

from dora_tasks.core.records import Prompt
from dora_tasks.workloads.environments import Environment, Step

MAX_EXPRESSION_CHARS = 64
MAX_MAGNITUDE = 10**15  # bounds every intermediate result: no expression of a few characters can blow up memory
OPERAND_RANGE = (10, 99)
TOOL_DEMO_EVERY = 2  # every second prompt's demonstration uses the tool: the warm start calls it sometimes
_CALL = re.compile(r"<calc>(.*?)</calc>\s*$", re.DOTALL)
_SPANS = re.compile(r"<calc>.*?</calc>|<result>.*?</result>", re.DOTALL)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, too long, divides by zero or leaves the allowed magnitude."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (see the module docstring); CalculatorError otherwise."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an expression: {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
    raise CalculatorError(f"not allowed: {type(node).__name__}")


def _bounded(value: int | float) -> int | float:
    if not abs(value) <= MAX_MAGNITUDE:  # also refuses nan
        raise CalculatorError(f"beyond {MAX_MAGNITUDE:.0e}")
    return value


def show(value: int | float) -> str:
    """The text of a result: an integer as such, else at most six decimals."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6f}".rstrip("0")


class CalculatorEnvironment(Environment):
    """Answers a turn that ends with `<calc>expression</calc>` with `<result>value</result>`; any other turn is the
    answer and ends the episode (its reward comes from the task's reward function)."""

    stop = ("</calc>",)

    def step(self, turn: str) -> Step:
        call = _CALL.search(turn)
        if call is None:
            return Step(done=True)
        try:
            result = show(evaluate(call.group(1)))
        except CalculatorError:
            result = "error"
        return Step(observation=f"<result>{result}</result>", tool_call=True)


# ---- the arithmetic task -----------------------------------------------------------------------------------------
def make_prompts(n: int, seed: int, tokenizer, start_id: int = 0) -> list[Prompt]:
    """`n` prompts `a*b=` with ids `start_id ..`; token ids are bos + the encoded prompt."""
    low, high = OPERAND_RANGE
    pairs = np.random.default_rng(seed).integers(low, high + 1, size=(n, 2))
    prompts = []
    for i, (a, b) in enumerate(pairs.tolist()):
        text = f"{a}*{b}="
        prompts.append(Prompt(start_id + i, text, str(a * b), (tokenizer.bos_id, *tokenizer.encode(text)),
                              row_json=json.dumps({"a": a, "b": b})))
    return prompts


def demonstration(prompt: Prompt) -> str:
    """What the warm start imitates: the tool call, its result and the answer on every TOOL_DEMO_EVERY-th prompt,
    the bare answer on the others."""
    if prompt.prompt_id % TOOL_DEMO_EVERY:
        return prompt.answer
    return f"<calc>{prompt.text.rstrip('=')}</calc><result>{prompt.answer}</result>{prompt.answer}"


def reward(prompt_text: str, response_text: str, answer: str) -> float:
    """1.0 when the response without its tool calls and results is exactly the answer, else 0.0."""
    return 1.0 if _SPANS.sub("", response_text).strip() == answer.strip() else 0.0
