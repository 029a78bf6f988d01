"""deploy/: what can be checked on this machine, with the real tools.

* promtool checks the rules and the Prometheus config, and runs the alert unit tests;
* a real Prometheus (Debian package ``prometheus``) scrapes a real daemon on 127.0.0.1 with the
  shipped scrape config and alert rules: the fold counter comes back through PromQL, every rule
  evaluates cleanly, every dashboard query runs, and a gate rejection fires the rollback alert;
* every metric named by the dashboard and the rules exists in the daemon's exposition;
* compose, k8s, the Dockerfile, the container config and the systemd unit agree on image, ports
  and paths; ``systemd-analyze verify`` checks the unit where it exists;
* the Dockerfile's HEALTHCHECK command runs against a live daemon, and the compose MLflow command
  runs as a real ``mlflow server`` that accepts the daemon's Host header.

Docker itself cannot run here (no engine), so images are not built and compose is not started.
``promtool``/``prometheus``/``systemd-analyze``/``kubectl`` missing: a failure under CI (.ci/run
installs prometheus), a skip on a developer machine.
"""

from __future__ import annotations

import configparser
import contextlib
import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import save_tensors, stop_process_group
from tests.test_daemon import Daemon, free_port, scaled_expert, tiny_base

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
IMAGE = "mergestream:latest"
METRICS_PORT = 9108
CONFIG_PATH = "/etc/mergestream/config.yaml"
STATE_DIR = "/data/state"
INBOX = "/data/inbox"
BASE = "/models/base"

REQUIRED_ALERTS = {"MergestreamDown", "MergestreamCandidateRejected", "MergestreamGeneralKnowledgeLow",
                   "MergestreamQueueStuck", "MergestreamSourceErrors", "MergestreamTrackingErrors"}


# -- helpers ----------------------------------------------------------------------------------------
def tool(name: str) -> str:
    """Path of a command-line tool; missing: fail under CI, skip elsewhere."""
    path = shutil.which(name)
    if path:
        return path
    if os.environ.get("CI"):
        pytest.fail(f"{name} is not installed; .ci/run installs it (Debian package "
                    f"{'prometheus' if name in ('promtool', 'prometheus') else name})")
    pytest.skip(f"{name} not installed (CI installs it)")


def run(*cmd: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], check=False, capture_output=True, text=True, timeout=120, **kw)


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


