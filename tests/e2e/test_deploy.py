"""The Kubernetes manifests in deploy/: valid as they stand, and in step with the image.

Every manifest is validated offline against the Kubernetes JSON schemas that
kubernetes-validate bundles, in strict mode (an unknown or misspelt field is an error).
The drift tests read the Dockerfile, docker-compose.yml and service/settings.py and check
what the manifests repeat from them: the image tag, the port, the probe paths, the
GRADSERVE_* names and values, the uid/gid, the shared-memory size, the memory arithmetic and
the shutdown timing. Each Deployment is paired with the compose service its
`app.kubernetes.io/component` label names (`api`, `api-gpu`).
"""

from __future__ import annotations

import copy
import json
import os
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gradserve.service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
# The Kubernetes version the manifests must be valid for (kubernetes-validate bundles the
# schemas of 1.25 and later; the test extra pins it).
KUBERNETES_VERSION = "1.30"
MANIFESTS = sorted(p for p in DEPLOY.rglob("*") if p.suffix in {".yaml", ".yml"})

GiB = 1024**3
# What the memory limit holds beside GRADSERVE_INFLIGHT_MEMORY_BYTES (docker-compose.yml's
# comment): each request being decoded takes ~8x its body as Python objects, and the
# runtime ~0.5 GiB, ~2 GiB with CUDA/CuPy.
DECODE_FACTOR = 8
RUNTIME_BYTES = {"cpu": GiB // 2, "gpu": 2 * GiB}
# Time after the graceful shutdown for the workers to close and the process to exit
# (compose: stop_grace_period 10 s = GRADSERVE_GRACEFUL_SHUTDOWN_S 8 s + 2 s).
EXIT_MARGIN_S = 2


# ------------------------------------------------------------------------------ helpers
@pytest.fixture(autouse=True)
def _no_gradserve_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings read the environment: the runner's own GRADSERVE_* must not stand in for
    the defaults a pod gets."""
    for name in list(os.environ):
        if name.startswith("GRADSERVE_"):
            monkeypatch.delenv(name)


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _all_documents() -> list[dict[str, Any]]:
    return [d for p in MANIFESTS for d in _documents(p)]


def _of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in _all_documents() if d["kind"] == kind]


DEPLOYMENTS = {d["metadata"]["name"]: d for d in _of_kind("Deployment")}


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def _compose_service(deployment: dict[str, Any]) -> dict[str, Any]:
    name = deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
    services = _compose()["services"]
    assert name in services, f"no compose service {name!r} for {deployment['metadata']['name']}"
    service: dict[str, Any] = services[name]
    return service


def _interpolate(value: object) -> object:
    """A compose value with `${VAR:-default}` as its default (the shell's value unset)."""
    if not isinstance(value, str):
        return value
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?-([^}]*)\}", r"\1", value)


def _dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def _dockerfile_user() -> tuple[int, int]:
    users = re.findall(r"^USER\s+(\d+):(\d+)\s*$", _dockerfile(), re.M)
    assert len(users) == 1, users
    return int(users[0][0]), int(users[0][1])


def _dockerfile_env(name: str) -> str:
    match = re.search(rf"\b{name}=(\S+)", _dockerfile())
    assert match, f"the Dockerfile sets no {name}"
    return match.group(1).rstrip("\\").strip()


def _quantity(value: object) -> Decimal:
    """A Kubernetes quantity ("7Gi", "500m", 5) as a number."""
    text = str(value)
    suffixes = {
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
        "m": Decimal("0.001"),
        "k": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
    }
    for suffix, factor in suffixes.items():
        if text.endswith(suffix):
            return Decimal(text[: -len(suffix)]) * Decimal(factor)
    return Decimal(text)


def _docker_bytes(value: object) -> int:
    """A Docker size ("512m", "7g"): binary units."""
    match = re.fullmatch(r"(\d+)([bkmg]?)b?", str(value).strip().lower())
    assert match, value
    return int(match.group(1)) * {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30}[match.group(2)]


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    container: dict[str, Any] = containers[0]
    return container


