"""The Grafana dashboard queries only metrics the services export (issue 36, item 3).

A real ``tokcap serve`` (one worker: its registry declares every family, counted or not) and
a real ``tokcap worker`` (its metrics port from ``TOKCAP_WORKER_METRICS_PORT``, as compose
sets it) run on a private password-protected redis-server; two captured calls and one
rebuilt job make their counters move. Both ``/metrics`` are scraped, and every metric name
in every panel's PromQL must be one of theirs, named as Prometheus stores it (a counter with
``_total``, a histogram's ``_bucket``, ``_sum`` or ``_count``). No scrape holds the password.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.fixtures_redis import RedisServer
from tests.support.frontend import REDIS_SERVE_CONFIG, answer_output, engine_server
from tests.support.servers import free_port, run_process
from transports.rebuild.jobs import RebuildQueue

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "tokcap.json"
SECRET = "dash-pw-5c2e91"
ROLLOUT = "dash-1"
# The sample names each metric type exposes, after its family's name.
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}
# Series Prometheus writes itself for every target, not scraped from it.
PROMETHEUS_OWN = {"up"}
# PromQL words that read like a metric name where they stand.
LABEL_LIST_WORDS = ("by", "without", "on", "ignoring", "group_left", "group_right")
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", *LABEL_LIST_WORDS}
LABEL_LISTS = re.compile(rf"\b(?:{'|'.join(LABEL_LIST_WORDS)})\s*\([^)]*\)")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: every identifier left once strings,
    Grafana variables, label matchers, ranges, label lists, functions, aggregations and
    keywords are taken out."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', " ", expr)
    text = re.sub(r"\$\{?\w+\}?", " ", text)
    text = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", text)
    text = LABEL_LISTS.sub(" ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][\w:]*", text):
        if text[match.end() :].lstrip().startswith("("):
            continue  # a function or an aggregation
        if match.group().lower() not in KEYWORDS:
            names.add(match.group())
    return names


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of every panel."""
    return [
        (panel["title"], target["expr"])
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
    ]


def exported(exposition: str) -> set[str]:
    """The sample names a scrape can hold, from each family it declares (counted or not)."""
    return {
        family.name + suffix
        for family in text_string_to_metric_families(exposition)
        for suffix in SUFFIXES.get(family.type, ("",))
    }


def unexported(dashboard: dict[str, Any], names: set[str]) -> list[str]:
    """Each panel query's metric names that no service exports, as 'title: name'."""
    return sorted(
        f"{title}: {name}"
        for title, expr in queries(dashboard)
        for name in metric_names(expr) - names - PROMETHEUS_OWN
    )


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The front end's and the worker's /metrics after two calls and their rollout's rebuild."""
    tmp = tmp_path_factory.mktemp("dashboard")
    (tmp / "redis").mkdir()
    redis = RedisServer(tmp / "redis", requirepass=SECRET).start()
    config = tmp / "serve.yaml"
    config.write_text(REDIS_SERVE_CONFIG)
    url = f"redis://:{SECRET}@127.0.0.1:{redis.port}/0"
    env = {"PYTHONPATH": str(ROOT), "TOKCAP_REDIS_URL": url}
    front_port, metrics_port = free_port(), free_port()
    front = f"http://127.0.0.1:{front_port}"
    worker_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        with engine_server() as engine:
            serve = ["python", "-m", "tokcap.cli", "serve", "--config", str(config)]
            serve += ["--upstream", engine, "--port", str(front_port), "--workers", "1"]
            worker = ["python", "-m", "tokcap.commands.worker", "--block-ms", "200"]
            worker_env = {**env, "TOKCAP_WORKER_METRICS_PORT": str(metrics_port)}
            with (
                run_process(serve, ready_url=front + "/health", env=env),
                run_process(worker, ready_url=worker_metrics, env=worker_env),
            ):
                answer = make_calls(front)
                asyncio.run(submit(url, answer))
                wait_until_rebuilt(worker_metrics)
                return {
                    "front end": httpx.get(front + "/metrics", timeout=30).text,
                    "worker": httpx.get(worker_metrics, timeout=30).text,
                }
    finally:
        redis.stop()


