"""The deployment files under deploy/ stay valid and agree with the deploy file and the code.

Checked offline and fast: both deploy files load through omnistage's own config loader and their
memory ledgers fit; `docker-compose config` validates both compose stacks, which run exactly the deploy
file's services and ranks; `promtool` checks the Prometheus config and alert rules, whose targets are the
deploy file's metrics ports; the Kubernetes manifests pass the bundled schemas (kubernetes-validate,
strict) and carry production.yaml with only addresses and GPU indices changed; every metric name the
dashboard and the alert rules use is declared by some service. The tools (docker-compose, promtool) are
installed by `make test`; a missing tool fails these tests, it never skips them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml
from omnistage.common.cli import main as cli_main
from omnistage.common.config import config_to_dict, load_config
from omnistage.common.memory.ledger import budgeted_devices, check_ledger

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PRODUCTION = DEPLOY / "production.yaml"
SINGLE_GPU = DEPLOY / "single-gpu.yaml"
COMPOSE = {DEPLOY / "docker-compose.yml": PRODUCTION, DEPLOY / "docker-compose.single-gpu.yml": SINGLE_GPU}
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARDS = sorted((DEPLOY / "grafana" / "dashboards").glob("*.json"))
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))
GIB = 2**30
H100, H200 = 80 * 10**9, 143771 * 2**20
COMPOSE_ENV = {
    "OMNISTAGE_MODEL_DIR": "/srv/models/ming",
    "OMNISTAGE_ADMIN_KEY": "admin-test",
    "OMNISTAGE_STAGE_KEY": "stage-test",
    "OMNISTAGE_API_KEYS": "k1,k2",
    "GRAFANA_ADMIN_PASSWORD": "pw",
}
# Names Prometheus makes itself (not exported by a service).
PROMETHEUS_BUILTINS = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def _tool(*names: str) -> list[str]:
    for name in names:
        if name == "docker compose":
            docker = shutil.which("docker")
            if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
                return [docker, "compose"]
        elif shutil.which(name):
            return [shutil.which(name)]
    pytest.fail(f"none of {', '.join(names)} is on PATH: run deploy/test-tools.sh (`make test` does)")


def _run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=None if env is None else {**os.environ, **env},
    )


# -- deploy files ---------------------------------------------------------------------------------


def test_production_places_the_thinker_on_0_3_encoder_and_talker_on_4_imagegen_on_5():
    cfg = load_config(PRODUCTION)
    s = cfg.services
    assert {n: sv.kind for n, sv in s.items()} == {
        "thinker": "thinker",
        "encoder": "encoder",
        "talker": "talker",
        "imagegen": "imagegen",
        "gateway": "gateway",
    }
    assert (s["thinker"].tp_size, s["thinker"].gpus) == (4, (0, 1, 2, 3))
    assert s["encoder"].gpus == s["talker"].gpus == (4,) and s["imagegen"].gpus == (5,)
    assert all(sv.device == "cuda" and sv.dtype == "bfloat16" for sv in s.values() if sv.kind != "gateway")
    assert s["gateway"].bind_host == "0.0.0.0" and s["gateway"].api_keys_env
    assert all(
        sv.bind_host == "127.0.0.1" for n, sv in s.items() if n != "gateway"
    )  # only the gateway faces others
    assert all(sv.admin_port and sv.metrics_port and sv.admin_api_key_env for sv in s.values())
    assert all(sv.fault is None for sv in s.values())


@pytest.mark.parametrize("path", [PRODUCTION, SINGLE_GPU], ids=lambda p: p.name)
@pytest.mark.parametrize("total", [H100, H200], ids=["80GB", "141GB"])
def test_deploy_file_memory_ledger_fits(path, total):
    cfg = load_config(path)
    devices = budgeted_devices(cfg)
    assert devices  # every GPU service has a budget
    report = check_ledger(cfg, dict.fromkeys(devices, total))
    assert report.fits


# -- docker-compose ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose_configs() -> dict[Path, dict]:
    """`docker-compose config` of each stack (validates it), parsed."""
    cmd = _tool("docker-compose", "docker compose")
    out = {}
    for compose in COMPOSE:
        result = _run([*cmd, "-f", str(compose), "config"], env=COMPOSE_ENV)
        assert result.returncode == 0, f"{compose.name}: {result.stderr}"
        out[compose] = yaml.safe_load(result.stdout)
    return out


def test_compose_refuses_to_start_without_the_model_and_keys():
    cmd = _tool("docker-compose", "docker compose")
    env = {k: "" for k in COMPOSE_ENV} | {
        "OMNISTAGE_ADMIN_KEY": "a",
        "OMNISTAGE_STAGE_KEY": "s",
        "OMNISTAGE_API_KEYS": "b",
        "GRAFANA_ADMIN_PASSWORD": "c",
    }
    result = _run([*cmd, "-f", str(DEPLOY / "docker-compose.yml"), "config"], env=env)
    assert result.returncode != 0 and "OMNISTAGE_MODEL_DIR" in result.stdout + result.stderr


def _mounts(svc: dict) -> dict[str, tuple[str, bool]]:
    """target → (source, read-only) of a service's volumes: short (docker-compose 1.x) or long (v2) syntax."""
    out = {}
    for v in svc.get("volumes", []):
        if isinstance(v, str):
            source, target, *mode = v.split(":")
            out[target] = (source, mode == ["ro"])
        else:
            out[v["target"]] = (v["source"], bool(v.get("read_only")))
    return out


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.parametrize("compose", list(COMPOSE), ids=lambda p: p.name)
def test_compose_runs_each_service_and_rank_of_the_deploy_file_once(compose_configs, compose):
    stack = compose_configs[compose]["services"]
    cfg = load_config(COMPOSE[compose])
    wanted = {(n, r) for n, sv in cfg.services.items() for r in range(sv.tp_size)}
    seen = {}
    for name, svc in stack.items():
        command = svc.get("command") or []
        if "--service" not in command:
            continue
        service, rank = _flag(command, "--service"), int(_flag(command, "--rank"))
        kind = cfg.service(service).kind
        assert command[:3] == ["python", "-m", f"omnistage.services.{kind}"], name
        assert _flag(command, "--config") == "/etc/omnistage/deploy.yaml"
        mounts = _mounts(svc)
        assert mounts["/etc/omnistage/deploy.yaml"] == (str(COMPOSE[compose]), True)
        assert mounts[cfg.model.checkpoint] == (COMPOSE_ENV["OMNISTAGE_MODEL_DIR"], True)
        # one host: the deploy file's addresses, /dev/shm + CUDA IPC, and pids TP ranks and shm sweeps can see
        assert (svc["network_mode"], svc["ipc"], svc["pid"]) == ("host", "host", "host"), name
        assert svc["restart"] == "unless-stopped"
        assert svc["environment"]["OMNISTAGE_ADMIN_KEY"] == COMPOSE_ENV["OMNISTAGE_ADMIN_KEY"]
        assert svc["environment"]["OMNISTAGE_STAGE_KEY"] == COMPOSE_ENV["OMNISTAGE_STAGE_KEY"]
        test = svc["healthcheck"]["test"]
        if rank == 0:
            assert test == ["CMD", "omnistage", "health", cfg.admin_address(service)], name
        else:
            assert test == [
                "CMD",
                "omnistage",
                "health",
                "--status-file",
                f"/run/omnistage/{service}.r{rank}.json",
            ]
        sv = cfg.service(service)
        devices = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        if sv.device == "cuda":
            reserved = {int(i) for d in devices for i in d["device_ids"]}
            # in-container indices equal the deploy file's only if the reservation is 0..n-1 (the GPUs
            # the host exposes are renumbered from 0)
            assert set(sv.gpus) <= reserved and reserved == set(range(len(reserved))) or len(reserved) == 1, (
                name
            )
            assert all(d["driver"] == "nvidia" and d["capabilities"] == ["gpu"] for d in devices)
        else:
            assert not devices, name
        seen[(service, rank)] = name
    assert set(seen) == wanted
    assert {"prometheus", "grafana"} <= set(stack)
    assert stack["gateway"]["environment"]["OMNISTAGE_API_KEYS"] == COMPOSE_ENV["OMNISTAGE_API_KEYS"]


