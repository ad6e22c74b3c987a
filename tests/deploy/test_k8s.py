"""The Kubernetes manifests (deploy/k8s): rendered as `kubectl apply -k` would apply them, checked
against the Kubernetes API schemas, against each other (selectors, ports, probes, autoscalers) and
against the real CLI (there is no cluster to run them in here)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from kubernetes_validate import validate

from specd.serving import LIVENESS
from specd_cli.main import DEFAULT_ADDRESSES, _build_parser

from .conftest import REPO, SPECD_ROLES

K8S = REPO / "deploy" / "k8s"
BASE = K8S / "base"
GPU = K8S / "overlays" / "gpu"
SERVICE_MONITOR = K8S / "optional" / "service-monitor.yaml"
# The API version the manifests are checked against (gRPC probes are GA since 1.27).
KUBERNETES_VERSION = "1.30.0"
# The image each Dockerfile builds, as its header says to tag it.
IMAGES = {"specd:cpu": REPO / "docker" / "Dockerfile", "specd:cuda": REPO / "docker" / "Dockerfile.cuda"}


def _documents(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def read_listed_resources(directory: Path) -> list[dict]:
    """What kustomize renders from a kustomization of plain resource files and nothing else (no patches,
    generators, transformers or other kustomizations): the resources of those files, as they are."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    paths = [directory / name for name in kustomization["resources"]]
    if set(kustomization) != {"apiVersion", "kind", "resources"} or not all(path.is_file() for path in paths):
        pytest.skip(f"{directory.relative_to(REPO)} is more than plain resources: rendering it needs kubectl")
    return [doc for path in paths for doc in _documents(path.read_text())]


def render(directory: Path) -> list[dict]:
    """`kubectl kustomize DIRECTORY` where there is a kubectl; the base alone without one."""
    if shutil.which("kubectl") is None:
        return read_listed_resources(directory)
    rendered = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    return _documents(rendered.stdout)


@pytest.fixture(scope="module", params=[BASE, GPU], ids=["base", "gpu"])
def resources(request) -> list[dict]:
    return render(request.param)


@pytest.fixture(scope="module")
def gpu() -> list[dict]:
    return render(GPU)


def of_kind(resources: list[dict], kind: str) -> dict[str, dict]:
    return {resource["metadata"]["name"]: resource for resource in resources if resource["kind"] == kind}


def container(deployment: dict) -> dict:
    """The one container of a specd pod."""
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def specd_args(deployment: dict):
    """The container's `specd ...` command, parsed by the real CLI parser."""
    command = container(deployment)["command"] + container(deployment)["args"]
    assert command[0] == "specd", command
    try:
        return _build_parser().parse_args(command[1:])
    except SystemExit:  # argparse said why on stderr
        pytest.fail(f"{deployment['metadata']['name']}: the specd CLI rejects {command}")


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def selected_deployment(service: dict, deployments: dict[str, dict]) -> dict:
    selector = service["spec"]["selector"].items()
    matching = [d for d in deployments.values() if selector <= d["spec"]["template"]["metadata"]["labels"].items()]
    assert len(matching) == 1, f"Service {service['metadata']['name']} selects {len(matching)} Deployments"
    return matching[0]


def test_every_file_a_kustomization_names_exists_and_every_manifest_is_named():
    for path in K8S.rglob("kustomization.yaml"):
        kustomization = yaml.safe_load(path.read_text())
        named = [*kustomization.get("resources", []), *(patch["path"] for patch in kustomization.get("patches", []))]
        assert all((path.parent / name).exists() for name in named), (path, named)
        manifests = {p.name for p in path.parent.glob("*.yaml")} - {"kustomization.yaml"}
        assert manifests <= set(named), f"{path}: {manifests - set(named)} not listed"


def test_without_kubectl_the_base_renders_as_kubectl_renders_it():
    if shutil.which("kubectl") is None:
        pytest.skip("no kubectl to compare with")

    def canonical(resources):
        return sorted(json.dumps(resource, sort_keys=True) for resource in resources)
    assert canonical(read_listed_resources(BASE)) == canonical(render(BASE))


