"""deploy/helm/kvpool: the chart lints strictly, and renders, for its defaults and for every
values profile in profiles/, into manifests that Kubernetes' own schema accepts and that run
kvpool the way it must be run (arguments kvpool's command line accepts, stable node ids,
probes on the metrics port, non-root, hugepages and RDMA only where asked); broken values are
refused with a message that says what to do.

Offline, with no cluster and no helm binary: PyPI's helm-python-sdk (Helm's Go SDK as a
library, bundled in its wheel) lints and renders; PyPI's kubernetes-validate holds the
Kubernetes JSON schemas. Both are in pyproject's `dev` extra (`bash scripts/setup.sh --tests`).
"""

from __future__ import annotations

import copy
import platform
import re
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "kvpool"
PROFILES = {p.stem: p for p in sorted((CHART / "profiles").glob("*.yaml"))}
ALERTS = ROOT / "deploy" / "prometheus" / "kvpool-alerts.yml"

# The Kubernetes versions whose schemas every rendered object must satisfy: the oldest the chart
# claims to support (Chart.yaml's kubeVersion) and the newest kubernetes-validate ships.
CHART_YAML = yaml.safe_load((CHART / "Chart.yaml").read_text())
OLDEST = re.fullmatch(r">=\s*(\d+\.\d+\.\d+)(-0)?", CHART_YAML["kubeVersion"]).group(1)
KUBERNETES_VERSIONS = (OLDEST, "1.37.0")
# The Prometheus Operator's kinds: kubernetes-validate has no schema for custom resources, so
# they are checked field by field below (test_monitoring_objects) rather than skipped unseen.
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}
# What `helm template --api-versions monitoring.coreos.com/v1` says; the SDK's offline render
# cannot be told which APIs a cluster serves.
OFFLINE = {"monitoring": {"requireApi": False}}
RELEASE, NAMESPACE = "kv", "llm"
MASTER, NODE = f"{RELEASE}-kvpool-master", f"{RELEASE}-kvpool-store-node"


def _import_helm():
    try:
        import helm_python
        return helm_python
    except ImportError:
        # The wheel bundles Helm's library for Linux x86-64 only; elsewhere pip would need Go.
        if sys.platform == "linux" and platform.machine() == "x86_64":
            pytest.fail("helm-python-sdk is missing: run `bash scripts/setup.sh --tests`")
        pytest.skip(f"helm-python-sdk has no wheel for {sys.platform}/{platform.machine()}")


@pytest.fixture(scope="module")
def helm():
    return _import_helm()


@pytest.fixture(scope="module")
def kubernetes_validate():
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is missing: run `bash scripts/setup.sh --tests`")
    return kubernetes_validate


def merged(base: dict, *overrides: dict) -> dict:
    """``base`` with each override laid over it, maps merged key by key (as helm -f does)."""
    out = copy.deepcopy(base)
    for override in overrides:
        for key, value in override.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merged(out[key], value)
            else:
                out[key] = copy.deepcopy(value)
    return out


def profile_values(name: str) -> dict:
    """The values `helm template -f profiles/NAME.yaml` uses ("default": none)."""
    return {} if name == "default" else yaml.safe_load(PROFILES[name].read_text()) or {}


@cache
def _render(name: str) -> tuple[dict, ...]:
    helm = _import_helm()
    with helm.Chart.load(CHART) as chart:
        out = chart.render(merged(profile_values(name), OFFLINE), name=RELEASE,
                           namespace=NAMESPACE, is_install=True)
    return tuple(doc for path, text in sorted(out.items()) if not path.endswith("NOTES.txt")
                 for doc in yaml.safe_load_all(text) if doc)


def render(name: str) -> list[dict]:
    return copy.deepcopy(list(_render(name)))