def interpolate(value, env: dict[str, str] | None = None):
    """Compose-style ${VAR:-default} / ${VAR} interpolation with an (empty by default) environment."""
    env = env or {}
    if isinstance(value, str):
        def sub(m: re.Match) -> str:
            name, default = m.group(1), m.group(3)
            return env.get(name) or (default if default is not None else "")
        return re.sub(r"\$\{(\w+)(:-([^}]*))?\}", sub, value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def http_json(url: str, timeout: float = 5) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


def wait_http_ok(proc: subprocess.Popen, url: str, log: Path, timeout: float, msg: str) -> None:
    """Wait until ``url`` answers 200; fail at once (with the log's tail) if ``proc`` exits."""
    def ok():
        if proc.poll() is not None:
            raise AssertionError(f"{msg}: the process exited: {log.read_text()[-3000:]}")
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    wait_for(ok, timeout, msg)


def wait_for(cond, timeout: float, msg: str, every: float = 0.25):
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        try:
            last = cond()
        except (OSError, urllib.error.URLError, ValueError, KeyError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(every)
    raise AssertionError(f"{msg} (last: {last!r})")


# -- the Dockerfile ---------------------------------------------------------------------------------
def dockerfile_instructions(path: Path = DEPLOY / "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, continuation lines joined."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, "Dockerfile ends inside a continued line"
    return out


def exec_form(args: str) -> list[str]:
    return json.loads(args)


def dockerignore_allows(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; '!' re-includes; a folder match covers its files."""
    included = True
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pat in patterns:
        neg = pat.startswith("!")
        p = pat[1:] if neg else pat
        p = p.strip("/")
        candidates = [p, p.replace("**/", "")] if p.startswith("**/") else [p]
        if any(fnmatch.fnmatchcase(pre, c) for pre in prefixes for c in candidates):
            included = neg
    return included


def test_dockerfile_builds_what_the_issue_asks():
    ins = dockerfile_instructions()
    args = {}
    for word, rest in ins:
        if word == "ARG" and "=" in rest:
            k, _, v = rest.partition("=")
            args.setdefault(k, v)
    assert args["VARIANT"] == "cpu"
    assert args["PYTHON_IMAGE"] == "python:3.11-slim"
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:")
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    froms = [rest for word, rest in ins if word == "FROM"]
    assert "${PYTHON_IMAGE} AS base-cpu" in froms and "${CUDA_IMAGE} AS base-cuda" in froms
    assert froms[-1] == "base-${VARIANT}", "the runtime stage is chosen by VARIANT"
    runs = " ".join(rest for word, rest in ins if word == "RUN")
    assert '--index-url "$TORCH_INDEX_URL" -c constraints.txt torch' in runs  # CPU wheel, same pin
    assert "pip install -c constraints.txt ." in runs
    # non-root user, volumes, port, health check, entrypoint
    user = [rest for word, rest in ins if word == "USER"][-1]
    assert user.split(":")[0] not in ("0", "root")
    volumes = set(exec_form([rest for word, rest in ins if word == "VOLUME"][-1]))
    assert volumes == {STATE_DIR, INBOX}
    assert [rest for word, rest in ins if word == "EXPOSE"] == [str(METRICS_PORT)]
    hc = [rest for word, rest in ins if word == "HEALTHCHECK"]
    assert len(hc) == 1 and "/healthz" in hc[0]
    entry = exec_form([rest for word, rest in ins if word == "ENTRYPOINT"][-1])
    assert entry == ["mergestream", "run", "--config", CONFIG_PATH]
    copies = [rest.split() for word, rest in ins if word == "COPY"]
    assert ["deploy/config.yaml", CONFIG_PATH] in copies
    # every COPY source exists in the build context (the repository root) and passes the ignore file
    patterns = [ln.strip() for ln in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    for c in copies:
        if c[0].startswith("--from="):
            continue
        for src in c[:-1]:
            assert (ROOT / src).exists(), f"COPY source {src} missing"
            assert dockerignore_allows(src, patterns), f"{src} excluded by Dockerfile.dockerignore"
    # the project's build needs the readme pyproject names; the caches stay out
    readme = re.search(r'^readme\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert any(readme in c[:-1] for c in copies)
    for junk in (".venv/bin/python", ".git/HEAD", "tests/test_deploy.py", "mergestream/__pycache__/x.pyc",
                 "deploy/models/base/model.safetensors"):
        assert not dockerignore_allows(junk, patterns), junk
    # the entrypoint is a real command of this project
    helped = run(sys.executable, "-m", "mergestream.cli", entry[1], "--help")
    assert helped.returncode == 0 and entry[2] in helped.stdout


def test_container_config_validates_and_env_overrides(monkeypatch):
    from mergestream.config import load_config

    cfg = load_config(DEPLOY / "config.yaml")
    assert str(cfg.base) == BASE and str(cfg.inbox) == INBOX and str(cfg.state_dir) == STATE_DIR
    assert cfg.metrics.enabled and cfg.metrics.host == "0.0.0.0" and cfg.metrics.port == METRICS_PORT
    assert cfg.tracking_uri() == "http://mlflow:5000"
    monkeypatch.setenv("MERGESTREAM_MLFLOW__TRACKING_URI", "http://tracking.example:5001")
    cfg = load_config(DEPLOY / "config.yaml")
    assert cfg.tracking_uri() == "http://tracking.example:5001"
    assert cfg.mlflow.experiment == "mergestream"  # the rest of the section is kept


# -- compose ----------------------------------------------------------------------------------------
def compose() -> dict:
    return interpolate(load_yaml(DEPLOY / "compose.yaml"))


def _bind(mount: str) -> tuple[str, str, str]:
    src, dst, *mode = mount.split(":")
    return src, dst, (mode[0] if mode else "rw")


def test_compose_matches_dockerfile_and_config():
    from mergestream.config import load_config

    cfg = load_config(DEPLOY / "config.yaml")
    doc = compose()
    raw = load_yaml(DEPLOY / "compose.yaml")
    svc = doc["services"]
    assert {n for n, s in svc.items() if not s.get("profiles")} == {"mergestream", "mlflow", "prometheus", "grafana"}
    d = svc["mergestream"]
    assert d["image"] == IMAGE
    assert (DEPLOY / d["build"]["context"]).resolve() == ROOT
    assert (DEPLOY / d["build"]["context"] / d["build"]["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    # every published port is on 127.0.0.1 by default
    for name, s in svc.items():
        for p in s.get("ports", []):
            host, _, _ = str(p).partition(":")
            assert host == "127.0.0.1", f"{name} publishes {p}"
    assert f"127.0.0.1:{METRICS_PORT}:{cfg.metrics.port}" in d["ports"]
    mounts = {dst: (src, mode) for src, dst, mode in map(_bind, d["volumes"])}
    assert mounts[CONFIG_PATH] == ("./config.yaml", "ro")
    assert mounts[str(cfg.base)][1] == "ro"
    assert mounts[str(cfg.state_dir)][0] in doc["volumes"]  # a named volume
    assert str(cfg.inbox) in mounts
    # the daemon reaches MLflow by its service name and port
    uri = urllib.parse.urlsplit(d["environment"]["MERGESTREAM_MLFLOW__TRACKING_URI"])
    assert d["environment"]["MERGESTREAM_MLFLOW__TRACKING_URI"] == cfg.tracking_uri()
    m = svc["mlflow"]
    cmd = m["command"]
    opt = {cmd[i]: cmd[i + 1] for i in range(2, len(cmd) - 1)
           if cmd[i].startswith("--") and not cmd[i + 1].startswith("--")}
    assert cmd[:2] == ["mlflow", "server"]
    assert uri.hostname == "mlflow" and str(uri.port) == opt["--port"]
    assert opt["--workers"] == "1" and opt["--host"] == "0.0.0.0"
    assert opt["--backend-store-uri"].startswith(("sqlite:", "postgresql"))
    assert "--serve-artifacts" in cmd
    art_mounts = {dst: src for src, dst, _ in map(_bind, m["volumes"])}
    assert art_mounts[opt["--artifacts-destination"]] in doc["volumes"]  # an artifacts volume
    pin = re.search(r"^mlflow==(\S+)", (ROOT / "constraints.txt").read_text(), re.MULTILINE).group(1)
    assert m["image"].endswith(f":v{pin}"), "MLflow server and client versions differ"
    assert "depends_on" in d and d["depends_on"]["mlflow"]["condition"] == "service_healthy"
    # Prometheus gets deploy/prometheus, whose config scrapes the daemon's service and port
    p = svc["prometheus"]
    pm = {dst: src for src, dst, _ in map(_bind, p["volumes"])}
    conf_file = next(a.split("=", 1)[1] for a in p["command"] if a.startswith("--config.file="))
    conf_dir, conf_name = conf_file.rsplit("/", 1)
    assert (DEPLOY / pm[conf_dir]).resolve() == DEPLOY / "prometheus" and (DEPLOY / "prometheus" / conf_name).is_file()
    prom = load_yaml(DEPLOY / "prometheus" / conf_name)
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "mergestream")
    assert job["static_configs"][0]["targets"] == [f"mergestream:{cfg.metrics.port}"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    # Grafana gets the provisioning folder and the dashboard where the provider looks
    g = svc["grafana"]
    gm = {dst: src for src, dst, _ in map(_bind, g["volumes"])}
    assert (DEPLOY / gm["/etc/grafana/provisioning"]).resolve() == DEPLOY / "grafana" / "provisioning"
    provider = load_yaml(DEPLOY / "grafana/provisioning/dashboards/mergestream.yml")["providers"][0]
    dash_mount = f"{provider['options']['path']}/mergestream.json"
    assert (DEPLOY / gm[dash_mount]).resolve() == DEPLOY / "grafana" / "mergestream.json"
    ds = load_yaml(DEPLOY / "grafana/provisioning/datasources/prometheus.yml")["datasources"][0]
    assert ds["type"] == "prometheus" and ds["isDefault"]
    assert ds["url"] == "http://prometheus:9090" and "127.0.0.1:9090:9090" in p["ports"]
    # every bind-mount source that the repository ships exists; named volumes are declared
    for name, s in svc.items():
        for v in s.get("volumes", []):
            src = _bind(v)[0]
            if src.startswith("."):
                if src in ("./models/base", "./inbox"):  # the user's base and inbox
                    continue
                assert (DEPLOY / src).exists(), f"{name}: {src} missing"
            else:
                assert src in doc["volumes"], f"{name}: volume {src} not declared"
    # BIND_ADDRESS moves every port together
    moved = interpolate(raw, {"BIND_ADDRESS": "0.0.0.0"})
    assert all(str(p).startswith("0.0.0.0:") for s in moved["services"].values() for p in s.get("ports", []))


# -- Kubernetes ------------------------------------------------------------------------------------
def k8s_docs() -> dict[tuple[str, str], dict]:
    kust = load_yaml(DEPLOY / "k8s" / "kustomization.yaml")
    docs = {}
    for res in kust["resources"]:
        for doc in yaml.safe_load_all((DEPLOY / "k8s" / res).read_text()):
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def test_k8s_base_matches_dockerfile_and_config(tmp_path):
    from mergestream.config import load_config

    cfg = load_config(DEPLOY / "config.yaml")
    kust = load_yaml(DEPLOY / "k8s" / "kustomization.yaml")
    docs = k8s_docs()
    # the ConfigMap is generated from a copy of deploy/config.yaml
    gen = kust["configMapGenerator"][0]
    assert gen["files"] == ["config.yaml"]
    assert (DEPLOY / "k8s" / "config.yaml").read_text() == (DEPLOY / "config.yaml").read_text(), \
        "deploy/k8s/config.yaml must be a copy of deploy/config.yaml"
    dep = docs[("Deployment", "mergestream")]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    pod = dep["spec"]["template"]["spec"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    (c,) = pod["containers"]
    name, tag = c["image"].split(":")
    images = {i["name"]: i for i in kust.get("images", [])}
    assert f"{name}:{images.get(name, {}).get('newTag', tag)}" == IMAGE
    assert all(ic["image"] == c["image"] for ic in pod.get("initContainers", []))
    assert "command" not in c and "args" not in c  # the image's entrypoint runs
    (port,) = c["ports"]
    assert port["containerPort"] == cfg.metrics.port and port["name"] == "metrics"
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    # user = the Dockerfile's
    user = [rest for w, rest in dockerfile_instructions() if w == "USER"][-1].split(":")[0]
    assert pod["securityContext"]["runAsNonRoot"] and str(pod["securityContext"]["runAsUser"]) == user
    # mounts: the config where the entrypoint reads it, state, inbox, and the base's folder
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    cm = mounts[str(Path(CONFIG_PATH).parent)]
    assert vols[cm["name"]]["configMap"]["name"] == gen["name"] and cm.get("readOnly")
    for path in (str(cfg.state_dir), str(cfg.inbox)):
        pvc = vols[mounts[path]["name"]]["persistentVolumeClaim"]["claimName"]
        assert ("PersistentVolumeClaim", pvc) in docs
    assert any(str(cfg.base).startswith(p + "/") and m.get("readOnly") for p, m in mounts.items())
    # the init container lays out the volume's sub-folders and waits for the base: run its script
    (init,) = pod["initContainers"]
    (im,) = init["volumeMounts"]
    assert vols[im["name"]] == vols[mounts[str(cfg.state_dir)]["name"]]
    script = init["command"][-1]
    base_mount = next(p for p in mounts if str(cfg.base).startswith(p + "/"))
    base_on_volume = f"{im['mountPath']}/{mounts[base_mount]['subPath']}{str(cfg.base)[len(base_mount):]}"
    vol = tmp_path / "volume"
    (vol / mounts[base_mount]["subPath"]).mkdir(parents=True)
    (vol / base_on_volume[len(im["mountPath"]) + 1:]).write_text("")  # the base is already there
    proc = run(*init["command"][:-1], script.replace(im["mountPath"], str(vol)))
    assert proc.returncode == 0, proc.stderr
    for m in c["volumeMounts"]:
        if m["name"] == im["name"]:
            assert (vol / m["subPath"]).is_dir(), f"init container does not create {m['subPath']}"
    # Service, ServiceMonitor
    svc = docs[("Service", "mergestream")]
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    (sp,) = svc["spec"]["ports"]
    assert sp["port"] == cfg.metrics.port and sp["targetPort"] == "metrics" and sp["name"] == "metrics"
    sm = docs[("ServiceMonitor", "mergestream")]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["spec"]["selector"].items()
    assert sm["spec"]["endpoints"][0]["port"] == "metrics" and sm["spec"]["endpoints"][0]["path"] == "/metrics"
    # the PrometheusRule carries exactly the groups of alerts.yml
    rule = docs[("PrometheusRule", "mergestream")]
    assert rule["spec"]["groups"] == load_yaml(DEPLOY / "prometheus" / "alerts.yml")["groups"]


def test_kustomize_builds_the_base():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (the YAML checks above still ran)")
    proc = run(kubectl, "kustomize", DEPLOY / "k8s")
    assert proc.returncode == 0, proc.stderr
    built = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(proc.stdout)}
    cms = [n for k, n in built if k == "ConfigMap"]
    assert len(cms) == 1 and cms[0].startswith("mergestream-config-")  # content-hashed name
    pod = built[("Deployment", "mergestream")]["spec"]["template"]["spec"]
    assert any(v.get("configMap", {}).get("name") == cms[0] for v in pod["volumes"])
    assert yaml.safe_load(built[("ConfigMap", cms[0])]["data"]["config.yaml"]) == load_yaml(DEPLOY / "config.yaml")
    assert pod["containers"][0]["image"] == IMAGE


# -- systemd ---------------------------------------------------------------------------------------
def unit_sections(path: Path = DEPLOY / "systemd" / "mergestream.service") -> dict[str, dict[str, list[str]]]:
    """A systemd unit as section -> key -> values (keys may repeat)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out.setdefault(section, {})
            continue
        assert section is not None and "=" in line, f"bad unit line {raw!r}"
        k, _, v = line.partition("=")
        out[section].setdefault(k.strip(), []).append(v.strip())
    return out


def test_systemd_unit_parses_and_matches_the_config(monkeypatch):
    from mergestream.config import load_config

    # configparser (strict off: repeated keys) reads it too
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str
    cp.read(DEPLOY / "systemd" / "mergestream.service")
    assert {"Unit", "Service", "Install"} <= set(cp.sections())
    u = unit_sections()
    s = u["Service"]
    exe, *argv = shlex.split(s["ExecStart"][0])
    assert exe.startswith("/") and Path(exe).name == "mergestream"
    assert argv == ["run", "--config", CONFIG_PATH]
    assert s["Restart"] == ["on-failure"] and s["User"] == ["mergestream"]
    for key, want in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
                      "PrivateTmp": "yes"}.items():
        assert s[key] == [want], key
    assert s["CapabilityBoundingSet"] == [""]
    rw = " ".join(s["ReadWritePaths"]).split()
    ro = " ".join(s.get("ReadOnlyPaths", [])).split()
    # the unit's Environment= lines applied to the shipped config put everything in those paths
    env = dict(e.split("=", 1) for e in s["Environment"])
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = load_config(DEPLOY / "config.yaml")
    assert str(cfg.state_dir) in rw and str(cfg.inbox) in rw
    assert any(str(cfg.base).startswith(p + "/") for p in ro)
    assert cfg.metrics.host == "127.0.0.1" and cfg.metrics.port == METRICS_PORT
    state_dirs = " ".join(s["StateDirectory"]).split()
    for p in rw + ro:
        assert p.removeprefix("/var/lib/") in state_dirs, f"{p} is not created by StateDirectory="
    assert u["Install"]["WantedBy"] == ["multi-user.target"]


def test_systemd_analyze_verify(tmp_path):
    sa = shutil.which("systemd-analyze")
    if sa is None:
        pytest.skip("systemd-analyze not available; the unit's parse test ran instead")
    # verify needs ExecStart's binary: point it at this environment's mergestream
    exe = Path(sys.executable).with_name("mergestream")
    assert exe.exists()
    text = (DEPLOY / "systemd" / "mergestream.service").read_text()
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={exe}", text, flags=re.MULTILINE)
    unit = tmp_path / "mergestream.service"
    unit.write_text(text)
    proc = run(sa, "verify", unit)
    mine = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "mergestream.service" in ln]
    assert proc.returncode == 0 and not mine, proc.stdout + proc.stderr
    # the checker does complain about a broken unit (so silence above means something)
    bad = tmp_path / "broken.service"
    bad.write_text(text.replace("Restart=on-failure", "Restart=sometimes")
                   .replace("[Service]", "[Service]\nNoSuchKey=1"))
    out = run(sa, "verify", bad)
    assert "broken.service" in out.stdout + out.stderr
    # hardening: systemd's own exposure score (offline analysis, systemd >= 250)
    sec = run(sa, "security", "--offline=true", unit)
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", sec.stdout + sec.stderr)
    if m is None:
        pytest.skip(f"systemd-analyze security --offline unsupported here: {sec.stderr[-300:]}")
    assert float(m.group(1)) <= 2.0, sec.stdout[-2000:]


# -- Prometheus: promtool ---------------------------------------------------------------------------
def test_promtool_checks_rules_config_and_alert_tests():
    promtool = tool("promtool")
    proc = run(promtool, "check", "rules", DEPLOY / "prometheus" / "alerts.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    n = len(load_yaml(DEPLOY / "prometheus" / "alerts.yml")["groups"][0]["rules"])
    assert f"SUCCESS: {n} rules found" in proc.stdout
    # rule_files are resolved against the config file's folder, so this works from anywhere
    proc = run(promtool, "check", "config", DEPLOY / "prometheus" / "prometheus.yml", cwd="/")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 1 rule files found" in proc.stdout
    proc = run(promtool, "test", "rules", DEPLOY / "prometheus" / "alerts_test.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the unit tests cover every alert
    tested = set(re.findall(r"alertname: (\w+)", (DEPLOY / "prometheus" / "alerts_test.yml").read_text()))
    names = {r["alert"] for r in load_yaml(DEPLOY / "prometheus" / "alerts.yml")["groups"][0]["rules"]}
    assert REQUIRED_ALERTS <= names and tested == names


# -- the dashboard and rule expressions -------------------------------------------------------------
GRAFANA_VARS = {"$__rate_interval": "1m", "$__range": "1h", "$__interval": "15s"}


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "mergestream.json").read_text())


def dashboard_exprs(dash: dict | None = None) -> list[str]:
    dash = dash or dashboard()
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def dashboard_queries() -> list[str]:
    """The dashboard's expressions as Grafana sends them (variables at their defaults)."""
    dash = dashboard()
    values = dict(GRAFANA_VARS)
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            values[f"${v['name']}"] = v.get("allValue", ".*")
        elif v["type"] in ("custom", "interval"):
            values[f"${v['name']}"] = v["current"]["value"]
    out = []
    for e in dashboard_exprs(dash):
        for k in sorted(values, key=len, reverse=True):
            e = e.replace(k, values[k])
        assert "$" not in e, f"undefined variable in {e}"
        out.append(e)
    return out


def alert_exprs() -> list[str]:
    return [r["expr"] for g in load_yaml(DEPLOY / "prometheus" / "alerts.yml")["groups"] for r in g["rules"]]


def test_dashboard_is_well_formed():
    dash = dashboard()
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    var_names = {v["name"] for v in dash["templating"]["list"]}
    ds_var = next(v for v in dash["templating"]["list"] if v["type"] == "datasource")
    assert ds_var["query"] == "prometheus"
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${" + ds_var["name"] + "}" and p["targets"]
        for t in p["targets"]:
            assert t["refId"] and t["expr"] and t["datasource"] == p["datasource"]
            for var in re.findall(r"\$(\w+)", t["expr"]):
                assert var in var_names or f"${var}" in GRAFANA_VARS, var
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for want in ("current version", "folds by outcome", "rollbacks", "general", "per-task", "p50 / p95",
                 "queue depth", "source"):
        assert want in titles, want
    exprs = " ".join(dashboard_exprs(dash))
    assert "histogram_quantile(0.5," in exprs and "histogram_quantile(0.95," in exprs


def metric_types() -> tuple[dict[str, str], dict[str, set[str]]]:
    """Series names the daemon's code defines -> type, and their label names."""
    from prometheus_client.metrics import MetricWrapperBase

    from mergestream.daemon.metrics import Metrics

    types, labels = {}, {}
    for m in vars(Metrics()).values():
        if not isinstance(m, MetricWrapperBase):
            continue
        kind, name, lab = m._type, m._name, set(m._labelnames)
        if kind == "counter":
            types[name + "_total"], labels[name + "_total"] = "counter", lab
        elif kind == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                types[name + suffix] = "histogram"
                labels[name + suffix] = lab | ({"le"} if suffix == "_bucket" else set())
        else:
            types[name], labels[name] = kind, lab
    return types, labels


def exposition_names(text: str) -> set[str]:
    """Series names a /metrics page declares (# TYPE lines, histogram suffixes) or carries."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names |= {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def used_metrics(exprs: list[str]) -> set[str]:
    return {n for e in exprs for n in re.findall(r"\b(mergestream_[A-Za-z0-9_]+)\b", e)}


def check_expression_semantics(expr: str, types: dict[str, str], labels: dict[str, set[str]]) -> None:
    target = {"instance", "job"}
    for name, sel in re.findall(r"\b(mergestream_\w+)\s*\{([^}]*)\}", expr):
        for lab in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", sel):
            assert lab in labels[name] | target, f"{name} has no label {lab!r} ({expr})"
    for fn, name in re.findall(r"\b(rate|irate|increase)\(\s*(mergestream_\w+)", expr):
        assert types[name] in ("counter", "histogram"), f"{fn}() over {types[name]} {name}"
    for name in re.findall(r"\bhistogram_quantile\([^,]+,.*?(mergestream_\w+)", expr):
        assert name.endswith("_bucket"), name
    expr_labels = set().union(*(labels[n] for n in used_metrics([expr]))) | target
    for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
        for lab in filter(None, (x.strip() for x in group.split(","))):
            assert lab in expr_labels, f"by ({lab}) in {expr}"


# -- a live daemon, and a real Prometheus scraping it ------------------------------------------------
@pytest.fixture(scope="module")
def live_daemon(tmp_path_factory):
    """A daemon (tests/test_daemon.py's helper, MLflow off) that has folded one expert."""
    d = Daemon(tmp_path_factory.mktemp("deploy-daemon"), extra={"mlflow": {"enabled": False}})
    d.start()
    try:
        save_tensors(d.root / "inbox" / "first.safetensors", scaled_expert(tiny_base(), 1))
        d.wait(lambda: d.metric("mergestream_current_version") == 1, 60, "first expert not folded")
        yield d
    finally:
        d.stop()


@contextlib.contextmanager
def run_prometheus(root: Path, daemon_port: int):
    """The real Prometheus with the shipped config and rules, pointed at 127.0.0.1, 1 s intervals."""
    binary = tool("prometheus")
    conf = load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    port = free_port()
    conf["global"].update(scrape_interval="1s", evaluation_interval="1s")
    conf["rule_files"] = [str((DEPLOY / "prometheus" / f).resolve()) for f in conf["rule_files"]]
    for job in conf["scrape_configs"]:
        target = f"127.0.0.1:{daemon_port}" if job["job_name"] == "mergestream" else f"127.0.0.1:{port}"
        job["static_configs"] = [{"targets": [target]}]
    (root / "prometheus.yml").write_text(yaml.safe_dump(conf))
    log = open(root / "prometheus.log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(proc, f"{url}/-/ready", root / "prometheus.log", 60, "prometheus never became ready")
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def promql(url: str, query: str) -> dict:
    doc = http_json(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": query}))
    assert doc["status"] == "success", doc
    return doc["data"]


@pytest.fixture(scope="module")
def prometheus(live_daemon, tmp_path_factory):
    with run_prometheus(tmp_path_factory.mktemp("prometheus"), live_daemon.port) as url:
        yield url


def test_every_dashboard_and_alert_metric_is_exposed(live_daemon):
    status, body = live_daemon.http("/metrics")
    assert status == 200
    exposed = exposition_names(body)
    types, labels = metric_types()
    for source, exprs in (("dashboard", dashboard_exprs()), ("alerts.yml", alert_exprs())):
        names = used_metrics(exprs)
        assert names, source
        missing = sorted(names - exposed)
        assert not missing, f"{source} names metrics the daemon does not expose: {missing}"
        unknown = sorted(names - set(types))
        assert not unknown, f"{source}: {unknown} not defined in mergestream/daemon/metrics.py"
        for e in exprs:
            check_expression_semantics(e, types, labels)
    # what the issue asks the dashboard and the alerts to show
    dash = used_metrics(dashboard_exprs())
    assert {"mergestream_current_version", "mergestream_folds_total", "mergestream_rollbacks_total",
            "mergestream_probe_value", "mergestream_fold_duration_seconds_bucket", "mergestream_queue_depth",
            "mergestream_source_errors_total"} <= dash
    alerts = used_metrics(alert_exprs())
    assert {"mergestream_rollbacks_total", "mergestream_probe_value", "mergestream_queue_depth",
            "mergestream_last_successful_fold_timestamp_seconds", "mergestream_source_errors_total",
            "mergestream_tracking_errors_total"} <= alerts


def test_dockerfile_healthcheck_command_probes_the_daemon(live_daemon):
    hc = next(rest for w, rest in dockerfile_instructions() if w == "HEALTHCHECK")
    cmd = exec_form(hc[hc.index("CMD") + 3:].strip())
    assert cmd[0] == "python"
    cmd[0] = sys.executable
    ok = run(*cmd, env={**os.environ, "MERGESTREAM_METRICS__PORT": str(live_daemon.port)})
    assert ok.returncode == 0, ok.stderr
    down = run(*cmd, env={**os.environ, "MERGESTREAM_METRICS__PORT": str(free_port())})
    assert down.returncode != 0


@pytest.mark.slow
def test_prometheus_scrapes_the_daemon_and_the_rules_work(live_daemon, prometheus):
    url = prometheus
    # the fold counter, through PromQL
    def folded():
        res = promql(url, 'mergestream_folds_total{outcome="accepted"}')["result"]
        return max((float(r["value"][1]) for r in res), default=0) >= 1 and res
    res = wait_for(folded, 60, "the accepted-fold counter never reached Prometheus")
    assert all(r["metric"]["job"] == "mergestream" for r in res)
    assert promql(url, 'up{job="mergestream"}')["result"][0]["value"][1] == "1"
    # every rule loaded from the shipped file and evaluates without error
    names = {r["alert"] for r in load_yaml(DEPLOY / "prometheus" / "alerts.yml")["groups"][0]["rules"]}

    def rules_evaluated():
        groups = http_json(f"{url}/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        done = {r["name"] for r in rules if not r.get("lastEvaluation", "").startswith("0001")}
        return done == names and rules
    rules = wait_for(rules_evaluated, 30, "rules never evaluated")
    for r in rules:
        assert r["health"] == "ok" and not r.get("lastError"), r
    # every dashboard query runs (variables at their defaults)
    for q in dashboard_queries():
        promql(url, q)
    got = promql(url, 'max(mergestream_current_version{instance=~".*"})')["result"]
    assert float(got[0]["value"][1]) == 1.0
    # a healthy daemon: nothing fires
    time.sleep(2)
    firing = [a for a in http_json(f"{url}/api/v1/alerts")["data"]["alerts"] if a["state"] == "firing"]
    assert not firing, firing
    # a harmful expert is rejected by the gate: the rollback alert fires through Prometheus
    save_tensors(live_daemon.root / "inbox" / "harmful.safetensors", scaled_expert(tiny_base(), 30, factor=50.0))

    def rejected_alert():
        alerts = http_json(f"{url}/api/v1/alerts")["data"]["alerts"]
        return [a for a in alerts
                if a["labels"]["alertname"] == "MergestreamCandidateRejected" and a["state"] == "firing"]
    (alert,) = wait_for(rejected_alert, 60, "MergestreamCandidateRejected never fired")
    assert alert["labels"]["severity"] == "warning" and alert["labels"]["job"] == "mergestream"
    assert live_daemon.metric("mergestream_rollbacks_total") == 1.0
    assert live_daemon.metric("mergestream_current_version") == 1.0


# -- the compose MLflow service ---------------------------------------------------------------------
@pytest.mark.slow
def test_compose_mlflow_command_serves_the_daemons_host(tmp_path):
    """Run compose's `mlflow server` command (paths moved under tmp_path, port free, host
    127.0.0.1) with this environment's MLflow (the version the image tag pins) and call the API
    with the Host header the daemon sends inside compose."""
    from mergestream.config import load_config

    m = compose()["services"]["mlflow"]
    cmd = list(m["command"])
    port = free_port()
    moves = {}
    for src, dst, _ in map(_bind, m["volumes"]):
        moves[dst] = str(tmp_path / dst.strip("/").replace("/", "_"))
        Path(moves[dst]).mkdir()
    for i, a in enumerate(cmd):
        for dst, new in moves.items():
            a = a.replace(dst, new)
        cmd[i] = a
    cmd[cmd.index("--host") + 1] = "127.0.0.1"
    cmd[cmd.index("--port") + 1] = str(port)
    assert cmd[:2] == ["mlflow", "server"]
    env = {**os.environ, **{k: str(v) for k, v in m.get("environment", {}).items()}}
    log = open(tmp_path / "mlflow.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", *cmd[1:]], stdout=log, stderr=subprocess.STDOUT,
                            env=env, cwd=tmp_path, start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def call(host: str) -> int:
        req = urllib.request.Request(f"{base}/api/2.0/mlflow/experiments/search?max_results=1", headers={"Host": host})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    try:
        wait_http_ok(proc, f"{base}/health", tmp_path / "mlflow.log", 120, "mlflow server never became healthy")
        daemon_host = urllib.parse.urlsplit(load_config(DEPLOY / "config.yaml").tracking_uri()).netloc
        assert call(daemon_host) == 200, (tmp_path / "mlflow.log").read_text()[-3000:]
        assert call(f"localhost:{port}") == 200
        assert call("attacker.example:5000") == 403  # the protection is on, not switched off
    finally:
        stop_process_group(proc, grace=20)
        log.close()


# -- Ray (issue 15: folds on a Ray cluster) ---------------------------------------------------------
def test_compose_ray_profile_joins_the_daemon_to_a_head_and_worker():
    """Profile ``ray``: a head and a worker from the daemon's image (built with the ray extra), on the
    daemon's volumes at the same paths, read-only; the daemon's executor points at the head."""
    from mergestream.config import load_config

    raw = load_yaml(DEPLOY / "compose.yaml")
    svc = interpolate(raw)["services"]
    head, worker, d = svc["ray-head"], svc["ray-worker"], svc["mergestream"]
    assert head["profiles"] == ["ray"] and worker["profiles"] == ["ray"]
    assert head["image"] == worker["image"] == d["image"]
    assert d["build"]["args"]["EXTRAS"] == "" and interpolate(
        raw, {"MERGESTREAM_EXTRAS": "[ray]"})["services"]["mergestream"]["build"]["args"]["EXTRAS"] == "[ray]"
    assert "ARG EXTRAS=" in [f"{w} {r}" for w, r in dockerfile_instructions()]
    assert head["entrypoint"][:3] == ["ray", "start", "--head"]
    client_port = next(a.split("=")[1] for a in head["entrypoint"] if a.startswith("--ray-client-server-port="))
    gcs_port = next(a.split("=")[1] for a in head["entrypoint"] if a.startswith("--port="))
    assert f"--address=ray-head:{gcs_port}" in worker["entrypoint"]
    assert d["environment"]["MERGESTREAM_EXECUTOR__ADDRESS"] == f"ray://ray-head:{client_port}"
    assert d["environment"]["MERGESTREAM_EXECUTOR__KIND"] == "local"  # off unless MERGESTREAM_EXECUTOR=ray
    ray_env = interpolate(raw, {"MERGESTREAM_EXECUTOR": "ray"})["services"]["mergestream"]["environment"]
    assert ray_env["MERGESTREAM_EXECUTOR__KIND"] == "ray"
    cfg = load_config(DEPLOY / "config.yaml")
    daemon_mounts = {dst: src for src, dst, _ in map(_bind, d["volumes"])}
    for s in (head, worker):
        mounts = {dst: (src, mode) for src, dst, mode in map(_bind, s["volumes"])}
        for path in (str(cfg.base), str(cfg.inbox), str(cfg.state_dir)):
            assert mounts[path] == (daemon_mounts[path], "ro"), f"{path} differs from the daemon's"


def test_k8s_ray_cluster_mounts_the_daemons_volume():
    """deploy/k8s/ray-cluster.yaml: a KubeRay RayCluster on the daemon's image and volume, with the
    daemon's paths, and Ray's version pinned as in constraints.txt."""
    (rc,) = list(yaml.safe_load_all((DEPLOY / "k8s" / "ray-cluster.yaml").read_text()))
    assert rc["apiVersion"] == "ray.io/v1" and rc["kind"] == "RayCluster"
    pin = re.search(r"^ray==(\S+)", (ROOT / "constraints.txt").read_text(), re.MULTILINE).group(1)
    assert rc["spec"]["rayVersion"] == pin
    dep = k8s_docs()[("Deployment", "mergestream")]["spec"]["template"]["spec"]
    daemon = {m["mountPath"]: m.get("subPath") for m in dep["containers"][0]["volumeMounts"] if m["name"] == "data"}
    claim = next(v for v in dep["volumes"] if v["name"] == "data")["persistentVolumeClaim"]["claimName"]
    pods = [rc["spec"]["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"]
                                                                for g in rc["spec"]["workerGroupSpecs"]]
    for pod in pods:
        (c,) = pod["containers"]
        assert c["image"].split(":")[0] == IMAGE.split(":")[0]
        vols = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m for m in c["volumeMounts"] if m["name"] == "data"}
        assert vols["data"]["persistentVolumeClaim"]["claimName"] == claim
        assert {p: m["subPath"] for p, m in mounts.items()} == daemon
        assert all(m.get("readOnly") for m in mounts.values())
        assert pod["securityContext"]["runAsNonRoot"]
    assert "ray-cluster.yaml" not in load_yaml(DEPLOY / "k8s" / "kustomization.yaml")["resources"], \
        "the base must apply without the KubeRay operator"