def make_calls(front: str) -> str:
    """Two captured calls of one rollout, the second continuing the first; the last reply."""
    path = f"{front}/ng-rollout/{ROLLOUT}/training-token-capture/v1/chat/completions"
    messages: list[dict[str, str]] = [{"role": "user", "content": "hi"}]
    text = ""
    for turn in range(2):
        reply = httpx.post(path, json={"model": "m", "messages": messages}, timeout=60)
        assert reply.status_code == 200, reply.text
        text = reply.json()["choices"][0]["message"]["content"] or ""
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"{turn}"}]
    return text


async def submit(url: str, answer: str) -> None:
    record = {"_ng_rollout_id": ROLLOUT, "response": {"output": answer_output(answer)}}
    async with RebuildQueue(url=url) as queue:
        await queue.submit(record)


def wait_until_rebuilt(worker_metrics: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        families = text_string_to_metric_families(httpx.get(worker_metrics, timeout=10).text)
        rebuilt = sum(
            sample.value
            for family in families
            if family.name == "tokcap_rebuilt_jobs"
            for sample in family.samples
            if sample.name == "tokcap_rebuilt_jobs_total"
        )
        if rebuilt >= 1:
            return
        assert time.monotonic() < deadline, "the worker never counted the rebuilt job"
        time.sleep(0.1)


def test_every_metric_the_dashboard_queries_is_exported(
    dashboard: dict[str, Any], scrapes: dict[str, str]
) -> None:
    names = set().union(*(exported(text) for text in scrapes.values()))
    assert queries(dashboard), "a dashboard without queries checks nothing"
    missing = unexported(dashboard, names)
    assert not missing, f"panels query metrics no service exports: {missing}"


def test_the_check_names_a_panel_whose_metric_nobody_exports(
    dashboard: dict[str, Any], scrapes: dict[str, str]
) -> None:
    names = set().union(*(exported(text) for text in scrapes.values()))
    doctored = copy.deepcopy(dashboard)
    panel = next(panel for panel in doctored["panels"] if panel.get("targets"))
    panel["targets"].append({"expr": "sum(rate(tokcap_calls_totl[5m])) by (outcome)"})
    # A histogram's family name is not a series: only its _bucket, _sum and _count are.
    panel["targets"].append({"expr": "rate(tokcap_rebuild_seconds[5m])"})
    assert unexported(doctored, names) == [
        f"{panel['title']}: tokcap_calls_totl",
        f"{panel['title']}: tokcap_rebuild_seconds",
    ]


def test_the_services_counted_the_calls_and_the_rebuild_and_show_no_password(
    scrapes: dict[str, str],
) -> None:
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for text in scrapes.values()
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    calls = ("tokcap_calls_total", (("dialect", "chat"), ("outcome", "captured")))
    assert samples.get(calls) == 2, sorted(name for name, _ in samples)
    assert samples[("tokcap_rebuilt_jobs_total", (("result", "delivered"),))] == 1
    assert samples[("tokcap_rebuild_seconds_count", ())] == 1
    for where, text in scrapes.items():
        assert SECRET not in text, f"the Redis password is in the {where}'s metrics"


def test_the_dashboard_shows_every_worker_metric(
    dashboard: dict[str, Any], scrapes: dict[str, str]
) -> None:
    shown = set().union(*(metric_names(expr) for _, expr in queries(dashboard)))
    for family in text_string_to_metric_families(scrapes["worker"]):
        if family.name.endswith("_created"):
            continue  # when each counter began: Prometheus's business, not a panel's
        assert any(name.startswith(family.name) for name in shown), family.name


def test_panels_are_laid_out_on_the_grid_and_name_one_datasource(
    dashboard: dict[str, Any],
) -> None:
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"] and panel["description"], panel["title"]
            assert {target["datasource"]["uid"] for target in panel["targets"]} == {
                panel["datasource"]["uid"]
            }


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'sum by (dialect, outcome) (rate(tokcap_calls_total{outcome!="captured"}'
            "[$__rate_interval]))",
            {"tokcap_calls_total"},
        ),
        (
            "histogram_quantile(0.95, sum by (le) (rate(x_bucket[5m]))) / on (job) "
            "group_left y offset 1h",
            {"x_bucket", "y"},
        ),
        ("min(1 - a / (b > 0)) and c unless 1e3 * d", {"a", "b", "c", "d"}),
        ('sum(up{job="tokcap-worker"}) by (job)', {"up"}),
    ],
)
def test_metric_names_reads_promql(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names