def _env_file(path: Path) -> dict[str, str]:
    pairs = [
        line.split("=", 1) for line in path.read_text().splitlines() if line and not line.startswith("#")
    ]
    return dict(pairs)


def test_the_keys_env_file_is_what_compose_and_kubernetes_read(tmp_path, capsys):
    """`omnistage keys --env-file` writes every key both stacks need (0600, never over an existing
    file): `docker-compose --env-file` starts from it with nothing but the model in the environment,
    and each key a Kubernetes manifest takes from the omnistage-keys Secret is a name in it."""
    path = tmp_path / "keys.env"
    assert cli_main(["keys", "--env-file", str(path), "--api-keys", "2"]) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    keys = _env_file(path)
    assert set(keys) == {
        "OMNISTAGE_API_KEYS",
        "OMNISTAGE_ADMIN_KEY",
        "OMNISTAGE_STAGE_KEY",
        "GRAFANA_ADMIN_PASSWORD",
    }
    assert len(keys["OMNISTAGE_API_KEYS"].split(",")) == 2 and len(set(keys.values())) == 4
    assert cli_main(["keys", "--env-file", str(path)]) == 2 and _env_file(path) == keys
    assert "--force" in capsys.readouterr().err
    assert cli_main(["keys", "--env-file", str(path), "--force"]) == 0 and _env_file(path) != keys
    keys = _env_file(path)
    cmd = _tool("docker-compose", "docker compose")
    # nothing but the model from the environment (a variable set there would win over the file)
    env = {k: v for k, v in os.environ.items() if k not in keys}
    env["OMNISTAGE_MODEL_DIR"] = COMPOSE_ENV["OMNISTAGE_MODEL_DIR"]
    for compose in COMPOSE:
        result = subprocess.run(
            [*cmd, "--env-file", str(path), "-f", str(compose), "config"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env=env,
        )
        assert result.returncode == 0, f"{compose.name}: {result.stderr}"
        stack = yaml.safe_load(result.stdout)["services"]
        assert stack["gateway"]["environment"]["OMNISTAGE_STAGE_KEY"] == keys["OMNISTAGE_STAGE_KEY"]
        assert stack["gateway"]["environment"]["OMNISTAGE_API_KEYS"] == keys["OMNISTAGE_API_KEYS"]
    refs = {
        e["valueFrom"]["secretKeyRef"]["key"]
        for _, d in _k8s_docs()
        if d["kind"] in ("StatefulSet", "Deployment")
        for c in d["spec"]["template"]["spec"]["containers"]
        for e in c.get("env", [])
        if e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == "omnistage-keys"
    }
    assert refs and refs <= set(keys)


def test_single_gpu_compose_maps_one_host_gpu_to_cuda_0(compose_configs):
    cfg = load_config(SINGLE_GPU)
    assert all(sv.gpus == (0,) for sv in cfg.services.values() if sv.device == "cuda")
    thinker = compose_configs[DEPLOY / "docker-compose.single-gpu.yml"]["services"]["thinker"]
    assert thinker["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["0"]


def test_image_installs_the_project_and_checks_grpc_health():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}", text, re.M) and "nvidia/cuda:" in text
    assert re.search(r"^USER omnistage$", text, re.M)
    assert re.search(r"^HEALTHCHECK .*\n?.*omnistage health", text, re.M)
    for part in ("pyproject.toml", "protos", "common", "services"):
        assert re.search(rf"^COPY {part}\b", text, re.M), part
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored


# -- Prometheus -------------------------------------------------------------------------------------


def test_promtool_accepts_the_config_and_the_rules():
    promtool = _tool("promtool")
    for args in (["check", "config", str(PROMETHEUS)], ["check", "rules", str(ALERTS)]):
        result = _run([*promtool, *args])
        assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}{result.stderr}"