def _env(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in _container(deployment).get("env", [])}


def _env_values(deployment: dict[str, Any]) -> dict[str, str]:
    return {k: e["value"] for k, e in _env(deployment).items() if "value" in e}


def _effective(deployment: dict[str, Any]) -> Settings:
    """The settings a pod runs with: the Deployment's literal GRADSERVE_* values over the
    defaults (validated as the service validates them at start-up)."""
    fields = {
        k.removeprefix("GRADSERVE_").lower(): v
        for k, v in _env_values(deployment).items()
        if k.startswith("GRADSERVE_")
    }
    return Settings.model_validate(fields)


def _port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container["ports"] if "name" in p}
    assert port in named, f"no container port named {port!r}"
    return int(named[port])


# ----------------------------------------------------------------------- schema validity
def test_the_manifests_are_there() -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in _all_documents())
    assert kinds == [
        ("Deployment", "gradserve"),
        ("Deployment", "gradserve-gpu"),
        ("HorizontalPodAutoscaler", "gradserve"),
        ("PodDisruptionBudget", "gradserve"),
        ("PodDisruptionBudget", "gradserve-gpu"),
        ("Service", "gradserve"),
        ("Service", "gradserve-gpu"),
    ], kinds


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_manifest_is_valid_kubernetes(path: Path) -> None:
    documents = _documents(path)
    assert documents, f"{path} holds no resource"
    for doc in documents:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.path)
            pytest.fail(
                f"{path.name}: {doc['kind']}/{doc['metadata']['name']}: {where}: {e.message}"
            )


