"""The ``calculator`` environment: arithmetic, word problems and unit conversions.

Knows: how to generate its tasks from a seed (bare expressions such as ``37 * 12 + 5``, word
problems whose expression uses the numbers of the text, conversions between units of length,
mass, volume and time rounded to 2 decimals), a safe evaluator (``ast`` nodes for numbers,
``+ - * / // % **``, parentheses and ``round abs min max sqrt`` only; bounded length, node
count, exponent and magnitude; never ``eval``), the ``calculate`` and ``convert`` tools, and
its scripted expert (one tool call copying the numbers of the prompt, then ``The answer is
<tool output>.``). Does not know: variables, algebra, or units beyond its table.
"""

from __future__ import annotations

import ast
import math
import operator
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from war.rollout.envs.base import Task, ToolEnv, ToolError, ToolSpec
from war.rollout.envs.expert import ExpertTurn

MAX_EXPRESSION_CHARS = 200
MAX_NODES = 100
MAX_EXPONENT = 100
MAX_MAGNITUDE = 1e100
KINDS = ("arithmetic", "word", "convert")

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "round": round, "abs": abs, "min": min, "max": max, "sqrt": math.sqrt,
}
_UNITS: dict[str, tuple[str, float]] = {
    "kilometers": ("length", 1000.0), "meters": ("length", 1.0), "centimeters": ("length", 0.01),
    "millimeters": ("length", 0.001), "miles": ("length", 1609.344), "yards": ("length", 0.9144),
    "feet": ("length", 0.3048), "inches": ("length", 0.0254), "kilograms": ("mass", 1000.0),
    "grams": ("mass", 1.0), "pounds": ("mass", 453.59237), "ounces": ("mass", 28.349523125),
    "liters": ("volume", 1.0), "milliliters": ("volume", 0.001), "gallons": ("volume", 3.785411784),
    "days": ("time", 86400.0), "hours": ("time", 3600.0), "minutes": ("time", 60.0),
    "seconds": ("time", 1.0),
}
_ALIASES = {name[:-1]: name for name in _UNITS} | {
    "foot": "feet", "inch": "inches", "km": "kilometers", "m": "meters", "cm": "centimeters",
    "mm": "millimeters", "mi": "miles", "yd": "yards", "ft": "feet", "in": "inches",
    "kg": "kilograms", "g": "grams", "lb": "pounds", "lbs": "pounds", "oz": "ounces",
    "l": "liters", "litres": "liters", "ml": "milliliters", "gal": "gallons", "h": "hours",
    "hr": "hours", "min": "minutes", "s": "seconds", "sec": "seconds", "d": "days",
}
_ARITHMETIC = ("{a} + {b}", "{a} - {b}", "{a} * {b}", "{a} * {b} + {c}", "{a} + {b} * {c}",
               "({a} + {b}) * {c}", "{a} * {b} - {c}", "{p} / {b}", "{a} % {b}", "{a} ** 2 + {c}")
_ASK = ("What is {e}?", "Compute {e}.", "Calculate {e}.", "Evaluate {e}.",
        "What is the value of {e}?")
_WORD = (
    ("A {box} holds {a} {item}. How many {item} are in {b} {boxes}?", "{a} * {b}"),
    ("{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
     "{a} + {b}"),
    ("{name} had {big} {item} and gave away {b} of them. How many {item} are left?",
     "{big} - {b}"),
    ("{name} shares {p} {item} equally among {b} friends. How many {item} does each friend "
     "get?", "{p} / {b}"),
    ("A ticket costs {a} dollars. {name} buys {b} tickets and pays a {c} dollar fee. How many "
     "dollars does {name} pay in total?", "{a} * {b} + {c}"),
    ("{name} reads {a} pages a day for {b} days and then {c} more pages. How many pages does "
     "{name} read in all?", "{a} * {b} + {c}"),
    ("There are {b} {boxes} with {a} {item} in each, and {small} {item} are taken out. How many "
     "{item} remain?", "{b} * {a} - {small}"),
)
_CONVERT = ("Convert {v} {f} to {t} (round to 2 decimals).",
            "How many {t} are in {v} {f}? Round to 2 decimals.",
            "Express {v} {f} in {t}, rounded to 2 decimal places.")
_NAMES = ("Alice", "Bob", "Carla", "Dmitri", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jamal",
          "Keiko", "Liam", "Maya", "Nils", "Olga", "Pedro")
_ITEMS = ("apples", "pencils", "books", "marbles", "cookies", "stamps", "cards", "shells")
_BOXES = (("box", "boxes"), ("crate", "crates"), ("basket", "baskets"), ("pouch", "pouches"),
          ("jar", "jars"))


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        result = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ToolError(f"exponent {right} is larger than {MAX_EXPONENT}")
        result = _BINARY[type(node.op)](left, right)
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id in _FUNCTIONS and not node.keywords):
        args = [_eval(arg) for arg in node.args]
        if node.func.id == "round" and len(args) == 2 and abs(args[1]) > 15:
            raise ToolError("round takes at most 15 digits")
        result = _FUNCTIONS[node.func.id](*args)
    else:
        raise ToolError(f"unsupported syntax: {ast.unparse(node)[:40]!r} (allowed: numbers, "
                        f"+ - * / // % **, parentheses, {', '.join(_FUNCTIONS)})")
    if not isinstance(result, int | float) or abs(result) > MAX_MAGNITUDE:
        raise ToolError("result is not a real number below 1e100")
    return result


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ToolError for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"invalid expression: {expression!r}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ToolError(f"expression has more than {MAX_NODES} syntax nodes")
    try:
        value: int | float = _eval(tree.body)
    except (ZeroDivisionError, OverflowError, ValueError, TypeError) as exc:
        raise ToolError(f"cannot evaluate {expression!r}: {exc}") from None
    return value