def test_promtool_unit_tests_of_the_alert_rules():
    result = _run([*_tool("promtool"), "test", "rules", str(DEPLOY / "prometheus" / "alerts_test.yml")])
    assert result.returncode == 0, f"{result.stdout}{result.stderr}"


@pytest.mark.parametrize("path", [PRODUCTION, SINGLE_GPU], ids=lambda p: p.name)
def test_prometheus_scrapes_every_metrics_port_of_the_deploy_file(path):
    cfg = load_config(path)
    wanted = {f"omnistage-{n}": f"{cfg.host}:{sv.metrics_port}" for n, sv in cfg.services.items()}
    jobs = {
        j["job_name"]: [t for sc in j["static_configs"] for t in sc["targets"]]
        for j in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
    }
    assert {j: t for j, t in jobs.items() if j.startswith("omnistage-")} == {
        j: [t] for j, t in wanted.items()
    }


# -- Kubernetes -------------------------------------------------------------------------------------


def _k8s_docs() -> list[tuple[Path, dict]]:
    return [(p, d) for p in K8S for d in yaml.safe_load_all(p.read_text()) if d]


def test_kubernetes_manifests_match_the_bundled_schemas():
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is not installed (it is in the dev extra: `make install`)")
    problems = []
    for path, doc in _k8s_docs():
        try:
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(
                f"{path.name} {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}"
            )
    assert not problems, "\n".join(problems)