def test_the_validation_is_strict() -> None:
    """A misspelt field deep inside a pod spec is an error (the strict schemas are used)."""
    deployment = copy.deepcopy(DEPLOYMENTS["gradserve"])
    kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    _container(deployment)["securityContext"]["readOnlyRootFileSystem"] = True
    with pytest.raises(kubernetes_validate.ValidationError, match="readOnlyRootFileSystem"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


# ---------------------------------------------------------------------- wiring between them
def test_services_and_budgets_select_their_deployments_pods() -> None:
    pod_labels = {
        name: d["spec"]["template"]["metadata"]["labels"] for name, d in DEPLOYMENTS.items()
    }
    for name, d in DEPLOYMENTS.items():
        assert d["spec"]["selector"]["matchLabels"].items() <= pod_labels[name].items()
    for kind in ("Service", "PodDisruptionBudget"):
        for doc in _of_kind(kind):
            name = doc["metadata"]["name"]
            spec = doc["spec"]
            selector = spec["selector"] if kind == "Service" else spec["selector"]["matchLabels"]
            matched = [n for n, labels in pod_labels.items() if selector.items() <= labels.items()]
            assert matched == [name], f"{kind}/{name} selects {matched}"
    for service in _of_kind("Service"):
        container = _container(DEPLOYMENTS[service["metadata"]["name"]])
        for port in service["spec"]["ports"]:
            assert _port_number(container, port["targetPort"]) == port["port"] == 8000


def test_hpa_scales_the_cpu_deployment_on_cpu() -> None:
    (hpa,) = _of_kind("HorizontalPodAutoscaler")
    spec = hpa["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "gradserve",
    }
    assert "replicas" not in DEPLOYMENTS["gradserve"]["spec"], "the HPA owns the count"
    (metric,) = spec["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert 0 < metric["resource"]["target"]["averageUtilization"] <= 100
    # A drain the budget allows still leaves a pod serving.
    (pdb,) = [p for p in _of_kind("PodDisruptionBudget") if p["metadata"]["name"] == "gradserve"]
    assert spec["minReplicas"] - pdb["spec"]["maxUnavailable"] >= 1


# ------------------------------------------------------------------------------ drift
@pytest.fixture(params=sorted(DEPLOYMENTS), ids=str)
def deployment(request: pytest.FixtureRequest) -> dict[str, Any]:
    d: dict[str, Any] = DEPLOYMENTS[request.param]
    return d


def test_image_matches_compose(deployment: dict[str, Any]) -> None:
    assert _container(deployment)["image"] == _compose_service(deployment)["image"]


def test_gpu_variant(deployment: dict[str, Any]) -> None:
    service = _compose_service(deployment)
    resources = _container(deployment)["resources"]
    env = _env_values(deployment)
    if "gpu" not in service.get("profiles", []):
        assert "nvidia.com/gpu" not in resources["limits"]
        assert env["GRADSERVE_DEFAULT_DEVICE"] == "cpu"
        return
    assert int(resources["limits"]["nvidia.com/gpu"]) == 1
    assert int(resources["requests"].get("nvidia.com/gpu", 1)) == 1
    assert env["GRADSERVE_DEFAULT_DEVICE"] == "auto"
    # The GPU build's arguments, as compose passes them.
    args = {k: _interpolate(v) for k, v in service["build"]["args"].items()}
    annotations = deployment["metadata"]["annotations"]
    assert annotations["gradserve.io/build-base-image"] == args["BASE_IMAGE"]
    assert annotations["gradserve.io/build-extras"] == args["GRADSERVE_EXTRAS"]


def test_port_matches_the_image(deployment: dict[str, Any]) -> None:
    container = _container(deployment)
    exposed = re.findall(r"^EXPOSE\s+(\d+)", _dockerfile(), re.M)
    assert [p["containerPort"] for p in container["ports"]] == [int(p) for p in exposed]
    env = _env_values(deployment)
    assert env["GRADSERVE_PORT"] == _dockerfile_env("GRADSERVE_PORT") == exposed[0]
    # Probes come from the kubelet over the pod's address: all interfaces, as the image.
    assert env["GRADSERVE_HOST"] == _dockerfile_env("GRADSERVE_HOST") == "0.0.0.0"


def test_probes_hit_the_health_endpoints(deployment: dict[str, Any]) -> None:
    container = _container(deployment)
    paths = json.loads((ROOT / "openapi" / "openapi.json").read_text())["paths"]
    port = int(_env_values(deployment)["GRADSERVE_PORT"])
    expected = {
        "startupProbe": "/healthz",
        "livenessProbe": "/healthz",
        "readinessProbe": "/readyz",
    }
    for probe, path in expected.items():
        get = container[probe]["httpGet"]
        assert get["path"] == path
        assert "get" in paths[path], f"the service has no GET {path}"
        assert _port_number(container, get["port"]) == port
        assert get.get("scheme", "HTTP") == "HTTP"
        # Each answer is given far more than the measured p99 (32 ms at worst, README).
        assert container[probe]["timeoutSeconds"] >= 1
    assert container["livenessProbe"]["failureThreshold"] >= 3


def test_env_names_are_settings(deployment: dict[str, Any]) -> None:
    known = {f"GRADSERVE_{name.upper()}" for name in Settings.model_fields}
    names = [n for n in _env(deployment) if n.startswith("GRADSERVE_")]
    unknown = sorted(set(names) - known)
    assert not unknown, f"not settings in service/settings.py: {unknown}"
    assert len(names) == len(set(names)), "a variable set twice"
    # Service links would add GRADSERVE_PORT=tcp://..., GRADSERVE_SERVICE_HOST, ...
    assert deployment["spec"]["template"]["spec"]["enableServiceLinks"] is False
    # The values parse, and pass the settings' own checks.
    _effective(deployment)


def test_env_values_match_compose(deployment: dict[str, Any]) -> None:
    env = _env(deployment)
    compose_env = _compose_service(deployment)["environment"]
    for name, value in compose_env.items():
        assert name in env, f"compose sets {name}; the Deployment does not"
        if value is None:  # passed through from the shell: here a Secret
            assert "valueFrom" in env[name], name
            continue
        assert env[name].get("value") == str(_interpolate(value)), name


def test_resources_follow_the_memory_arithmetic(deployment: dict[str, Any]) -> None:
    settings = _effective(deployment)
    resources = _container(deployment)["resources"]
    limit = _quantity(resources["limits"]["memory"])
    assert _quantity(resources["requests"]["memory"]) == limit
    compose_limit = _compose_service(deployment)["deploy"]["resources"]["limits"]["memory"]
    assert limit == _docker_bytes(compose_limit)
    gpu = "nvidia.com/gpu" in resources["limits"]
    needed = (
        settings.inflight_memory_bytes
        + settings.max_concurrency * settings.max_body_bytes * DECODE_FACTOR
        + RUNTIME_BYTES["gpu" if gpu else "cpu"]
    )
    assert needed <= limit, f"{needed / GiB:.2f} GiB needed, limit {limit / GiB} GiB"
    # One core per compute worker, one for the front process; request = limit.
    cpu = _quantity(resources["limits"]["cpu"])
    assert _quantity(resources["requests"]["cpu"]) == cpu
    assert settings.compute_workers is not None
    assert settings.compute_workers <= settings.max_concurrency
    assert cpu >= settings.compute_workers + 1
    env = _env_values(deployment)
    for blas in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        assert env[blas] == "1", blas


def test_security_matches_the_image_and_compose(deployment: dict[str, Any]) -> None:
    uid, gid = _dockerfile_user()
    pod = deployment["spec"]["template"]["spec"]
    container = _container(deployment)
    for context in (pod["securityContext"], container["securityContext"]):
        assert context["runAsNonRoot"] is True
        assert (context["runAsUser"], context["runAsGroup"]) == (uid, gid)
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["fsGroup"] == gid
    assert pod["automountServiceAccountToken"] is False
    # compose's init: true (a reaper as PID 1): the pause process, in a shared namespace.
    assert pod["shareProcessNamespace"] is _compose_service(deployment).get("init", False)
    sc = container["securityContext"]
    service = _compose_service(deployment)
    assert service["read_only"] is True and sc["readOnlyRootFilesystem"] is True
    assert service["cap_drop"] == sc["capabilities"]["drop"] == ["ALL"]
    assert "no-new-privileges:true" in service["security_opt"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc.get("privileged", False) is False


def test_writable_mounts_match_compose(deployment: dict[str, Any]) -> None:
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in _container(deployment)["volumeMounts"]}
    service = _compose_service(deployment)
    tmpfs = [entry.split(":")[0] for entry in service["tmpfs"]]
    volumes_ = [entry.split(":")[1] for entry in service.get("volumes", [])]
    assert sorted(mounts) == sorted([*tmpfs, *volumes_, "/dev/shm"])
    # The program store: compose's named volume, a disk emptyDir here, named to the service.
    store = _env_values(deployment)["GRADSERVE_PROGRAM_STORE_DIR"]
    assert volumes_ == [store] and "medium" not in mounts[store]["emptyDir"]
    assert service["environment"]["GRADSERVE_PROGRAM_STORE_DIR"] == store
    for path in tmpfs:
        assert "emptyDir" in mounts[path], path
        assert not mounts[path].get("readOnly", False)
    shm = mounts["/dev/shm"]["emptyDir"]
    assert shm["medium"] == "Memory"
    assert _quantity(shm["sizeLimit"]) == _docker_bytes(service["shm_size"])


def test_shutdown_outlasts_the_graceful_period(deployment: dict[str, Any]) -> None:
    settings = _effective(deployment)  # GRADSERVE_GRACEFUL_SHUTDOWN_S, or its default
    pod = deployment["spec"]["template"]["spec"]
    command = _container(deployment)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "/bin/sleep" and len(command) == 2, command
    pre_stop_s = int(command[1])
    assert pre_stop_s >= 1
    grace = pod["terminationGracePeriodSeconds"]
    assert grace >= pre_stop_s + settings.graceful_shutdown_s + EXIT_MARGIN_S, (
        f"terminationGracePeriodSeconds {grace} < preStop {pre_stop_s} + "
        f"graceful_shutdown_s {settings.graceful_shutdown_s} + {EXIT_MARGIN_S}"
    )
    # The image stops on SIGTERM, Kubernetes' signal.
    assert re.search(r"^STOPSIGNAL\s+SIGTERM\s*$", _dockerfile(), re.M)
