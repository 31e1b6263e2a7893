"""docker-compose.yml: the compose tool accepts it, and it says what the deployment needs,
Prometheus and Grafana included (they scrape and show what the services listen on).

``docker compose config`` (or the older ``docker-compose config``) resolves and validates
the file without a Docker engine. The YAML checks run everywhere; only the tool check
skips, and says so, where no compose tool is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from api.settings import ServerSettings
from tests.support.servers import free_port, run_process

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
# What `docker compose config` is run with; the file refuses to resolve without them.
SECRETS = {
    "TOKCAP_REDIS_PASSWORD": "pw-for-compose-test",
    "TOKCAP_AUTH_SECRET": "0123456789abcdef0",
}
FRONTEND_CONFIG = ROOT / "deploy" / "tokcap.yaml"
SERVICES = {"redis", "engine", "frontend", "worker"}
# Prometheus and Grafana start with them: `docker compose up` shows the dashboard.
MONITORING = {"prometheus", "grafana"}
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana"
# The `cluster` profile's services, started only with `--profile cluster`.
CLUSTER_NODES = {f"redis-c{n}" for n in range(1, 7)}
CLUSTER_SERVICES = CLUSTER_NODES | {"redis-cluster-init", "frontend-cluster", "worker-cluster"}
FRONTEND_CLUSTER_CONFIG = ROOT / "deploy" / "tokcap-cluster.yaml"


def compose_command() -> list[str] | None:
    """``docker compose`` (the plugin) if it works, else ``docker-compose``, else None."""
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run([docker, "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def compose_config(tmp_path: Path, *profiles: str, **environ: str) -> subprocess.CompletedProcess:
    """``config`` of the compose file under exactly ``environ`` (plus PATH and HOME)."""
    command = compose_command()
    if command is None:
        pytest.skip(
            "no compose tool: neither the docker CLI's compose plugin (`docker compose`) nor "
            "`docker-compose` is installed, so `docker compose config` cannot run here"
        )
    return subprocess.run(
        [*command, "-f", str(COMPOSE_FILE), *(f"--profile={p}" for p in profiles), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(tmp_path), **environ},
    )


def published(service: dict) -> list[tuple[str, str, str]]:
    """(host ip, host port, container port) of each port ``config`` resolved, short or long."""
    ports = []
    for port in service.get("ports", []):
        if isinstance(port, dict):  # docker compose v2
            ports.append((port.get("host_ip", ""), str(port["published"]), str(port["target"])))
            continue
        parts = str(port).removesuffix("/tcp").split(":")  # docker-compose 1.x
        ports.append((parts[0], parts[1], parts[2]) if len(parts) == 3 else ("", *parts))
    return ports


def test_compose_config_accepts_the_file(tmp_path: Path) -> None:
    proc = compose_config(tmp_path, **SECRETS)
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)
    # docker compose v2 leaves out the services of profiles not asked for; docker-compose
    # 1.x prints them with their profiles, and starts them only when asked.
    default = {name for name, spec in resolved["services"].items() if not spec.get("profiles")}
    assert default == SERVICES | MONITORING
    # The defaults were filled in: the tool resolved the variables, not left them raw.
    engine_command = resolved["services"]["engine"]["command"]
    assert "${" not in " ".join(engine_command)
    assert "container_name" not in resolved["services"]["worker"]
    services = resolved["services"]
    # Published on loopback only: the front end for harnesses, Redis for the trainer.
    assert published(services["frontend"]) == [("127.0.0.1", "8000", "8000")]
    assert published(services["redis"]) == [("127.0.0.1", "6379", "6379")]
    assert not published(services["engine"]) and not published(services["worker"])
    assert published(services["prometheus"]) == [("127.0.0.1", "9090", "9090")]
    assert published(services["grafana"]) == [("127.0.0.1", "3000", "3000")]
    redis_command = services["redis"]["command"]
    assert redis_command[redis_command.index("--requirepass") + 1] == "pw-for-compose-test"
    for name in ("frontend", "worker"):
        url = services[name]["environment"]["TOKCAP_REDIS_URL"]
        assert url == "redis://:pw-for-compose-test@redis:6379/0", name
        assert "pw-for-compose-test" not in " ".join(services[name]["command"]), "not in argv"
    assert services["frontend"]["environment"]["TOKCAP_AUTH_SECRET"] == "0123456789abcdef0"


def test_compose_config_accepts_the_cluster_profile(tmp_path: Path) -> None:
    proc = compose_config(tmp_path, "cluster", **SECRETS)
    assert proc.returncode == 0, proc.stderr
    services = yaml.safe_load(proc.stdout)["services"]
    assert set(services) == SERVICES | MONITORING | CLUSTER_SERVICES
    for name in CLUSTER_NODES:
        command = services[name]["command"]
        assert command[command.index("--requirepass") + 1] == "pw-for-compose-test"
        assert not published(services[name]), "cluster nodes stay on the compose network"


@pytest.mark.parametrize("missing", sorted(SECRETS))
def test_compose_config_refuses_to_run_without_its_secrets(tmp_path: Path, missing: str) -> None:
    proc = compose_config(tmp_path, **{k: v for k, v in SECRETS.items() if k != missing})
    assert proc.returncode != 0
    assert missing in proc.stderr


def test_published_ports_listen_on_loopback_and_redis_needs_a_password(compose: dict) -> None:
    """The same bindings as written in the file, where no compose tool is installed."""
    services = compose["services"]
    for name in ("frontend", "redis", "prometheus", "grafana"):
        assert [port.partition(":")[0] for port in services[name]["ports"]] == ["127.0.0.1"]
    assert "ports" not in services["engine"] and "ports" not in services["worker"]
    command = services["redis"]["command"]
    assert command[command.index("--requirepass") + 1].startswith("${TOKCAP_REDIS_PASSWORD:?")
    assert services["redis"]["environment"]["REDISCLI_AUTH"] == "${TOKCAP_REDIS_PASSWORD}"
    for name in ("frontend", "worker"):
        url = services[name]["environment"]["TOKCAP_REDIS_URL"]
        assert url.startswith("redis://:${TOKCAP_REDIS_PASSWORD"), name
        assert "--url" not in services[name]["command"], "a URL argument shows in ps"


def test_every_service_has_a_healthcheck(compose: dict) -> None:
    assert set(compose["services"]) == SERVICES | MONITORING | CLUSTER_SERVICES
    for name, service in compose["services"].items():
        if service.get("restart") == "no":
            continue  # a one-shot job: it ends, it is never healthy
        check = service.get("healthcheck")
        assert check and check.get("test"), f"{name} has no healthcheck"
        assert check["test"][0] == "CMD", f"{name}: healthcheck should run a command directly"


def test_redis_is_durable_on_a_volume(compose: dict) -> None:
    redis = compose["services"]["redis"]
    assert redis["image"].startswith("redis:7")
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--appendfsync") + 1] == "always"
    volume, _, mount = redis["volumes"][0].partition(":")
    assert mount == "/data"
    assert volume in compose["volumes"], "redis data must live on a named volume"
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_cluster_profile_is_a_durable_cluster_with_replicas(compose: dict) -> None:
    services = compose["services"]
    for name in CLUSTER_SERVICES:
        assert services[name]["profiles"] == ["cluster"], f"{name} must start only on demand"
    for name in CLUSTER_NODES:
        node = services[name]
        command = node["command"]
        for flag, value in {
            "--cluster-enabled": "yes",
            "--appendonly": "yes",
            "--appendfsync": "always",
            "--cluster-announce-hostname": name,
        }.items():
            assert command[command.index(flag) + 1] == value, (name, flag)
        for flag in ("--requirepass", "--masterauth"):  # replicas log in to their masters
            assert command[command.index(flag) + 1].startswith("${TOKCAP_REDIS_PASSWORD:?")
        volume, _, mount = node["volumes"][0].partition(":")
        assert mount == "/data" and volume in compose["volumes"], name
        assert "ports" not in node
    init = "\n".join(services["redis-cluster-init"]["command"])
    assert "--cluster-replicas 1" in init and all(node in init for node in CLUSTER_NODES)
    for name in ("frontend-cluster", "worker-cluster"):
        service = services[name]
        assert service["environment"]["TOKCAP_REDIS_URL"].endswith("@redis-c1:6379/0")
        assert "--url" not in service["command"], "a URL argument shows in ps"
        init_done = service["depends_on"]["redis-cluster-init"]["condition"]
        assert init_done == "service_completed_successfully"
    worker = services["worker-cluster"]["command"]
    assert worker[:2] == ["worker", "--cluster"]
    assert worker[worker.index("--shards") + 1] == "3"


def test_cluster_frontend_config_puts_the_sink_on_the_cluster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TOKCAP_REDIS_URL", "redis://redis-c1:6379/0")
    settings = ServerSettings.from_document(str(FRONTEND_CLUSTER_CONFIG), environ={})
    assert settings.capture.sink == "transports.redis:RedisTokenSink"
    assert settings.capture.sink_kwargs == {"url": "redis://redis-c1:6379/0", "cluster": True}


def test_worker_scales(compose: dict) -> None:
    worker = compose["services"]["worker"]
    assert "container_name" not in worker, "a fixed name stops `--scale worker=N`"
    assert "ports" not in worker, "a fixed host port stops `--scale worker=N`"
    assert worker["command"][0] == "worker"
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"


def test_services_run_the_tokcap_commands(compose: dict) -> None:
    services = compose["services"]
    assert services["engine"]["command"][0] == "engine"
    frontend = services["frontend"]
    assert frontend["command"][:3] == ["serve", "--config", "/etc/tokcap/tokcap.yaml"]
    assert "./deploy/tokcap.yaml:/etc/tokcap/tokcap.yaml:ro" in frontend["volumes"]
    assert frontend["depends_on"]["redis"]["condition"] == "service_healthy"
    assert frontend["depends_on"]["engine"]["condition"] == "service_healthy"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["tokcap"]' in dockerfile


def test_frontend_config_is_valid_and_uses_redis(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKCAP_REDIS_URL", "redis://redis:6379/0")
    monkeypatch.delenv("TOKCAP_UPSTREAM", raising=False)
    settings = ServerSettings.from_document(str(FRONTEND_CONFIG), environ={})
    assert settings.capture.enabled
    assert settings.capture.sink == "transports.redis:RedisTokenSink"
    assert settings.capture.sink_kwargs == {"url": "redis://redis:6379/0"}
    assert settings.upstream == "http://engine:8001"
    assert settings.sampling_overrides  # pinned server-side: the harness sends no top_p


def test_image_install_includes_every_package() -> None:
    """The image installs the project as a wheel (not editable): every subpackage must be in it."""
    import tomllib

    from setuptools import find_packages

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    declared = config.get("packages")
    if isinstance(declared, dict) or declared is None:
        found = declared.get("find", {}) if isinstance(declared, dict) else {}
        packaged = set(find_packages(where=str(ROOT), include=found.get("include", ["*"])))
    else:
        packaged = set(declared)
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("capture", "transports", "api")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert on_disk <= packaged, f"missing from the wheel: {sorted(on_disk - packaged)}"


def healthcheck_code(compose: dict, service: str) -> str:
    test = compose["services"][service]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"], test
    return test[3]


def test_worker_healthcheck_passes_against_a_real_worker(
    compose: dict, redis_server_factory
) -> None:
    server = redis_server_factory(requirepass="pw-for-compose-test")
    url = f"redis://:pw-for-compose-test@127.0.0.1:{server.port}/0"
    code = healthcheck_code(compose, "worker")
    check = [sys.executable, "-c", code]
    environ = {**os.environ, "TOKCAP_REDIS_URL": url}
    # No worker yet: no consumer group, so the check fails.
    assert subprocess.run(check, capture_output=True, timeout=30, env=environ).returncode != 0
    worker = [
        sys.executable,
        "-m",
        "tokcap.commands.worker",
        "--block-ms",
        "200",
    ]
    # As compose runs it: the URL, password included, only in the environment.
    with run_process(worker, env={"PYTHONPATH": str(ROOT), "TOKCAP_REDIS_URL": url}):
        deadline = time.monotonic() + 30
        while subprocess.run(check, capture_output=True, timeout=30, env=environ).returncode != 0:
            assert time.monotonic() < deadline, "the worker healthcheck never passed"
            time.sleep(0.2)


def test_engine_healthcheck_passes_against_a_real_engine(compose: dict) -> None:
    port = free_port()
    code = healthcheck_code(compose, "engine").replace("127.0.0.1:8001", f"127.0.0.1:{port}")
    engine = [
        sys.executable,
        "-m",
        "tokcap_devtools.engine.cli",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "random",
    ]
    with run_process(
        engine, ready_url=f"http://127.0.0.1:{port}/health", env={"PYTHONPATH": str(ROOT)}
    ):
        assert subprocess.run([sys.executable, "-c", code], timeout=30).returncode == 0


def test_cluster_worker_healthcheck_passes_against_a_real_cluster_worker(
    compose: dict, redis_cluster
) -> None:
    code = healthcheck_code(compose, "worker-cluster")
    check = [sys.executable, "-c", code]
    environ = {**os.environ, "TOKCAP_REDIS_URL": redis_cluster.url, "PYTHONPATH": str(ROOT)}
    assert subprocess.run(check, capture_output=True, timeout=30, env=environ).returncode != 0
    worker = [sys.executable, "-m", "tokcap.commands.worker", "--cluster", "--shards", "3"]
    with run_process(worker, env={"PYTHONPATH": str(ROOT), "TOKCAP_REDIS_URL": redis_cluster.url}):
        deadline = time.monotonic() + 30
        while subprocess.run(check, capture_output=True, timeout=30, env=environ).returncode != 0:
            assert time.monotonic() < deadline, "the cluster worker healthcheck never passed"
            time.sleep(0.2)


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_prometheus_scrapes_the_front_ends_and_every_worker_where_they_listen(
    compose: dict,
) -> None:
    """Each scrape job names compose services, on the port each listens on inside the network;
    the workers' metrics listen there (0.0.0.0 in the container) and are never published."""
    services = compose["services"]
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"tokcap-frontend", "tokcap-worker"}
    port_of = {
        name: option(services[name]["command"], "--port")
        for name in ("frontend", "frontend-cluster")
    }
    for name in ("worker", "worker-cluster"):
        command = services[name]["command"]
        assert option(command, "--metrics-host") == "0.0.0.0", name
        port_of[name] = option(command, "--metrics-port")
        assert "ports" not in services[name], "a fixed host port stops `--scale worker=N`"
    for job in jobs.values():
        assert job["metrics_path"] == "/metrics"
        (discovery,) = job["dns_sd_configs"]
        assert discovery["type"] == "A", "one target per container of a scaled service"
        for name in discovery["names"]:
            assert port_of[name] == str(discovery["port"]), (job["job_name"], name)
    mount = "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro"
    assert mount in services["prometheus"]["volumes"]