def test_each_gpu_patch_names_a_resource_of_the_base_and_its_containers():
    """What kustomize would refuse, checked without it: a patch of something the base does not have."""
    base = read_listed_resources(BASE)
    for patch in yaml.safe_load((GPU / "kustomization.yaml").read_text())["patches"]:
        (change,) = _documents((GPU / patch["path"]).read_text())
        (patched,) = [r for r in base if (r["kind"], r["metadata"]["name"]) == (change["kind"],
                                                                                change["metadata"]["name"])]
        if change["kind"] == "Deployment":
            names = {c["name"] for c in patched["spec"]["template"]["spec"]["containers"]}
            assert {c["name"] for c in change["spec"]["template"]["spec"]["containers"]} <= names


def test_every_resource_is_valid_against_the_kubernetes_api_schema(resources):
    for resource in resources:
        validate(resource, KUBERNETES_VERSION, strict=True)  # strict: no field the API does not know


def test_there_are_a_gateway_a_target_and_each_cpu_drafter_each_a_deployment_behind_a_service(resources):
    deployments = of_kind(resources, "Deployment")
    roles = sorted(specd_args(deployment).service for deployment in deployments.values())
    assert roles == ["drafter", "drafter", "drafter", "gateway", "target"]
    methods = {specd_args(d).method for d in deployments.values() if specd_args(d).service == "drafter"}
    assert methods == {"ngram", "suffix", "trie"}
    served = {selected_deployment(service, deployments)["metadata"]["name"]
              for service in of_kind(resources, "Service").values()}
    assert served == set(deployments)


def test_a_deployment_selects_its_own_pods(resources):
    for deployment in of_kind(resources, "Deployment").values():
        spec = deployment["spec"]
        assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()


def test_every_service_port_leads_to_a_port_its_container_declares(resources):
    deployments = of_kind(resources, "Deployment")
    for service in of_kind(resources, "Service").values():
        declared = container(selected_deployment(service, deployments))["ports"]
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            assert any(target in (p["name"], p["containerPort"]) for p in declared), (service["metadata"], port)


def test_services_listen_on_all_interfaces_on_their_default_ports(resources):
    """Inside its pod each service keeps the ports `specd serve` gives it, as in docker-compose.yml;
    on loopback, its default, nothing outside the pod could reach it."""
    for deployment in of_kind(resources, "Deployment").values():
        args = specd_args(deployment)
        grpc_default, metrics_default = DEFAULT_ADDRESSES[args.service]
        listening = [args.listen, args.metrics_listen, *([args.http_listen] if args.service == "gateway" else [])]
        assert all(address.startswith("0.0.0.0:") for address in listening), listening
        assert (port_of(args.listen), port_of(args.metrics_listen)) == (port_of(grpc_default),
                                                                        port_of(metrics_default))
        ports = {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}
        assert ports["grpc"] == port_of(args.listen) and ports["metrics"] == port_of(args.metrics_listen)


def test_probes_ask_grpc_health_on_the_port_the_service_listens_on(resources):
    """Ready: SERVING. Alive: the target's own SERVING (it turns NOT_SERVING only when its scheduler
    has died); the others' LIVENESS, which stays SERVING while they answer (the gateway is NOT_SERVING
    while no target serves, and a restart would not change that)."""
    for name, deployment in of_kind(resources, "Deployment").items():
        args, probes = specd_args(deployment), container(deployment)
        for kind in ("readinessProbe", "livenessProbe", *(["startupProbe"] if "startupProbe" in probes else [])):
            assert probes[kind]["grpc"]["port"] == port_of(args.listen), (name, kind)
        assert probes["readinessProbe"]["grpc"].get("service", "") == ""
        liveness = "" if args.service == "target" else LIVENESS
        assert probes["livenessProbe"]["grpc"].get("service", "") == liveness, name


def test_prometheus_scrapes_every_pod_on_its_metrics_port(resources):
    for name, deployment in of_kind(resources, "Deployment").items():
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == "/metrics"
        assert int(annotations["prometheus.io/port"]) == port_of(specd_args(deployment).metrics_listen), name