def format_number(value: int | float) -> str:
    """Integers (and integral floats below 1e15) without a decimal point, else 10 digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".10g") if isinstance(value, float) else str(value)


def convert(value: float, from_unit: str, to_unit: str) -> str:
    """``value`` in ``to_unit``, rounded to 2 decimals (``"8.05"``); ToolError for bad units."""
    units = []
    for unit in (from_unit, to_unit):
        key = unit.strip().lower()
        key = _ALIASES.get(key, key)
        if key not in _UNITS:
            raise ToolError(f"unknown unit {unit!r} (known: {', '.join(_UNITS)})")
        units.append(_UNITS[key])
    (dim_from, f_from), (dim_to, f_to) = units
    if dim_from != dim_to:
        raise ToolError(f"cannot convert {dim_from} ({from_unit}) to {dim_to} ({to_unit})")
    result = value * f_from / f_to
    if not math.isfinite(result):  # (a float past its range: "inf" is no answer)
        raise ToolError(f"cannot convert {value!r} {from_unit} to {to_unit}: the result is "
                        "too large")
    return f"{round(result, 2):.2f}"


def _calculate(expression: str) -> str:
    return format_number(evaluate(expression))


def _task(rng: random.Random, kind: str) -> tuple[str, dict[str, Any]]:
    a, b, c = rng.randint(2, 60), rng.randint(2, 12), rng.randint(1, 40)
    nums = {"a": a, "b": b, "c": c, "big": b + rng.randint(1, 60), "p": b * rng.randint(2, 20),
            "small": rng.randint(1, a * b - 1)}
    if kind == "arithmetic":
        expression = rng.choice(_ARITHMETIC).format(**nums)
        return rng.choice(_ASK).format(e=expression), {"kind": kind, "expression": expression}
    if kind == "word":
        question, expression = rng.choice(_WORD)
        box, boxes = rng.choice(_BOXES)
        words = {"name": rng.choice(_NAMES), "item": rng.choice(_ITEMS), "box": box, "boxes": boxes}
        return (question.format(**nums, **words),
                {"kind": kind, "expression": expression.format(**nums)})
    while True:
        f, t = rng.sample(sorted(_UNITS), 2)
        v: int | float = rng.randint(1, 500) if rng.random() < 0.7 else rng.randint(1, 999) / 10
        if _UNITS[f][0] == _UNITS[t][0] and 0.1 <= float(convert(v, f, t)) <= 1e6:
            data = {"kind": kind, "value": v, "from_unit": f, "to_unit": t}
            return rng.choice(_CONVERT).format(v=v, f=f, t=t), data


def sample_tasks(n: int, seed: int) -> list[Task]:
    """``n`` tasks from ``seed``, kinds in rotation; a prefix of a longer sample."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    rng, tasks = random.Random(seed), []
    for i in range(n):
        prompt, data = _task(rng, KINDS[(seed + i) % len(KINDS)])
        if data["kind"] == "convert":
            answer = convert(data["value"], data["from_unit"], data["to_unit"])
        else:
            answer = _calculate(data["expression"])
        tasks.append(Task(f"calculator-{seed}-{i}", "calculator", prompt, answer, data))
    return tasks


class CalculatorEnv(ToolEnv):
    """Stateless tools; the task only fixes the question and its answer."""

    name = "calculator"

    def system_prompt(self) -> str:
        return ("You are a careful math assistant. Use the calculate tool for arithmetic and the "
                "convert tool for unit conversions instead of computing in your head. When you "
                "have the result, reply with: The answer is <result>.")

    def tools(self) -> list[ToolSpec]:
        return [
            ToolSpec.build("calculate", "Evaluate an arithmetic expression with numbers, + - * / "
                           "// % **, parentheses and round, abs, min, max, sqrt.",
                           expression=("string", "The expression, e.g. 37 * 12 + 5")),
            ToolSpec.build("convert", "Convert a value between units of length, mass, volume or "
                           "time; the result is rounded to 2 decimals.",
                           value=("number", "The value to convert"),
                           from_unit=("string", "The unit of the value, e.g. miles"),
                           to_unit=("string", "The target unit, e.g. kilometers")),
        ]

    def _handlers(self) -> Mapping[str, Callable[..., str]]:
        return {"calculate": _calculate, "convert": convert}

    def _build(self, task: Task) -> None:
        if task.data.get("kind") not in KINDS:
            raise ValueError(f"calculator task {task.task_id}: unknown kind "
                             f"{task.data.get('kind')!r}")

    def expert_turn(self, task: Task, outputs: Sequence[str]) -> ExpertTurn:
        """Call the tool with the numbers of the prompt, then answer with its output."""
        if outputs:
            return ExpertTurn.final(outputs[-1].strip())
        data = task.data
        if data["kind"] == "convert":
            return ExpertTurn.call(
                f"I will convert {data['value']} {data['from_unit']} to {data['to_unit']}.",
                "convert", value=data["value"], from_unit=data["from_unit"],
                to_unit=data["to_unit"])
        return ExpertTurn.call(f"I will compute {data['expression']} with the calculator.",
                               "calculate", expression=data["expression"])
