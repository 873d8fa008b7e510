"""Spark Connect has no SparkContext, RDDs or JVM (issue 25): a static check over the package that
nothing but the classic-only branches of common/spark.py touches them. Each of those functions asks
``is_connect`` first (or runs only where a classic session is created), which is checked here too.

What counts as touching: an attribute ``sparkContext``, ``_jvm``, ``_jsc`` or ``rdd``, or the name
``SparkContext``, anywhere in common/, pipelines/, training/, scoring/ or shardtrain/ (every module
the shard, train, score and load_model entry points can reach is in one of them). The Horovod
launcher is not listed: it calls horovod.spark, which needs classic Spark, and
training.launchers refuses it under Connect before it runs (tests/training/test_connect_refusals.py).
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("common", "pipelines", "training", "scoring", "shardtrain")
CLASSIC_ONLY = {"sparkContext", "_jvm", "_jsc", "rdd", "SparkContext"}
# common/spark.py's functions that hold a classic-only branch, and what guards it.
GUARDED = {
    "get_or_create_session": "is_connect",  # setLogLevel on a classic session only
    "_reconfigure_running_jvm": None,  # under spark-submit (PYSPARK_GATEWAY_PORT): classic by definition
    "_submitted_with_master": None,  # likewise
    "spark_setting": "is_connect",
    "default_parallelism": "is_connect",
    "LaunchJobs.__init__": "self.connect",
    "LaunchJobs.running_tasks": "self.connect",
    "LaunchJobs.running_jobs": "self.connect",
    "LaunchJobs.cancel": "self.connect",
    "LaunchJobs.close": "self.connect",
    "LaunchJobs._classic_jobs": None,  # called only from running_tasks', running_jobs' and cancel's classic branches
}


def _touches(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in CLASSIC_ONLY:
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name) and node.id in CLASSIC_ONLY:
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.alias) and node.name.split(".")[-1] in CLASSIC_ONLY:
            found.append((getattr(node, "lineno", 0), node.name))
    return found


def _functions(tree: ast.Module):
    """(qualified name, node) of every function, methods as Class.method."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{item.name}", item


def test_no_module_touches_spark_context_outside_the_classic_branches():
    offenders = []
    for package in PACKAGES:
        for folder, _, names in os.walk(os.path.join(ROOT, package)):
            for name in names:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, ROOT)
                with open(path, encoding="utf-8") as fh:
                    tree = ast.parse(fh.read(), rel)
                allowed: set[int] = set()
                if rel == os.path.join("common", "spark.py"):
                    for qualname, func in _functions(tree):
                        if qualname in GUARDED:
                            allowed |= {line for line, _ in _touches(func)}
                offenders += [f"{rel}:{line}: {what}" for line, what in _touches(tree) if line not in allowed]
    assert not offenders, ("Spark Connect has no SparkContext, RDDs or JVM; go through common.spark "
                           "(spark_setting, default_parallelism, LaunchJobs, is_connect): " + ", ".join(offenders))


def test_each_classic_branch_asks_is_connect_first():
    with open(os.path.join(ROOT, "common", "spark.py"), encoding="utf-8") as fh:
        tree = ast.parse(fh.read())
    functions = dict(_functions(tree))
    assert set(GUARDED) <= set(functions), set(GUARDED) - set(functions)
    for qualname, guard in GUARDED.items():
        if guard is None:
            continue
        func = functions[qualname]
        first_touch = min(line for line, _ in _touches(func))
        guards = [node.lineno for node in ast.walk(func) if isinstance(node, ast.If)
                  and guard in ast.unparse(node.test) and node.lineno < first_touch]
        assert guards, f"common/spark.py {qualname}: touches classic Spark at line {first_touch} without first " \
                       f"checking {guard}"


def test_the_check_finds_a_touch():
    # The check itself works: one access of each kind is found (a check that finds nothing proves nothing).
    source = "def f(spark):\n    spark.sparkContext\n    spark._jvm\n    x._jsc\n    df.rdd\n    SparkContext\n"
    assert [what for _, what in sorted(_touches(ast.parse(source)))] == ["sparkContext", "_jvm", "_jsc", "rdd",
                                                                   "SparkContext"]