def test_grafana_is_provisioned_read_only_from_the_repository(compose: dict) -> None:
    """The mounts exist, the dashboard provider reads where they are mounted, the datasource
    is the compose file's Prometheus under the uid every panel names, and the home dashboard
    is the provisioned one; anonymous users only view."""
    grafana = compose["services"]["grafana"]
    mounts = {}
    for volume in grafana["volumes"]:
        source, target, mode = volume.split(":")
        assert mode == "ro" and (ROOT / source).exists(), volume
        mounts[target] = ROOT / source
    provisioning = mounts["/etc/grafana/provisioning"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "tokcap.yml").read_text())[
        "providers"
    ]
    dashboards = mounts[provider["options"]["path"]]
    assert dashboards == GRAFANA / "dashboards" and provider["allowUiUpdates"] is False
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["url"] == "http://prometheus:9090" and source["type"] == "prometheus"
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    home_dir, _, home_file = home.rpartition("/")
    dashboard = json.loads((mounts[home_dir] / home_file).read_text())
    uids = {panel["datasource"]["uid"] for panel in dashboard["panels"] if "datasource" in panel}
    assert uids == {source["uid"]}
    environment = grafana["environment"]
    assert environment["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert environment["GF_AUTH_DISABLE_LOGIN_FORM"] == "true"
    assert grafana["depends_on"]["prometheus"]["condition"] == "service_healthy"