def _k8s_deploy_file(tmp_path: Path) -> Path:
    (cm,) = [
        d for _, d in _k8s_docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "omnistage-deploy"
    ]
    path = tmp_path / "deploy.yaml"
    path.write_text(cm["data"]["deploy.yaml"])
    return path


def test_kubernetes_deploy_file_is_production_with_pod_addresses_and_gpus(tmp_path):
    k8s = load_config(_k8s_deploy_file(tmp_path))
    prod = load_config(PRODUCTION)
    a, b = config_to_dict(k8s), config_to_dict(prod)
    assert a.pop("host") == "0.0.0.0"
    b.pop("host")
    for name, svc in a["services"].items():
        other = b["services"][name]
        if name == "gateway":
            assert svc["bind_host"] == "0.0.0.0"
        else:
            assert svc.pop("bind_host") == svc.pop("admin_host") == f"{name}-0.{name}"
            other.pop("bind_host"), other.pop("admin_host")
        if svc["device"] == "cuda":  # one pod per rank, each with its one GPU as cuda:0
            assert tuple(svc.pop("gpus")) == (0,) * svc["tp_size"]
            other.pop("gpus")
    assert a == b


def test_kubernetes_workloads_run_every_rank_with_one_gpu_and_a_readiness_probe(tmp_path):
    cfg = load_config(_k8s_deploy_file(tmp_path))
    workloads = {
        d["metadata"]["name"]: d for _, d in _k8s_docs() if d["kind"] in ("StatefulSet", "Deployment")
    }
    services = {d["metadata"]["name"]: d for _, d in _k8s_docs() if d["kind"] == "Service"}
    assert set(workloads) == set(cfg.services)
    for name, svc in cfg.services.items():
        w = workloads[name]
        (container,) = w["spec"]["template"]["spec"]["containers"]
        assert w["spec"]["replicas"] == svc.tp_size
        command = " ".join(container["command"] + container["args"])
        assert f"omnistage.services.{svc.kind}" in command and f"--service {name}" in command
        ports = {p["containerPort"] for p in container["ports"]}
        assert {svc.port, svc.admin_port, svc.metrics_port} <= ports
        gpus = container["resources"]["limits"].get("nvidia.com/gpu", 0)
        assert gpus == (1 if svc.device == "cuda" else 0), name
        probe = container["readinessProbe"]
        if svc.tp_size > 1:
            assert w["kind"] == "StatefulSet" and w["spec"]["podManagementPolicy"] == "Parallel"
            assert "omnistage health --status-file" in " ".join(probe["exec"]["command"])
            assert f"--set host={name}-0.{name}" in command and '--rank "${HOSTNAME##*-}"' in command
        else:
            assert probe["grpc"]["port"] in (svc.admin_port, svc.port)
        if svc.kind != "gateway":  # the headless Service that gives `<name>-0.<name>`
            assert w["kind"] == "StatefulSet" and w["spec"]["serviceName"] == name
            assert services[name]["spec"]["clusterIP"] == "None"
            assert services[name]["spec"]["publishNotReadyAddresses"] is True


# -- metric names -------------------------------------------------------------------------------------

_DECL = re.compile(
    r"\b(?:metrics\.|_)?(counter|gauge|histogram|Counter|Gauge|Histogram)\(\s*\"([A-Za-z_:][A-Za-z0-9_:]*)\""
)


