"""The ``sqlite`` environment: questions answered by querying a small generated shop database.

Knows: how to generate a database from a seed (``customers(id, name, city)`` and
``orders(id, customer_id, product, amount, year)``, a few dozen rows), its question kinds and
their answers (computed in Python from the generated rows, not by SQL), the ``query`` tool and
its scripted expert (SQL templated from the question, copying names, cities, years and the
customer id read from a previous output; then ``The answer is <last output line>.``).

Safety: the database lives in memory (nothing on disk), opened with ``PRAGMA query_only`` and an
authorizer that allows reading only (no writes, DDL, PRAGMA or ATTACH); a progress handler
aborts a query after ``query_time_s``; values (and the SQL itself) are capped at 4,000 bytes
and LIKE/GLOB patterns at 200, rows at 100 columns and output at ``max_rows`` rows of at most
4 MB of values in all. (The handler runs between SQLite's steps, never inside one function
call: ``trim``, ``instr``, ``replace``, ``LIKE`` and ``GLOB`` cost the product of their
arguments' lengths, so those caps are what keep one call, and one row of such calls, short.)
Does not know: SQL beyond what SQLite executes, or any other schema.
"""

from __future__ import annotations

import math
import random
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from war.rollout.envs.base import Task, ToolEnv, ToolEnvConfig, ToolError, ToolSpec
from war.rollout.envs.expert import ExpertTurn

KINDS = ("city", "orders_in_year", "city_total", "max_order", "city_count")
_FIRST = ("Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Irene", "Jack",
          "Karen", "Liam", "Maria", "Nora", "Oscar", "Paula", "Rosa", "Victor")
_LAST = ("Smith", "Lee", "Garcia", "Brown", "Chen", "Novak", "Silva", "Kim", "Patel", "Meyer",
         "Rossi", "Dubois", "Ito", "Khan")
_CITIES = ("Paris", "Berlin", "Madrid", "Rome", "Tokyo", "Lisbon", "Oslo", "Vienna", "Prague",
           "Dublin", "Boston", "Denver", "Austin", "Seattle")
_PRODUCTS = ("laptop", "phone", "desk", "chair", "lamp", "monitor", "keyboard", "printer",
             "camera", "headphones", "tablet", "router")
_ASK = {
    "city": ("Which city is customer {name} from?", "In which city does the customer {name} "
             "live?", "What city is {name} from? Look it up in the database."),
    "orders_in_year": ("How many orders did {name} place in {year}?", "Count the orders that "
                       "{name} placed in {year}.", "In {year}, how many orders were placed by "
                       "{name}?"),
    "city_total": ("What is the total amount spent by customers from {city}?", "How much did "
                   "customers from {city} spend in total?", "Sum the order amounts of all "
                   "customers who live in {city}."),
    "max_order": ("What is the largest order amount of {name}?", "What was the biggest single "
                  "order placed by {name}?", "Find the highest amount {name} paid for one order."),
    "city_count": ("How many customers are from {city}?", "How many of our customers live in "
                   "{city}?", "Count the customers based in {city}."),
}
_READ_ACTIONS = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                           sqlite3.SQLITE_RECURSIVE})
_MAX_COLUMNS = 100
_MAX_RESULT_BYTES = 4_000_000  # of the values of the rows shown
# (a 2-argument trim of 4 kB values takes ~3 ms, a row of them as the SQL allows ~0.5 s; with
# 100 kB values a 0.2 s query ran 68 s, as the handler cannot interrupt a call)
_MAX_VALUE_BYTES = 4_000
_MAX_PATTERN_BYTES = 200
Customer = tuple[int, str, str]
Order = tuple[int, int, str, int, int]


def generate(seed: int) -> tuple[list[Customer], list[Order]]:
    """The rows of the database of ``seed``: (id, name, city) and
    (id, customer_id, product, amount, year)."""
    rng = random.Random(seed)
    names = rng.sample([f"{first} {last}" for first in _FIRST for last in _LAST],
                       rng.randint(6, 10))
    cities = rng.sample(_CITIES, 4)
    customers = [(i + 1, name, rng.choice(cities)) for i, name in enumerate(names)]
    orders = [(i + 1, rng.randint(1, len(customers)), rng.choice(_PRODUCTS), rng.randint(5, 900),
               rng.randint(2020, 2024)) for i in range(rng.randint(15, 30))]
    return customers, orders