def render_values(helm, values: dict, release: str = RELEASE) -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        out = chart.render(values, name=release, namespace=NAMESPACE, is_install=True)
    return [doc for path, text in out.items() if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {len(found)}"
    return found[0]


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")]


def node_workload(docs: list[dict]) -> dict:
    [node] = [d for d in workloads(docs) if d["metadata"]["name"] == NODE]
    return node


def container(workload: dict) -> dict:
    [c] = workload["spec"]["template"]["spec"]["containers"]
    return c


def flags(c: dict) -> dict[str, list[str]]:
    """--name=value arguments as {name: [values]} (a bare --flag has the value "")."""
    out: dict[str, list[str]] = {}
    for arg in c["args"][1:]:
        name, _, value = arg.partition("=")
        out.setdefault(name, []).append(value)
    return out


def kubernetes_bytes(quantity: str | int) -> int:
    """A Kubernetes memory quantity (4608Mi, 32Gi, 1G, 1024) in bytes."""
    m = re.fullmatch(r"([0-9.]+)([KMGTP]i?|)", str(quantity))
    assert m, f"not a memory quantity: {quantity!r}"
    number, unit = float(m.group(1)), m.group(2)
    power = "KMGTP".index(unit[0]) + 1 if unit else 0
    return int(number * (1024 if unit.endswith("i") else 1000) ** power)


CASES = ["default", *PROFILES]


def test_the_documented_profiles_are_all_there():
    # Each is rendered and validated below; a profile renamed away must not go unchecked.
    assert {"single", "ha", "disk-tier", "rdma-hugepages", "daemonset", "monitoring"} <= set(
        PROFILES)


def test_chart_and_image_carry_the_projects_version():
    import tomllib
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert (CHART_YAML["version"], CHART_YAML["appVersion"]) == (version, version)
    image = container(one(render("default"), "Deployment", MASTER))["image"]
    assert image == f"kvpool:{version}"


@pytest.mark.parametrize("case", CASES)
def test_chart_lints_strictly(helm, case):
    report = helm.lint(CHART, merged(profile_values(case), OFFLINE), strict=True,
                       namespace=NAMESPACE)
    # Severity 2 is a warning, 3 an error; 1 (info: "icon is recommended") is no finding.
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


def test_lint_reports_a_broken_template(helm, tmp_path):
    """The lint above can fail: a template that dereferences a missing value is an error."""
    import shutil
    chart = tmp_path / "kvpool"
    shutil.copytree(CHART, chart, symlinks=False)
    (chart / "templates" / "broken.yaml").write_text(
        "kind: ConfigMap\nmetadata: {name: {{ .Values.nope.deep }} }\n")
    report = helm.lint(chart, strict=True)
    assert any("nope" in e for e in report["errors"]), report


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("case", CASES)
def test_every_object_is_valid_kubernetes(kubernetes_validate, case, version):
    docs = render(case)
    unchecked = set()
    for doc in docs:
        try:
            used = kubernetes_validate.validate(doc, version, strict=True)
            # validate() quietly falls back to an older schema where it lacks the version asked.
            assert used == version.rsplit(".", 1)[0]
        except kubernetes_validate.SchemaNotFoundError:
            assert doc["kind"] in OPERATOR_KINDS, f"no schema for {doc['kind']}"
            unchecked.add(doc["kind"])
        except kubernetes_validate.ValidationError as e:
            where = ".".join(str(p) for p in e.path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {where}: {e.message}")
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ServiceAccount"} <= kinds
    assert kinds & {"StatefulSet", "DaemonSet"}
    assert unchecked == (kinds & OPERATOR_KINDS)


def test_kubernetes_validate_rejects_a_wrong_field(kubernetes_validate):
    """The validation above can fail: a misspelt field of a rendered object is refused."""
    node = node_workload(render("default"))
    node["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(node, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("case", CASES)
def test_arguments_are_what_kvpools_command_line_accepts(case, tmp_path):
    """Each container's arguments parse with kvpool's own parser (a flag the CLI renamed fails
    here, not in a cluster), and say what the chart's ports and objects say."""
    from kvpool.common.addresses import parse_etcd_url
    from kvpool.common.config import MasterConfig, load, parse_size
    from kvpool.tools.cli import build_parser
    docs = render(case)
    pod_env = {"POD_IP": "10.1.2.3", "POD_NAME": f"{NODE}-0", "NODE_NAME": "gpu-host-7"}
    for workload in workloads(docs):
        c = container(workload)
        argv = [re.sub(r"\$\((\w+)\)", lambda m: pod_env[m.group(1)], a) for a in c["args"]]
        parser, _ = build_parser(argv[0])
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"kvpool refuses {workload['metadata']['name']}'s arguments: {argv}")
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert args.host == "0.0.0.0"
        assert args.metrics_port == ports["metrics"]
        assert (args.log_format, args.log_level) == ("json", "info")
        if args.command == "master":
            assert (args.port, args.lookup_port) == (ports["grpc"], ports["lookup"])
            # Secure by default: the master's own certificate, never plain text.
            assert args.credentials and not args.insecure
            if args.ha:
                parse_etcd_url(args.ha)
                assert args.advertise == f"10.1.2.3:{ports['grpc']}"
            if args.config:
                [cm] = find(docs, "ConfigMap", MASTER)
                settings = tmp_path / "master.yaml"
                settings.write_text(cm["data"]["master.yaml"])
                load(MasterConfig, settings)   # an unknown or malformed setting raises
        else:
            assert args.port == ports["data"]
            assert args.advertise_host == "10.1.2.3" and args.no_shm
            assert all(parse_size(s) for s in args.segment_size)
            if args.master.startswith("etcd://"):
                parse_etcd_url(args.master)
            else:
                assert args.master == f"{MASTER}.{NAMESPACE}.svc:50051"
                one(docs, "Service", MASTER)


def test_data_tls_makes_store_nodes_serve_tls(helm):
    """security.dataTls: every store node runs with --data-tls, an argument kvpool's parser
    takes; off by default."""
    from kvpool.tools.cli import build_parser
    assert "--data-tls" not in container(node_workload(render("default")))["args"]
    args = container(node_workload(render_values(helm, {"security": {"dataTls": True}})))["args"]
    assert "--data-tls" in args
    parser, _ = build_parser("store-node")
    assert parser.parse_args([a.replace("$(", "").replace(")", "") for a in args]).data_tls


@pytest.mark.parametrize("case", CASES)
def test_store_nodes_keep_their_id_across_restarts(case):
    """The disk tier belongs to a node id: a restarted node must come back with the same one."""
    node = node_workload(render(case))
    c = container(node)
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"]}
    [node_id] = flags(c)["--node-id"]
    if node["kind"] == "StatefulSet":   # a StatefulSet's pod keeps its name
        assert node_id == "$(POD_NAME)" and env["POD_NAME"] == "metadata.name"
    else:                               # a DaemonSet's pod does not; its host keeps its name
        assert node_id == "$(NODE_NAME)" and env["NODE_NAME"] == "spec.nodeName"
    assert env["POD_IP"] == "status.podIP"


@pytest.mark.parametrize("case", CASES)
def test_pods_run_as_non_root_with_nothing_to_spare(case):
    rdma = case == "rdma-hugepages"
    for workload in workloads(render(case)):
        spec = workload["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == 10001
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        assert spec["enableServiceLinks"] is False
        sc = container(workload)["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        is_node = workload["metadata"]["name"] == NODE
        # IPC_LOCK pins RDMA-registered segments; nothing else gets a capability back.
        assert sc["capabilities"].get("add", []) == (["IPC_LOCK"] if rdma and is_node else [])


@pytest.mark.parametrize("case", CASES)
def test_probes_ask_the_metrics_port(case):
    docs = render(case)
    ha = case == "ha"
    for workload in workloads(docs):
        c = container(workload)
        assert {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"] == int(
            flags(c)["--metrics-port"][0])
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"]["port"] == "metrics", probe
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        is_master = workload["metadata"]["name"] == MASTER
        # A standby master is never /readyz-ready: HA masters are ready while alive.
        ready = "/healthz" if ha and is_master else "/readyz"
        assert c["readinessProbe"]["httpGet"]["path"] == ready


@pytest.mark.parametrize("case", CASES)
def test_hugepages_and_rdma_appear_only_where_asked(case):
    c = container(node_workload(render(case)))
    resources = {**c["resources"].get("requests", {}), **c["resources"].get("limits", {})}
    args = flags(c)
    wanted = case == "rdma-hugepages"
    assert ("--hugepages" in args) == ("hugepages-2Mi" in resources) == wanted
    assert ("rdma/hca_shared_devices_a" in resources) == wanted
    assert ("--no-rdma" in args) != wanted
    if wanted:
        assert args["--rdma-device"] == ["mlx5_0"]
        # Kubernetes wants huge pages and extended resources requested as much as limited.
        for name in ("hugepages-2Mi", "rdma/hca_shared_devices_a"):
            assert c["resources"]["requests"][name] == c["resources"]["limits"][name]


@pytest.mark.parametrize("case", CASES)
def test_memory_covers_the_segments(case):
    """The segments are populated at start and count against the container (memfds, or huge
    pages): a limit below their sum would have the node OOM-killed as it mounts."""
    from kvpool.common.config import parse_size
    c = container(node_workload(render(case)))
    segments = sum(parse_size(s) for s in flags(c)["--segment-size"])
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    if "--hugepages" in flags(c):
        assert kubernetes_bytes(limits["hugepages-2Mi"]) >= segments
    else:
        assert kubernetes_bytes(requests["memory"]) >= segments + 256 * 2**20
        assert kubernetes_bytes(limits["memory"]) >= kubernetes_bytes(requests["memory"])


def test_a_single_master_is_replaced_never_doubled():
    docs = render("default")
    master = one(docs, "Deployment", MASTER)
    assert master["spec"]["replicas"] == 1
    assert master["spec"]["strategy"] == {"type": "Recreate"}
    assert "--ha" not in flags(container(master))
    assert not find(docs, "PodDisruptionBudget", MASTER)   # it would block every drain
    # A restarted master is ready once the nodes re-announced through this very Service.
    service = one(docs, "Service", MASTER)
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        "grpc": (50051, "grpc"), "lookup": (50052, "lookup"), "metrics": (9400, "metrics")}


def test_ha_masters_elect_a_leader_on_etcd():
    values = profile_values("ha")
    docs = render("ha")
    master = one(docs, "Deployment", MASTER)
    args = flags(container(master))
    url = "etcd://" + ",".join(values["etcd"]["endpoints"]) + f"/{RELEASE}-kvpool"
    assert args["--ha"] == [url]
    assert args["--advertise"] == ["$(POD_IP):50051"]
    assert master["spec"]["replicas"] == 3
    assert master["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert one(docs, "PodDisruptionBudget", MASTER)["spec"]["maxUnavailable"] == 1
    # The nodes follow the leader through the same election.
    assert flags(container(node_workload(docs)))["--master"] == [url]


def test_the_default_election_name_is_one_kvpool_takes(helm):
    """It is the release's name, which may hold dots; kvpool's election names may not."""
    from kvpool.common.addresses import parse_etcd_url
    docs = render_values(helm, profile_values("ha"), release="kv.prod")
    [url] = flags(container(one(docs, "Deployment", "kv.prod-kvpool-master")))["--ha"]
    assert parse_etcd_url(url).cluster == "kv-prod-kvpool"


def test_disk_tier_lives_on_a_claim_per_node():
    values = profile_values("disk-tier")["storeNode"]["disk"]
    node = node_workload(render("disk-tier"))
    c = container(node)
    args = flags(c)
    assert args["--disk-size"] == [values["size"]]
    [claim] = node["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == values["volumeSize"]
    assert claim["spec"]["storageClassName"] == values["storageClassName"]
    [mount] = [m for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert args["--disk-path"] == [mount["mountPath"]]
    assert "--disk-path" not in flags(container(node_workload(render("default"))))


def test_daemonset_keeps_its_disk_tier_on_the_host():
    node = node_workload(render("daemonset"))
    assert node["kind"] == "DaemonSet"
    [disk] = [v for v in node["spec"]["template"]["spec"]["volumes"] if v["name"] == "disk"]
    # Not DirectoryOrCreate: a directory Kubernetes creates is root's, unwritable by uid 10001.
    assert disk["hostPath"] == {"path": "/var/lib/kvpool", "type": "Directory"}


@pytest.mark.parametrize("case", CASES)
def test_network_policy_admits_clients_kvpool_and_prometheus_only(case):
    docs = render(case)
    expected = {MASTER: ({50051, 50052}, 9400), NODE: ({50060}, 9401)}
    for name, (serving, metrics) in expected.items():
        policy = one(docs, "NetworkPolicy", name)
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        [to_serving, to_metrics] = policy["spec"]["ingress"]
        assert {p["port"] for p in to_serving["ports"]} == serving
        assert [p["port"] for p in to_metrics["ports"]] == [metrics]
        clients, own = to_serving["from"][:2]
        assert clients["podSelector"] == {"matchLabels": {"kvpool.io/client": "true"}}
        assert own["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE
        assert to_metrics["from"][0]["namespaceSelector"] == {
            "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
        # The policy selects the very pods of its component.
        [workload] = [w for w in workloads(docs) if w["metadata"]["name"] == name]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= \
            workload["spec"]["template"]["metadata"]["labels"].items()


def test_monitoring_objects():
    """The operator's kinds, which no Kubernetes schema covers: the ServiceMonitor selects
    both Services, scrapes their metrics port, and names the jobs the alert rules use; the
    PrometheusRule carries deploy/prometheus/kvpool-alerts.yml's rules as they are."""
    docs = render("monitoring")
    monitor = one(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    [endpoint] = spec["endpoints"]
    jobs = set()
    for service in find(docs, "Service"):
        labels = service["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        assert all(e["key"] in labels for e in spec["selector"]["matchExpressions"])
        assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
        jobs.add(labels[spec["jobLabel"]])
    alert_jobs = set(re.findall(r'job="([^"]+)"', ALERTS.read_text()))
    assert jobs == {"kvpool-master", "kvpool-store-node"} and alert_jobs <= jobs
    rule = one(docs, "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]
    assert not find(render("default"), "ServiceMonitor")
    assert not find(render("default"), "PrometheusRule")


CREDENTIALS = "/var/run/secrets/kvpool"
PREFIX = f"{RELEASE}-kvpool-credentials"
JOB = PREFIX   # the hook Job, its ServiceAccount, Role and RoleBinding


def pod_specs(docs: list[dict]) -> dict[str, dict]:
    """Every pod template of the render (workloads and Jobs), by its object's name."""
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs
            if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")}


def every_container(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


def credentials_file(c: dict) -> str | None:
    """The credentials file a kvpool container names, by flag or KVPOOL_CREDENTIALS."""
    for arg in c["args"]:
        if arg.startswith("--credentials="):
            return arg.partition("=")[2]
    return next((e["value"] for e in c.get("env", []) if e["name"] == "KVPOOL_CREDENTIALS"),
                None)


def secret_mounted_at(spec: dict, c: dict, path: str) -> str:
    """The Secret whose volume ``c`` mounts at the directory of ``path``."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    [mount] = [m for m in c["volumeMounts"] if m["mountPath"] == path.rsplit("/", 1)[0]]
    assert mount.get("readOnly") is True
    return volumes[mount["name"]]["secret"]["secretName"]


def secret_volumes(spec: dict, c: dict) -> set[str]:
    """The Secrets ``c`` mounts (a StatefulSet's claims are no volumes of the pod spec)."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    return {volumes[m["name"]]["secret"]["secretName"] for m in c.get("volumeMounts", [])
            if "secret" in volumes.get(m["name"], {})}


@pytest.mark.parametrize("case", CASES)
def test_every_kvpool_process_has_credentials_from_its_own_secret(case):
    """Secure by default: no --insecure anywhere; each master and store node names a
    credentials file in the Secret of its component, mounted read-only; nothing else."""
    docs = render(case)
    for workload in workloads(docs):
        spec = workload["spec"]["template"]["spec"]
        c = container(workload)
        assert "--insecure" not in c["args"]
        path = credentials_file(c)
        assert path and path.startswith(CREDENTIALS + "/"), c["args"]
        component = {MASTER: "master", NODE: "store-node"}[workload["metadata"]["name"]]
        assert secret_mounted_at(spec, c, path) == f"{PREFIX}-{component}"
        assert secret_volumes(spec, c) == {f"{PREFIX}-{component}"}
        if component == "master":
            assert path == f"{CREDENTIALS}/master-master.yaml"
        else:   # the node's own file, named by its node id
            [node_id] = flags(c)["--node-id"]
            assert path == f"{CREDENTIALS}/node-{node_id}.yaml"
    assert not any("--insecure" in c["args"] for spec in pod_specs(docs).values()
                   for c in every_container(spec))


@pytest.mark.parametrize("case", CASES)
def test_the_ca_key_is_mounted_only_by_the_issuing_job(case):
    docs = render(case)
    mounting = {(name, c["name"]) for name, spec in pod_specs(docs).items()
                for c in every_container(spec) if f"{PREFIX}-ca" in secret_volumes(spec, c)}
    assert mounting == {(JOB, "issue")}
    # No other pod can even name the CA's Secret in a volume.
    for name, spec in pod_specs(docs).items():
        named = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        assert (f"{PREFIX}-ca" in named) == (name == JOB)


def _materialize(secret: dict, directory: Path) -> Path:
    """A Secret as Kubernetes mounts it: one file per key."""
    import base64
    directory.mkdir(parents=True)
    for key, value in secret["data"].items():
        (directory / key).write_bytes(base64.b64decode(value))
    return directory


def _run_job(job: dict, work: Path, ca_secret: Path) -> dict[str, dict]:
    """The Job's `kvpool credentials` container, run here with its paths moved under
    ``work`` and ``ca_secret``; the Secrets it would apply, by name."""
    from kvpool.tools.cli import main
    spec = job["spec"]["template"]["spec"]
    [issue] = spec["initContainers"]
    mounts = {m["mountPath"]: m["name"] for m in issue["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[mounts["/work"]]["emptyDir"]["medium"] == "Memory"
    ca_mount = next(p for p, n in mounts.items() if "secret" in volumes[n])
    assert volumes[mounts[ca_mount]]["secret"] == {
        "secretName": f"{PREFIX}-ca", "optional": True, "defaultMode": 0o440}
    argv = [a.replace(ca_mount, str(ca_secret)).replace("/work", str(work))
            for a in issue["args"]]
    assert main(argv) == 0
    [apply] = spec["containers"]
    manifest = apply["args"][apply["args"].index("-f") + 1]
    assert manifest.startswith("/work/")
    text = (work / manifest.removeprefix("/work/")).read_text()
    return {s["metadata"]["name"]: s for s in yaml.safe_load(text)["items"]}


@pytest.mark.parametrize("case", ["default", "ha", "daemonset"])
def test_the_job_issues_what_every_pod_loads(kubernetes_validate, case, tmp_path):
    """The hook Job's own arguments, run for real: its Secrets are valid, only the CA's holds
    the CA key, its Role may write exactly them, and the credentials file each master and store
    node pod names loads from its mounted Secret as that very identity; a second run (an
    upgrade) keeps the CA."""
    from kvpool.common import security
    docs = render(case)
    job = one(docs, "Job", JOB)
    annotations = job["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == JOB
    secrets = _run_job(job, tmp_path / "work", tmp_path / "no-ca-yet")
    for secret in secrets.values():
        kubernetes_validate.validate(secret, KUBERNETES_VERSIONS[-1], strict=True)
        assert secret["metadata"]["namespace"] == NAMESPACE
        assert secret["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
        assert ("ca.key" in secret["data"]) == (secret["metadata"]["name"] == f"{PREFIX}-ca")
    assert set(secrets) == {f"{PREFIX}-{s}" for s in
                            ("ca", "master", "store-node", "client-default", "admin-admin")}
    [_, named] = one(docs, "Role", JOB)["rules"]
    assert set(named["resourceNames"]) == set(secrets)
    binding = one(docs, "RoleBinding", JOB)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": JOB,
                                    "namespace": NAMESPACE}]

    # Each pod's credentials, as its container will load them.
    mounted = {name: _materialize(s, tmp_path / "mounted" / name) for name, s in secrets.items()}
    node = node_workload(docs)
    if node["kind"] == "StatefulSet":
        node_ids = [f"{NODE}-{i}" for i in range(node["spec"]["replicas"])]
    else:
        node_ids = profile_values(case)["security"]["nodeNames"]
    for workload in workloads(docs):
        c = container(workload)
        spec = workload["spec"]["template"]["spec"]
        path = credentials_file(c)
        secret = secret_mounted_at(spec, c, path)
        pods = node_ids if workload is node else [None]
        for pod in pods:
            name = re.sub(r"\$\((POD_NAME|NODE_NAME)\)", pod or "", path.rsplit("/", 1)[1])
            creds = security.load(mounted[secret] / name)
            expected = ("node", pod) if pod else ("master", "master")
            assert (creds.identity.role, creds.identity.name) == expected
    client = security.load(mounted[f"{PREFIX}-client-default"] / "client-default.yaml")
    assert client.identity == security.Identity("client", "default")

    from cryptography import x509
    master_pem = base64_file(secrets[f"{PREFIX}-master"], "master-master.pem")
    san = x509.load_pem_x509_certificate(master_pem).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert security.MASTER_NAME in san and f"{MASTER}.{NAMESPACE}.svc" in san

    # An upgrade: the CA's Secret now exists and is mounted; the CA stays, the rest renews.
    again = _run_job(job, tmp_path / "work2", mounted[f"{PREFIX}-ca"])
    assert again[f"{PREFIX}-ca"]["data"] == secrets[f"{PREFIX}-ca"]["data"]
    assert base64_file(again[f"{PREFIX}-master"], "master-master.pem") != master_pem


def base64_file(secret: dict, key: str) -> bytes:
    import base64
    return base64.b64decode(secret["data"][key])


def test_the_job_runs_as_the_pods_do():
    spec = pod_specs(render("default"))[JOB]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["restartPolicy"] == "Never"
    for c in every_container(spec):
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
    # kubectl needs the token of the Job's own ServiceAccount (a hook, like the Job); the
    # kvpool pods get none.
    assert spec["serviceAccountName"] == JOB and spec["automountServiceAccountToken"] is True
    assert one(render("default"), "ServiceAccount", JOB)["metadata"]["annotations"][
        "helm.sh/hook"] == "pre-install,pre-upgrade"
    for workload in workloads(render("default")):
        assert workload["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def _render_all(helm, values: dict) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)


def test_security_off_runs_insecure_and_warns(helm):
    out = _render_all(helm, {"security": {"enabled": False}})
    docs = [doc for path, text in out.items() if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]
    master = container(one(docs, "Deployment", MASTER))
    assert "--insecure" in master["args"] and credentials_file(master) is None
    assert credentials_file(container(node_workload(docs))) is None
    assert not find(docs, "Job") and not find(docs, "Role")
    for spec in pod_specs(docs).values():
        assert not any("secret" in v for v in spec["volumes"])
    notes = next(text for path, text in out.items() if path.endswith("NOTES.txt"))
    assert "WARNING: security.enabled is false" in notes and "--insecure" in notes
    default_notes = next(text for path, text in _render_all(helm, {}).items()
                         if path.endswith("NOTES.txt"))
    assert "WARNING" not in default_notes and "KVPOOL_CREDENTIALS" in default_notes


def test_an_existing_secret_is_mounted_and_no_job_runs(helm):
    docs = render_values(helm, {"security": {"existingSecret": "ops-kvpool"}})
    assert not find(docs, "Job") and not find(docs, "Role")
    for workload in workloads(docs):
        spec = workload["spec"]["template"]["spec"]
        c = container(workload)
        component = "master" if workload["metadata"]["name"] == MASTER else "store-node"
        assert secret_mounted_at(spec, c, credentials_file(c)) == f"ops-kvpool-{component}"


CERT_MANAGER = {"security": {"nodeCertificates": "certManager",
                              "certManager": {"requireApi": False}}}


def test_cert_manager_gives_each_store_node_pod_a_key_of_its_own(helm, kubernetes_validate,
                                                                  tmp_path):
    """security.nodeCertificates certManager: no store-node pod mounts a Secret (the default's
    holds every node's key); each gets a csi.cert-manager.io volume asking for OU=node and
    CN=its own pod name (the node id it runs as), from the chart's CA Issuer over the CA's
    Secret, readable by the kvpool user, and loads it as a credentials directory. The hook Job
    issues no node certificate, and the CA Secret it writes is one that Issuer reads (tls.crt,
    tls.key: the CA's pair). tests/integration/test_auth.py starts a node from such a
    directory."""
    docs = render_values(helm, merged(OFFLINE, CERT_MANAGER))
    node = node_workload(docs)
    spec, c = node["spec"]["template"]["spec"], container(node)
    assert not any("secret" in v for v in spec["volumes"])
    [volume] = [v for v in spec["volumes"] if v["name"] == "credentials"]
    [mount] = [m for m in c["volumeMounts"] if m["name"] == "credentials"]
    assert credentials_file(c) == mount["mountPath"] == CREDENTIALS and mount["readOnly"]
    assert flags(c)["--node-id"] == ["$(POD_NAME)"]
    issuer = one(docs, "Issuer")
    assert issuer["apiVersion"] == "cert-manager.io/v1"
    assert issuer["spec"] == {"ca": {"secretName": f"{PREFIX}-ca"}}
    assert volume["csi"]["driver"] == "csi.cert-manager.io" and volume["csi"]["readOnly"]
    attributes = {k.removeprefix("csi.cert-manager.io/"): v
                  for k, v in volume["csi"]["volumeAttributes"].items()}
    assert attributes["common-name"] == "${POD_NAME}"
    assert attributes["organizationalunits"] == "node"
    assert (attributes["issuer-name"], attributes["issuer-kind"], attributes["issuer-group"]) \
        == (issuer["metadata"]["name"], "Issuer", "cert-manager.io")
    assert attributes["fs-group"] == str(spec["securityContext"]["fsGroup"])
    assert attributes["duration"] == f"{365 * 24}h"
    for doc in docs:   # cert-manager's kinds have no schema there: checked field by field above
        if doc["kind"] not in {"Issuer", *OPERATOR_KINDS}:
            kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[-1], strict=True)

    job = one(docs, "Job", JOB)
    issue = job["spec"]["template"]["spec"]["initContainers"][0]
    assert not any(a.startswith("--node") for a in issue["args"])
    secrets = _run_job(job, tmp_path / "work", tmp_path / "no-ca-yet")
    assert set(secrets) == {f"{PREFIX}-{s}" for s in
                            ("ca", "master", "client-default", "admin-admin")}
    [_, named] = one(docs, "Role", JOB)["rules"]
    assert set(named["resourceNames"]) == set(secrets)
    ca = secrets[f"{PREFIX}-ca"]["data"]
    assert (ca["tls.crt"], ca["tls.key"]) == (ca["ca.pem"], ca["ca.key"])

    # An issuer of the operator's own (a ClusterIssuer, say): named, and the chart makes none.
    theirs = render_values(helm, merged(OFFLINE, CERT_MANAGER, {"security": {"certManager": {
        "issuer": {"name": "ops-ca", "kind": "ClusterIssuer"}}}}))
    assert not find(theirs, "Issuer")
    [volume] = [v for v in node_workload(theirs)["spec"]["template"]["spec"]["volumes"]
                if v["name"] == "credentials"]
    attributes = volume["csi"]["volumeAttributes"]
    assert attributes["csi.cert-manager.io/issuer-name"] == "ops-ca"
    assert attributes["csi.cert-manager.io/issuer-kind"] == "ClusterIssuer"


BROKEN = {
    "standby masters without etcd": (
        {"master": {"replicas": 3}}, "RenderError", "set etcd.endpoints"),
    "an etcd URL where HOST:PORT goes": (
        {"master": {"replicas": 3}, "etcd": {"endpoints": ["etcd://etcd:2379"]}},
        "RenderError", "is not HOST:PORT"),
    "hugepages not asked of Kubernetes": (
        {"storeNode": {"hugepages": {"enabled": True}}}, "RenderError",
        "add storeNode.resources.limits.hugepages-2Mi"),
    "a ServiceMonitor for a cluster without the operator": (
        {"monitoring": {"serviceMonitor": {"enabled": True}}}, "RenderError",
        "does not serve monitoring.coreos.com/v1"),
    "a hostPath for a StatefulSet": (
        {"storeNode": {"disk": {"enabled": True, "hostPath": "/srv"}}}, "RenderError",
        "storeNode.disk.hostPath is for storeNode.kind DaemonSet"),
    "an unknown kind of store node": (
        {"storeNode": {"kind": "Deployment"}}, "ValuesError", "StatefulSet"),
    "a DaemonSet's node certificates without its hosts' names": (
        {"storeNode": {"kind": "DaemonSet"}}, "RenderError", "list them in security.nodeNames"),
    "per-pod node certificates for a DaemonSet": (
        merged(CERT_MANAGER, {"storeNode": {"kind": "DaemonSet"}}), "RenderError",
        "use storeNode.kind StatefulSet"),
    "per-pod node certificates without cert-manager": (
        {"security": {"nodeCertificates": "certManager"}}, "RenderError",
        "install cert-manager and its csi-driver"),
    "a node certificate mode the chart does not know": (
        {"security": {"nodeCertificates": "spiffe"}}, "ValuesError", "nodeCertificates"),
    "a Secret name Kubernetes refuses": (
        {"security": {"clients": ["Tenant_A"]}}, "ValuesError", "clients"),
    "TLS on the data port without certificates": (
        {"security": {"enabled": False, "dataTls": True}}, "RenderError",
        "set security.enabled: true"),
    "a misspelt key": (
        {"master": {"replcas": 3}}, "ValuesError", "replcas"),
    "a Kubernetes quantity where kvpool wants its size": (
        {"storeNode": {"segmentSizes": ["4Gi"]}}, "ValuesError", "segmentSizes"),
}


@pytest.mark.parametrize("name", BROKEN)
def test_broken_values_are_refused_with_what_to_do(helm, name):
    values, error, message = BROKEN[name]
    with pytest.raises(getattr(helm, f"Helm{error}")) as caught:
        render_values(helm, values)
    assert message in str(caught.value)


def test_the_refusals_above_are_values_not_the_chart(helm):
    """Each broken value alone breaks the render: with the value fixed, the same render works
    (so the tests above cannot pass on a chart that fails to render at all)."""
    assert render_values(helm, {"master": {"replicas": 3},
                                "etcd": {"endpoints": ["etcd:2379"]}})
    assert render_values(helm, {"storeNode": {"hugepages": {"enabled": True}, "resources": {
        "limits": {"hugepages-2Mi": "4Gi", "memory": "1Gi"}}}})
    assert render_values(helm, {"monitoring": {"serviceMonitor": {"enabled": True},
                                               "requireApi": False}})
    assert render_values(helm, {"storeNode": {"kind": "DaemonSet"},
                                "security": {"nodeNames": ["gpu-host-1"]}})
    assert render_values(helm, {"storeNode": {"kind": "DaemonSet"},
                                "security": {"existingSecret": "ops-kvpool"}})
    assert render_values(helm, {"security": {"clients": ["tenant-a"]}})
