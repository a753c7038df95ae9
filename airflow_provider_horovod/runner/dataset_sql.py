"""A ``dataset=`` string decided on Spark's own parse of it (issue 49, T4-14), not on its tokens.

``dataset=`` is templated (``params``, ``dag_run.conf``), and ``spark.sql`` runs a command at once,
so before Spark runs anything the text is parsed by the session's own SQL parser (the one
``spark.sql`` uses: extensions and variable substitution included) and its unresolved logical plan is
walked in the JVM: every plan node must be one that reads (``READ_PLANS``), every function it calls
one of Spark's built-in functions (``FunctionRegistry.builtin``) other than those that call Java
(``REFLECTIVE``), every table-valued function one of ``TABLE_FUNCTIONS``. A name in backquotes, an
``IDENTIFIER(...)`` clause, a catalog's own function or any node Spark adds later is refused until
it is listed here: an allow-list, so what it does not know it refuses.

Spark Connect has no parse API: the server parses the text as the body of a subquery
(``SELECT * FROM (<text>)``), which only a query can be, so a command never runs, and the analysed
plan Spark prints is refused when it calls a reflective function (``connect_check``); where this
process also runs a JVM (``remote("local[n]")`` starts the server in it) the plan is walked there too.
"""

from __future__ import annotations

import re
from typing import Any

from airflow_provider_horovod.exceptions import DatasetError

# Plan nodes of a query that reads (their simple class names in Spark 4's catalyst), as the parser
# makes them before analysis. Nothing here writes, caches, sets or calls out.
READ_PLANS = frozenset({
    "Project", "Filter", "Aggregate", "Sort", "GlobalLimit", "LocalLimit", "Offset", "Tail", "Join", "LateralJoin",
    "Union", "Intersect", "Except", "Distinct", "Deduplicate", "SubqueryAlias", "UnresolvedRelation",
    "UnresolvedWith", "UnresolvedInlineTable", "LocalRelation", "OneRowRelation", "WithWindowDefinition",
    "Generate", "Sample", "Pivot", "Unpivot", "UnresolvedSubqueryColumnAliases", "RepartitionByExpression",
    "Repartition", "UnresolvedHint", "UnresolvedTableValuedFunction", "Window", "Expand", "Range",
    "UnresolvedTVFAliases", "UnresolvedHaving", "UnresolvedStarExcept", "PipeOperator",
})
# Functions that call Java methods by name (``reflect('java.lang.System', 'exit', 0)``).
REFLECTIVE = frozenset({"reflect", "java_method", "try_reflect"})
# Expressions the parser can make that run code by name, refused wherever they appear.
REFLECTIVE_EXPRESSIONS = frozenset({"CallMethodViaReflection", "TryReflect", "StaticInvoke", "Invoke", "NewInstance",
                                    "ScalaUDF", "PythonUDF", "ExpressionWithUnresolvedIdentifier"})
# Table-valued functions that read (``SELECT * FROM range(10)``, ``explode(...)``).
TABLE_FUNCTIONS = frozenset({"range", "explode", "explode_outer", "inline", "inline_outer", "posexplode",
                             "posexplode_outer", "json_tuple", "stack", "variant_explode", "variant_explode_outer"})
BUILTIN_QUALIFIERS = ((), ("builtin",), ("system", "builtin"))  # how a built-in function may be named
_PLAN = "org.apache.spark.sql.catalyst.plans.logical.LogicalPlan"
_EXPRESSION = "org.apache.spark.sql.catalyst.expressions.Expression"
_PLAN_EXPRESSION = "org.apache.spark.sql.catalyst.expressions.PlanExpression"
MAX_NODES = 20000  # a query larger than this is no training dataset: refused rather than walked for ever
CONNECT_ALIAS = "hvdrunner_dataset"
_CALLS_JAVA = re.compile(r"\b(?:%s)\s*\(" % "|".join(sorted(REFLECTIVE)), re.I)


def check_on_spark(spark: Any, text: str) -> None:
    """``DatasetError`` unless Spark's parser reads ``text`` as a query of ``READ_PLANS`` that calls only
    safe built-in functions. Runs nothing: parsing and walking the plan touch no data."""
    if getattr(spark, "_jsparkSession", None) is None:  # Spark Connect: the server's own parse first
        connect_check(spark, text)
    jvm = _jvm_session(spark)
    if jvm is None:
        return
    session, gateway = jvm
    plan = _parse(session, text)
    builtin = _builtin_functions(session, gateway)
    refused = first_refusal(plan, gateway, builtin)
    if refused is not None:
        raise DatasetError(refusal(text, refused))


def refusal(text: str, why: str) -> str:
    return ("dataset=%r is not a read-only query by Spark's parse of it (%s): a string dataset= is a table name "
            "(db.table) or a query that only reads, calling Spark's built-in functions other than %s; it is refused "
            "before Spark runs it. For anything else pass a callable spark -> DataFrame."
            % (" ".join(text.split())[:200], why, ", ".join(sorted(REFLECTIVE))))


def _jvm_session(spark: Any) -> tuple[Any, Any] | None:
    """The JVM session whose parser reads ``spark``'s SQL, and its py4j gateway: a classic session's
    own, or for a Connect session the classic session of this process (``remote("local[n]")`` runs
    its server there: same extensions and conf); ``None`` where this process has no JVM."""
    from pyspark import SparkContext

    session = getattr(spark, "_jsparkSession", None)
    if session is None:
        from pyspark.sql import SparkSession

        classic = SparkSession._instantiatedSession
        session = getattr(classic, "_jsparkSession", None)
    context = SparkContext._active_spark_context
    if session is None or context is None:
        return None
    return session, context._gateway