def _question(rng: random.Random, kind: str, seed: int) -> tuple[dict[str, Any], str]:
    customers, orders = generate(seed)
    buyers = sorted({o[1] for o in orders})
    data: dict[str, Any] = {"kind": kind, "seed": seed}
    if kind in ("city", "orders_in_year", "max_order"):
        cid = rng.choice(buyers) if kind == "max_order" else rng.randint(1, len(customers))
        data["name"] = customers[cid - 1][1]
        mine = [o for o in orders if o[1] == cid]
        if kind == "city":
            return data, customers[cid - 1][2]
        if kind == "max_order":
            return data, str(max(o[3] for o in mine))
        years = [o[4] for o in mine]
        data["year"] = rng.choice(years) if years and rng.random() < 0.75 else rng.randint(2020,
                                                                                           2024)
        return data, str(sum(1 for year in years if year == data["year"]))
    owners = buyers if kind == "city_total" else [c[0] for c in customers]
    data["city"] = city = rng.choice(sorted({customers[cid - 1][2] for cid in owners}))
    if kind == "city_count":
        return data, str(sum(1 for c in customers if c[2] == city))
    return data, str(sum(o[3] for o in orders if customers[o[1] - 1][2] == city))


def sample_tasks(n: int, seed: int) -> list[Task]:
    """``n`` tasks from ``seed``, kinds in rotation, each with its own database."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    rng, tasks = random.Random(seed), []
    for i in range(n):
        data, answer = _question(rng, KINDS[(seed + i) % len(KINDS)], rng.getrandbits(32))
        prompt = rng.choice(_ASK[data["kind"]]).format(**data)
        tasks.append(Task(f"sqlite-{seed}-{i}", "sqlite", prompt, answer, data))
    return tasks


def _authorize(action: int, *_: object) -> int:
    return sqlite3.SQLITE_OK if action in _READ_ACTIONS else sqlite3.SQLITE_DENY


def _last_line(output: str) -> str:
    return output.strip().splitlines()[-1].strip()


class SqliteEnv(ToolEnv):
    """One in-memory database per task; ``query`` runs one read-only statement."""

    name = "sqlite"

    def __init__(self, config: ToolEnvConfig | None = None, *, max_rows: int = 20,
                 query_time_s: float = 2.0) -> None:
        super().__init__(config)
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows must be a positive int, got {max_rows!r}")
        if (isinstance(query_time_s, bool) or not isinstance(query_time_s, int | float)
                or not math.isfinite(query_time_s) or query_time_s <= 0):
            raise ValueError(f"query_time_s must be a positive number, got {query_time_s!r}")
        self.max_rows, self.query_time_s = max_rows, float(query_time_s)
        self._conn: sqlite3.Connection | None = None

    def system_prompt(self) -> str:
        return ("You answer questions about a shop database with the query tool (read-only "
                "SQLite). Tables: customers(id, name, city) and orders(id, customer_id, product, "
                "amount, year). When you know the answer, reply with: The answer is <answer>.")

    def tools(self) -> list[ToolSpec]:
        return [ToolSpec.build("query", "Run one read-only SQL SELECT statement and return the "
                               f"rows (at most {self.max_rows}).",
                               sql=("string", "The SQL query"))]

    def _handlers(self) -> Mapping[str, Callable[..., str]]:
        return {"query": self._query}

    def _build(self, task: Task) -> None:
        if task.data.get("kind") not in KINDS or not isinstance(task.data.get("seed"), int):
            raise ValueError(f"sqlite task {task.task_id}: data needs a known kind and an int seed")
        customers, orders = generate(task.data["seed"])
        conn = sqlite3.connect(":memory:", check_same_thread=False)
        conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT)")
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER, "
                     "product TEXT, amount INTEGER, year INTEGER)")
        conn.executemany("INSERT INTO customers VALUES (?, ?, ?)", customers)
        conn.executemany("INSERT INTO orders VALUES (?, ?, ?, ?, ?)", orders)
        conn.commit()
        conn.execute("PRAGMA query_only = ON")
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, _MAX_VALUE_BYTES)
        conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, _MAX_VALUE_BYTES)  # (bounds a row's calls)
        conn.setlimit(sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, _MAX_PATTERN_BYTES)
        conn.setlimit(sqlite3.SQLITE_LIMIT_COLUMN, _MAX_COLUMNS)  # (bounds one row's size)
        conn.set_authorizer(_authorize)
        self._conn = conn

    def _teardown(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _query(self, sql: str) -> str:
        conn = self._conn
        if conn is None:
            raise ToolError("the database is closed")
        deadline = time.monotonic() + self.query_time_s
        conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
        try:
            cursor = conn.execute(sql)
            if cursor.description is None:
                return "(no result)"
            lines = [" | ".join(str(d[0]) for d in cursor.description)]
            # Row by row under a size budget: rows of many 4 kB values would otherwise be
            # held (and turned into text) all at once, past any deadline (after SQLite).
            rows: list[tuple[Any, ...]] = []
            size, too_big = 0, False
            while len(rows) <= self.max_rows:
                row = cursor.fetchone()
                if row is None:
                    break
                size += sum(len(v) if isinstance(v, str | bytes) else 8 for v in row)
                if size > _MAX_RESULT_BYTES:
                    too_big = True
                    break
                rows.append(row)
            lines += [" | ".join("NULL" if v is None else str(v) for v in row)
                      for row in rows[:self.max_rows]]
            if len(rows) > self.max_rows:
                lines.append(f"... (more than {self.max_rows} rows; use LIMIT or aggregate)")
            elif too_big:
                lines.append(f"... (rows left out: the result passes {_MAX_RESULT_BYTES:,} "
                             "bytes; select fewer or smaller values)")
            return "\n".join(lines) if rows or too_big else lines[0] + "\n(no rows)"
        except (sqlite3.Error, sqlite3.Warning) as exc:
            if str(exc) == "interrupted":  # (not "no such table: interrupted")
                raise ToolError(f"query took longer than {self.query_time_s:g} s") from None
            if "not authorized" in str(exc) or "authorization denied" in str(exc):
                raise ToolError("not allowed: the database is read-only (SELECT only)") from None
            raise ToolError(f"SQL error: {exc}") from None
        finally:
            conn.set_progress_handler(None, 0)

    def expert_turn(self, task: Task, outputs: Sequence[str]) -> ExpertTurn:
        """SQL from the question's template; two-step kinds first look up the customer id."""
        data, step = task.data, len(outputs)
        if step == 2 or (step == 1 and data["kind"] not in ("orders_in_year", "max_order")):
            return ExpertTurn.final(_last_line(outputs[-1]))
        if data["kind"] == "city":
            return ExpertTurn.call(f"I look up the city of {data['name']}.", "query",
                                   sql=f"SELECT city FROM customers WHERE name = '{data['name']}'")
        if data["kind"] == "city_count":
            return ExpertTurn.call(f"I count the customers from {data['city']}.", "query",
                                   sql=f"SELECT COUNT(*) FROM customers WHERE city = "
                                       f"'{data['city']}'")
        if data["kind"] == "city_total":
            return ExpertTurn.call(
                f"I sum the order amounts of customers from {data['city']}.", "query",
                sql="SELECT SUM(orders.amount) FROM orders JOIN customers ON orders.customer_id "
                    f"= customers.id WHERE customers.city = '{data['city']}'")
        if step == 0:
            return ExpertTurn.call(f"First I find the id of customer {data['name']}.", "query",
                                   sql=f"SELECT id FROM customers WHERE name = '{data['name']}'")
        cid = _last_line(outputs[0])
        if data["kind"] == "max_order":
            return ExpertTurn.call(f"Customer {cid} is {data['name']}. I find their largest order.",
                                   "query",
                                   sql=f"SELECT MAX(amount) FROM orders WHERE customer_id = {cid}")
        return ExpertTurn.call(
            f"Customer {cid} is {data['name']}. I count their orders in {data['year']}.", "query",
            sql=f"SELECT COUNT(*) FROM orders WHERE customer_id = {cid} AND year = {data['year']}")