def declared_metrics() -> set[str]:
    """Every series name a service can export, from the metric declarations in services/ and common/."""
    names = set()
    for path in [*(ROOT / "services").rglob("*.py"), *(ROOT / "common").rglob("*.py")]:
        for kind, name in _DECL.findall(path.read_text()):
            kind = kind.lower()
            full = name if name.startswith("omnistage_") else f"omnistage_{name}"
            if kind == "counter":
                base = full.removesuffix("_total")
                names |= {f"{base}_total", f"{base}_created"}
            elif kind == "histogram":
                names |= {full, f"{full}_bucket", f"{full}_sum", f"{full}_count", f"{full}_created"}
            else:
                names.add(full)
    return names


_FUNCTIONS = {
    "rate",
    "irate",
    "increase",
    "sum",
    "max",
    "min",
    "avg",
    "count",
    "by",
    "without",
    "on",
    "ignoring",
    "histogram_quantile",
    "le",
    "and",
    "or",
    "unless",
    "bool",
    "group_left",
    "group_right",
    "offset",
    "humanize",
    "topk",
    "bottomk",
    "abs",
    "clamp_min",
    "clamp_max",
    "delta",
    "deriv",
    "time",
    "vector",
    "label_replace",
    "absent",
    "changes",
    "resets",
    "avg_over_time",
    "max_over_time",
    "min_over_time",
}


def metric_names(expr: str) -> set[str]:
    """Series names in a PromQL expression: identifiers not inside quotes, braces or a grouping clause."""
    expr = re.sub(r'"[^"]*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "{}", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    return {
        n
        for n in re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", expr)
        if n not in _FUNCTIONS and not re.fullmatch(r"[0-9.e]+", n)
    } - {"e"}


def _used_exprs() -> dict[str, list[str]]:
    used = {}
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            used.setdefault(ALERTS.name, []).append(rule["expr"])
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            used.setdefault(path.name, []).extend(t["expr"] for t in panel.get("targets", []))
    return used


def test_metric_name_parser():
    assert metric_names(
        'histogram_quantile(0.95, sum by (service, le) (rate(omnistage_x_bucket{a="b c"}[5m])))'
    ) == {"omnistage_x_bucket"}
    assert metric_names('omnistage_a{kind="total"} > ignoring(kind) (omnistage_b > 0)') == {
        "omnistage_a",
        "omnistage_b",
    }
    declared = declared_metrics()
    for name in (
        "omnistage_rpc_requests_total",
        "omnistage_rpc_latency_seconds_bucket",
        "omnistage_phase",
        "omnistage_memory_bytes",
        "omnistage_transport_bytes_total",
        "omnistage_gateway_ttfa_seconds_bucket",
        "omnistage_imagegen_images_total",
        "omnistage_talker_active_jobs",
    ):
        assert name in declared, name


def test_dashboard_and_alerts_use_only_exported_metrics():
    declared = declared_metrics()
    unknown = {
        f"{where}: {name}"
        for where, exprs in _used_exprs().items()
        for e in exprs
        for name in metric_names(e)
        if name not in declared and name not in PROMETHEUS_BUILTINS
    }
    assert not unknown, "metrics used but exported by no service:\n" + "\n".join(sorted(unknown))
    assert DASHBOARDS and all(_used_exprs()[p.name] for p in DASHBOARDS)


def _declarations() -> set[str]:
    """The name each metric declaration exports as (counters with `_total`)."""
    names = set()
    for path in [*(ROOT / "services").rglob("*.py"), *(ROOT / "common").rglob("*.py")]:
        for kind, name in _DECL.findall(path.read_text()):
            full = name if name.startswith("omnistage_") else f"omnistage_{name}"
            names.add(f"{full.removesuffix('_total')}_total" if kind.lower() == "counter" else full)
    return names


def test_every_declared_metric_is_documented_and_every_documented_one_declared():
    documented = set(re.findall(r"`(omnistage_[a-z0-9_]+)`", (ROOT / "docs/metrics.md").read_text()))
    declared = _declarations()
    assert not declared - documented, f"declared but not in docs/metrics.md: {sorted(declared - documented)}"
    assert not documented - declared, (
        f"in docs/metrics.md but declared by no service: {sorted(documented - declared)}"
    )


def test_dashboard_uses_the_provisioned_datasource():
    (ds,) = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())[
        "datasources"
    ]
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/omnistage.yml").read_text())[
        "providers"
    ][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        for panel in dash["panels"]:
            if "datasource" in panel:
                assert panel["datasource"]["uid"] == ds["uid"], panel["title"]
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids))