def _parse(session: Any, text: str) -> Any:
    from py4j.protocol import Py4JJavaError
    from pyspark.errors.exceptions.captured import CapturedException

    try:
        return session.sessionState().sqlParser().parsePlan(text)
    except (Py4JJavaError, CapturedException) as err:  # PySpark turns the parser's error into a ParseException
        first = str(err).strip().split("\n", 1)[0][:600]
        raise DatasetError("dataset=%r is not a table name, so it was read as Spark SQL, and it does not parse: %s. "
                           "Fix the query (this is its text after templating)."
                           % (" ".join(text.split())[:200], first)) from None


def _builtin_functions(session: Any, gateway: Any) -> frozenset[str]:
    """The names of Spark's built-in functions (lower case), from its own registry."""
    registry = getattr(gateway.jvm.org.apache.spark.sql.catalyst.analysis, "FunctionRegistry$").__getattr__("MODULE$")
    names = registry.builtin().listFunction().mkString("\n")  # one call: "system.builtin.abs", ...
    return frozenset(name.strip("`").lower().removeprefix("system.builtin.") for name in names.split("\n") if name)


def first_refusal(plan: Any, gateway: Any, builtin: frozenset[str]) -> str | None:
    """Why the parsed ``plan`` is not a read-only query (the first reason met), or ``None``."""
    from py4j.java_gateway import is_instance_of

    pending, seen = [plan], 0
    while pending:
        node = pending.pop()
        seen += 1
        if seen > MAX_NODES:
            return "it has more than %d plan nodes and expressions" % MAX_NODES
        name = node.getClass().getSimpleName()
        if is_instance_of(gateway, node, _PLAN):
            why = _plan_refusal(node, name)
            pending += [*_seq(node.children()), *_seq(node.innerChildren()), *_seq(node.expressions())]
        elif is_instance_of(gateway, node, _EXPRESSION):
            why = _expression_refusal(node, name, builtin)
            pending += _seq(node.children())
            if is_instance_of(gateway, node, _PLAN_EXPRESSION):
                pending.append(node.plan())  # a subquery: its plan is walked as the query's own
        else:
            why = None  # a tree node of neither kind (a window frame's bound): holds nothing of its own
        if why is not None:
            return why
    return None


def _plan_refusal(node: Any, name: str) -> str | None:
    if name not in READ_PLANS:
        return "it holds %s, which is not a read-only query's" % name
    if name == "UnresolvedTableValuedFunction":
        function = _name(node.name())
        if function not in TABLE_FUNCTIONS:
            return "it calls the table function %s, which is not one of %s" % (function, _listed(TABLE_FUNCTIONS))
    return None


def _expression_refusal(node: Any, name: str, builtin: frozenset[str]) -> str | None:
    if name in REFLECTIVE_EXPRESSIONS:
        return "it holds %s, which calls code by name" % name
    if name == "UnresolvedGenerator":  # LATERAL VIEW explode(...)
        generator = str(node.name().funcName()).lower()
        if generator not in TABLE_FUNCTIONS:
            return "it calls the generator %s, which is not one of %s" % (generator, _listed(TABLE_FUNCTIONS))
        return None
    if name != "UnresolvedFunction":
        return None
    parts = [str(part).lower() for part in _seq(node.nameParts())]
    function, qualifier = parts[-1], tuple(parts[:-1])
    if function in REFLECTIVE:
        return "it calls %s, which calls Java methods by name" % function
    if qualifier not in BUILTIN_QUALIFIERS or function not in builtin:
        return "it calls %s, which is not one of Spark's built-in functions" % ".".join(parts)
    return None


def _listed(names: frozenset[str]) -> str:
    return ", ".join(sorted(names))


def _name(parts: Any) -> str:
    return ".".join(str(part) for part in _seq(parts)).lower()


def _seq(seq: Any) -> list[Any]:
    """A Scala ``Seq`` as a Python list (one call a value: plans are small)."""
    return [seq.apply(i) for i in range(seq.size())]


def connect_check(spark: Any, text: str) -> None:
    """A Spark Connect session with no JVM here: the server parses ``text`` as a subquery's body,
    which only a query can be (a command fails to parse, so it never runs), and the analysed plan
    must call no reflective function. The plan is analysed, never executed."""
    from pyspark.errors import PySparkException

    body = text.strip().removesuffix(";")
    try:
        plan = _plan_text(spark.sql("SELECT * FROM (\n%s\n) AS %s" % (body, CONNECT_ALIAS)))
    except PySparkException as err:
        raise DatasetError(refusal(text, "Spark does not read it as a query: %s"
                                   % str(err).strip().split("\n", 1)[0][:300])) from None
    analysed = plan.partition("== Analyzed Logical Plan ==")[2].partition("== Optimized Logical Plan ==")[0]
    found = _CALLS_JAVA.search(analysed or plan)  # functions resolved, by the names Spark prints them
    if found is not None:
        raise DatasetError(refusal(text, "it calls %s, which calls Java methods by name" % found.group(0).rstrip("( ")))


def _plan_text(df: Any) -> str:
    """Spark's own text of ``df``'s parsed, analysed, optimised and physical plans (nothing runs):
    asked of a Connect server, or of a classic session's query execution (the same text)."""
    explain = getattr(df, "_explain_string", None)
    return explain(extended=True) if explain is not None else df._jdf.queryExecution().toString()
