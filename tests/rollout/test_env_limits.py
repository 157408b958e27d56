"""Regressions found in review: bad tool input that hung an environment or gave a non-answer."""

from __future__ import annotations

import time

from war.rollout.envs import ToolEnvConfig, make, sample_tasks, sqlite_db


def test_sqlite_functions_of_huge_arguments_cannot_outlast_the_deadline() -> None:
    # One call of trim(X, Y) / LIKE costs |X| x |Y| inside SQLite, where the progress
    # handler never runs: with 1 MB values such a query ran for minutes (the env refused
    # every later call and its close blocked on the connection).
    env = sqlite_db.SqliteEnv(ToolEnvConfig(timeout_s=30.0), query_time_s=0.2)
    env.reset(sample_tasks("sqlite", 1, seed=0)[0])
    loop = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
    for sql in (
        loop + "SELECT sum(length(trim(printf('%.*c', 999000 - x % 2, 'a'), "
               "printf('%.*c', 80000 - x % 2, 'b') || 'a'))) FROM c",
        loop + "SELECT sum(printf('%.*c', 999000 - x % 2, 'a') LIKE "
               "'%' || printf('%.*c', 49000 - x % 2, 'a') || 'b') FROM c",
        "SELECT " + " + ".join(["length(trim(printf('%.*c', 3500, 'a'), "
                                "printf('%.*c', 200, 'b') || 'a'))"] * 200),
    ):
        start = time.monotonic()
        out = env.call_tool("query", {"sql": sql})
        assert time.monotonic() - start < 3.0, sql[:80]
        assert out.startswith("error: "), out
    assert env.running_tool is None
    assert env.call_tool("query", {"sql": "SELECT COUNT(*) FROM customers"}).startswith("COUNT")
    env.close()


def test_sqlite_caps_are_clear_errors_and_leave_ordinary_queries_alone() -> None:
    env = sqlite_db.SqliteEnv()
    env.reset(sample_tasks("sqlite", 1, seed=0)[0])
    assert env.call_tool("query", {"sql": "SELECT 1" + " " * 5000}) == (
        "error: SQL error: query string is too large")
    like = "SELECT 'a' LIKE '%' || printf('%.*c', 300, 'a')"
    assert env.call_tool("query", {"sql": like}) == (
        "error: SQL error: LIKE or GLOB pattern too complex")
    names = env.call_tool("query", {"sql": "SELECT group_concat(name || ' ' || city) FROM "
                                           "customers WHERE name LIKE '%a%'"})
    assert names.splitlines()[0].startswith("group_concat") and "," in names
    env.close()


def test_convert_refuses_a_result_past_a_floats_range() -> None:
    env = make("calculator")
    env.reset(sample_tasks("calculator", 1, seed=0)[0])
    out = env.call_tool("convert", {"value": 1e308, "from_unit": "miles", "to_unit": "mm"})
    assert out == "error: cannot convert 1e+308 miles to mm: the result is too large"
    assert env.call_tool("convert", {"value": 5, "from_unit": "miles", "to_unit": "km"}) == "8.05"
    env.close()