def test_the_gateway_balances_over_the_target_replicas_through_a_headless_service(resources):
    deployments, services = of_kind(resources, "Deployment"), of_kind(resources, "Service")
    (gateway,) = [d for d in deployments.values() if specd_args(d).service == "gateway"]
    address = re.fullmatch(r"dns:///([a-z0-9-]+):(\d+)", specd_args(gateway).target)
    assert address, specd_args(gateway).target
    service = services[address.group(1)]
    assert service["spec"]["clusterIP"] == "None"
    assert int(address.group(2)) in [port["port"] for port in service["spec"]["ports"]]
    assert specd_args(selected_deployment(service, deployments)).service == "target"


def test_the_target_drafts_with_every_drafter_service(resources):
    deployments, services = of_kind(resources, "Deployment"), of_kind(resources, "Service")
    (target,) = [d for d in deployments.values() if specd_args(d).service == "target"]
    drafters = [spec.partition("=") for spec in specd_args(target).drafter]
    for method, _, address in drafters:
        host, _, port = address.rpartition(":")
        assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]], address
        assert specd_args(selected_deployment(services[host], deployments)).method == method
    assert len(drafters) == sum(specd_args(d).service == "drafter" for d in deployments.values())


def test_every_container_requests_cpu_and_memory_and_is_bounded_in_memory(resources):
    for name, deployment in of_kind(resources, "Deployment").items():
        limits = container(deployment)["resources"]
        assert {"cpu", "memory"} <= set(limits["requests"]), name
        assert "memory" in limits["limits"], name


def test_autoscalers_scale_deployments_whose_containers_request_what_they_measure(resources):
    deployments = of_kind(resources, "Deployment")
    autoscalers = of_kind(resources, "HorizontalPodAutoscaler")
    assert {a["spec"]["scaleTargetRef"]["name"] for a in autoscalers.values()} == {"gateway", "target"}
    for autoscaler in autoscalers.values():
        deployment = deployments[autoscaler["spec"]["scaleTargetRef"]["name"]]
        for metric in autoscaler["spec"]["metrics"]:
            if metric["type"] == "Resource":  # utilization is relative to the request
                assert metric["resource"]["name"] in container(deployment)["resources"]["requests"]
    gateway_metrics = autoscalers["gateway"]["spec"]["metrics"]
    assert [(m["type"], m["resource"]["name"]) for m in gateway_metrics] == [("Resource", "cpu")]


def test_every_image_is_one_a_dockerfile_builds(resources):
    for deployment in of_kind(resources, "Deployment").values():
        image = container(deployment)["image"]
        assert f"-t {image} " in IMAGES[image].read_text(), image


def test_on_cpu_no_pod_asks_for_a_gpu():
    for deployment in of_kind(render(BASE), "Deployment").values():
        assert container(deployment)["image"] == "specd:cpu"
        assert "nvidia.com/gpu" not in container(deployment)["resources"]["limits"]


def test_the_gpu_overlay_runs_the_target_alone_on_a_gpu_in_the_cuda_image(gpu):
    for name, deployment in of_kind(gpu, "Deployment").items():
        image, limits = container(deployment)["image"], container(deployment)["resources"]["limits"]
        if name == "target":
            assert (image, limits.get("nvidia.com/gpu"), specd_args(deployment).device) == ("specd:cuda", 1, "cuda")
        else:
            assert image == "specd:cpu" and "nvidia.com/gpu" not in limits, name
    (target_metric,) = of_kind(gpu, "HorizontalPodAutoscaler")["target"]["spec"]["metrics"]
    assert target_metric["pods"]["metric"]["name"] == "specd_requests_waiting"


def test_the_optional_service_monitor_scrapes_every_service_under_the_dashboards_job_names():
    (monitor,) = _documents(SERVICE_MONITOR.read_text())
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"].items()
    services = [s for s in of_kind(render(BASE), "Service").values() if selector <= s["metadata"]["labels"].items()]
    assert len(services) == len(of_kind(render(BASE), "Service"))
    jobs = {service["metadata"]["labels"][monitor["spec"]["jobLabel"]] for service in services}
    assert jobs == set(SPECD_ROLES)
    for endpoint in monitor["spec"]["endpoints"]:
        assert all(endpoint["port"] in [p["name"] for p in s["spec"]["ports"]] for s in services)
