#!/usr/bin/env python3
"""Lints the Helm chart (strict), renders it for the default values and every variant
in charts/preheat/ci/, and validates every rendered object: Kubernetes objects against
the Kubernetes schemas (kubernetes-validate), ScaledObjects against KEDA's CRD schema in
testdata/schemas/, PrometheusRules with Prometheus' own `promtool check rules` (their
metric names must be ones the scaler exposes), plus the chart's own promises (least-privilege RBAC, probes, drain,
scale to zero, consistent names). Exit 0 when all hold; prints every problem."""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import helm_python
import jsonschema
import kubernetes_validate
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHART = os.path.join(ROOT, "charts", "preheat")
KEDA_CRD = os.path.join(ROOT, "testdata", "schemas", "keda.sh_scaledobjects.yaml")
KUBE_VERSION = "1.33.0"
SCALER_NAMES = os.path.join(ROOT, "scaler", "src", "signals", "names.rs")

problems = []


def fail(variant, msg):
    problems.append(f"[{variant}] {msg}")


def keda_schema():
    with open(KEDA_CRD) as f:
        crd = yaml.safe_load(f)
    for v in crd["spec"]["versions"]:
        if v["name"] == "v1alpha1":
            return v["schema"]["openAPIV3Schema"]
    raise SystemExit("no v1alpha1 in the KEDA CRD")


def check_rules(variant, name, rule):
    """promtool (Debian's prometheus package) checks the PromQL; every preheat metric an
    alert reads must be one the code exposes."""
    exposed = set(re.findall(r'"(preheat:[a-z_]+)"', open(SCALER_NAMES).read()))
    for group in rule["spec"].get("groups", []):
        for r in group.get("rules", []):
            for metric in re.findall(r"preheat:[a-z_]+", r.get("expr", "")):
                if metric not in exposed:
                    fail(variant, f"{name}: alert {r.get('alert')} reads {metric}, which nothing exposes")
    promtool = shutil.which("promtool")
    if not promtool:
        if os.environ.get("PREHEAT_REQUIRE_FETCHED"):
            fail(variant, "promtool missing (apt-get install prometheus)")
        else:
            print("skipping promtool: apt-get install prometheus", file=sys.stderr)
        return
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump({"groups": rule["spec"]["groups"]}, f)
        f.flush()
        out = subprocess.run([promtool, "check", "rules", f.name], capture_output=True, text=True)
        if out.returncode != 0:
            fail(variant, f"{name}: promtool check rules: {out.stdout}{out.stderr}")
        alerts = {r.get("alert") for g in rule["spec"]["groups"] for r in g.get("rules", [])}
        if "PreheatScalerStateNotSaved" in alerts:
            test_state_alert(variant, name, promtool, f.name, rule)


def test_state_alert(variant, name, promtool, rules_file, rule):
    """The state-file alert, evaluated by promtool: quiet while a save lands each
    30 s, firing once saves stop for two minutes plus its `for`, and for a scaler
    that never saved (the gauge stays 0), each scaler pod on its own."""
    ns = rule["metadata"].get("namespace") or "llm"
    series = "preheat:scaler_state_saved_timestamp_seconds"
    # A save every 30 s for ten minutes, then none: time() − last save passes 120 s
    # after 12 min, so with one-minute evaluations it fires at 13 min plus its `for`
    # (the shipped 10m: at 23 min) and not a minute before.
    held = rule_for(rule, "PreheatScalerStateNotSaved")
    m = re.fullmatch(r"(\d+)m", held or "")
    if not m:
        fail(variant, f"{name}: PreheatScalerStateNotSaved for: {held!r}, not whole minutes")
        return
    held = int(m.group(1))
    saving = " ".join(str(30 * i) for i in range(21)) + f" 600x{4 * (held + 20)}"
    summary = lambda pod, what: {
        "summary": f"preheat's scaler {pod} {what}: a restart would relearn each pool's season"
    }
    # "Never" is 0 on a real clock, 1.7e9 s ago; promtool's clock starts at 0, so the
    # gauge sits as far below it instead.
    never = f"-2000000000x{4 * (held + 20)}"
    test = {
        "rule_files": [rules_file],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "30s",
                "input_series": [
                    {"series": f'{series}{{namespace="{ns}",pod="a"}}', "values": saving},
                ],
                "alert_rule_test": [
                    {"eval_time": "10m", "alertname": "PreheatScalerStateNotSaved", "exp_alerts": []},
                    {"eval_time": f"{12 + held}m", "alertname": "PreheatScalerStateNotSaved", "exp_alerts": []},
                    {
                        "eval_time": f"{13 + held}m",
                        "alertname": "PreheatScalerStateNotSaved",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning", "namespace": ns, "pod": "a"},
                                "exp_annotations": summary("a", f"has not saved its state file for {13 + held - 10}m 0s"),
                            }
                        ],
                    },
                ],
            },
            {
                "interval": "30s",
                "input_series": [{"series": f'{series}{{namespace="{ns}",pod="b"}}', "values": never}],
                "alert_rule_test": [
                    {
                        "eval_time": f"{3 + held + 2}m",
                        "alertname": "PreheatScalerStateNotSaved",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning", "namespace": ns, "pod": "b"},
                                "exp_annotations": summary("b", "has never saved its state file"),
                            }
                        ],
                    },
                ],
            },
        ],
    }
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=os.path.dirname(rules_file)) as t:
        yaml.safe_dump(test, t)
        t.flush()
        out = subprocess.run([promtool, "test", "rules", t.name], capture_output=True, text=True)
        if out.returncode != 0:
            fail(variant, f"{name}: promtool test rules (PreheatScalerStateNotSaved): {out.stdout}{out.stderr}")


def rule_for(rule, alert):
    for g in rule["spec"]["groups"]:
        for r in g.get("rules", []):
            if r.get("alert") == alert:
                return r.get("for")
    return None


DASHBOARD = os.path.join(CHART, "dashboards", "preheat.json")


def check_dashboard(variant, merged, by_kind):
    """dashboard.enabled ships dashboards/preheat.json verbatim in a ConfigMap labelled
    for Grafana's sidecar; the JSON holds the variables every query uses. (Every query
    is run against a real Prometheus scraping `preheat up` in tests/cli_up.rs.)"""
    cms = [cm for cm in by_kind.get("ConfigMap", []) if "preheat.json" in cm.get("data", {})]
    if merged["dashboard"]["enabled"] != bool(cms):
        fail(variant, "dashboard.enabled does not match the rendered dashboard ConfigMap")
    for cm in cms:
        labels = cm["metadata"].get("labels", {})
        for k, v in merged["dashboard"]["labels"].items():
            if labels.get(k) != v:
                fail(variant, f"dashboard ConfigMap lacks the sidecar label {k}={v}")
        with open(DASHBOARD) as f:
            shipped = json.load(f)
        gen = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "dashboard.py")], capture_output=True, text=True)
        if gen.returncode != 0 or json.loads(gen.stdout) != shipped:
            fail(variant, "dashboards/preheat.json is not what scripts/dashboard.py writes (run it)")
        if json.loads(cm["data"]["preheat.json"]) != shipped:
            fail(variant, "the dashboard ConfigMap is not dashboards/preheat.json")
        names = {v["name"] for v in shipped["templating"]["list"]}
        if not {"datasource", "namespace", "model", "pool"} <= names:
            fail(variant, f"dashboard variables {sorted(names)}")
        for panel in shipped["panels"]:
            if panel["type"] == "row":
                continue
            if not panel.get("targets") or any(not t.get("expr") for t in panel["targets"]):
                fail(variant, f"dashboard panel {panel['title']!r} has a target without a query")
            if panel.get("datasource", {}).get("uid") != "${datasource}":
                fail(variant, f"dashboard panel {panel['title']!r} does not use the datasource variable")


def check_monitoring(variant, merged, by_kind):
    """With serviceMonitor.enabled, everything that serves is scraped: the Services'
    pods, and the standbys inside the agents' pods (a PodMonitor on their named ports);
    both carry serviceMonitor.labels (a Prometheus that selects by label finds them)."""
    sm = merged["serviceMonitor"]
    models = expected_models(merged)
    total = sum(m["standbys"]["prefill"] + m["standbys"]["decode"] for m in models)
    want_standbys = sm["enabled"] and merged["warmpool"]["enabled"] and total > 0
    pms = by_kind.get("PodMonitor", [])
    if want_standbys != bool(pms):
        fail(variant, f"standbys' PodMonitor {'missing' if want_standbys else 'rendered'}")
    for o in by_kind.get("ServiceMonitor", []) + pms:
        labels = o["metadata"].get("labels", {})
        for k, v in (sm.get("labels") or {}).items():
            if labels.get(k) != v:
                fail(variant, f'{o["kind"]}/{o["metadata"]["name"]} lacks serviceMonitor.labels {k}={v}')
    for pm in pms:
        ds = by_kind.get("DaemonSet", [])
        ports = {p["name"]: p["containerPort"] for c in ds[0]["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])} if ds else {}
        scraped = [e["port"] for e in pm["spec"]["podMetricsEndpoints"]]
        want = sorted(n for n in ports if n.startswith("sb-"))
        if sorted(scraped) != want or len(want) != total:
            fail(variant, f"PodMonitor scrapes {scraped}, the agents' standby ports are {want}")
        # Each named port is where one standby of the agents' config listens.
        cms = {cm["metadata"]["name"]: cm for cm in by_kind.get("ConfigMap", [])}
        agent = yaml.safe_load(cms["rel-preheat-warmpool"]["data"]["warmpool.yaml"])
        listening = sorted(s_["base_port"] + 2 * j for s_ in agent.get("standbys") or [] for j in range(s_["count"]))
        if sorted(ports[n] for n in want) != listening:
            fail(variant, f"the standby ports named {sorted(ports[n] for n in want)} are not where the standbys listen {listening}")


def deep_merge(base, over):
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def check_own_then_non_root(variant, who, pod):
    """The only root step: `own` first, with CAP_CHOWN alone; every other init step runs
    as the pod's non-root user."""
    inits = pod.get("initContainers", [])
    if not inits or inits[0]["name"] != "own" or inits[0]["args"][:2] != ["warmpool", "own"]:
        fail(variant, f"{who}: the node directory is not given to the non-root user first")
        return
    sc = inits[0]["securityContext"]
    if sc.get("runAsUser") != 0 or sc.get("capabilities", {}).get("add") != ["CHOWN"]:
        fail(variant, f"{who}: `own` is not root with CAP_CHOWN alone")
    psc = pod.get("securityContext", {})
    for ic in inits[1:]:
        user = ic.get("securityContext", {}).get("runAsUser", psc.get("runAsUser", 0))
        if user == 0:
            fail(variant, f"{who}: init {ic['name']} runs as root")


def check_security(variant, merged, by_kind):
    """Every pod: seccomp RuntimeDefault, read-only roots, no capabilities beyond
    IPC_LOCK, the cluster token mounted and named; a model source from a Secret never
    appears in a spec or ConfigMap; the token Secret kept across upgrades."""
    token_secret = merged["clusterToken"]["existingSecret"] or "rel-preheat-cluster-token"
    secrets = {o["metadata"]["name"]: o for o in by_kind.get("Secret", [])}
    if not merged["clusterToken"]["existingSecret"]:
        s = secrets.get(token_secret)
        if not s or not s.get("data", {}).get("token"):
            fail(variant, "no cluster token Secret")
        elif s["metadata"].get("annotations", {}).get("helm.sh/resource-policy") != "keep":
            fail(variant, "the cluster token Secret is not kept across upgrades")
    elif token_secret in secrets:
        fail(variant, "a cluster token Secret is rendered although clusterToken.existingSecret is set")
    for kind in ["Deployment", "DaemonSet"]:
        for d in by_kind.get(kind, []):
            name = d["metadata"]["name"]
            pod = d["spec"]["template"]["spec"]
            if pod.get("securityContext", {}).get("seccompProfile", {}).get("type") != "RuntimeDefault":
                fail(variant, f"{name}: no seccompProfile RuntimeDefault")
            vols = {v["name"]: v for v in pod.get("volumes", [])}
            if vols.get("cluster-token", {}).get("secret", {}).get("secretName") != token_secret:
                fail(variant, f"{name}: the cluster token Secret is not mounted")
            for c in pod["containers"] + pod.get("initContainers", []):
                sc = c.get("securityContext", {})
                if not sc.get("readOnlyRootFilesystem") or sc.get("allowPrivilegeEscalation") is not False:
                    fail(variant, f"{name}/{c['name']}: root filesystem writable or privilege escalation allowed")
                # IPC_LOCK for the agent's mlock, CHOWN for the `own` step; nothing else.
                allowed = {"CHOWN"} if c["name"] == "own" else {"IPC_LOCK"}
                if sc.get("capabilities", {}).get("drop") != ["ALL"] or set(sc.get("capabilities", {}).get("add", [])) - allowed:
                    fail(variant, f"{name}/{c['name']}: capabilities not dropped")
            for c in pod["containers"] + pod.get("initContainers", []):
                # A mount inside another (read-only) one cannot get its mount point
                # (the cluster run found the scaler's TLS under its ConfigMap).
                paths = [m["mountPath"].rstrip("/") for m in c.get("volumeMounts", [])]
                for a in paths:
                    for b in paths:
                        if b.startswith(a + "/"):
                            fail(variant, f"{name}/{c['name']}: {b} is mounted inside {a}")
            for c in pod["containers"]:
                env = {e["name"]: e for e in c.get("env", [])}
                if env.get("PREHEAT_CLUSTER_TOKEN_FILE", {}).get("value") != "/var/run/preheat/cluster-token/token":
                    fail(variant, f"{name}/{c['name']}: PREHEAT_CLUSTER_TOKEN_FILE not set")
                if not any(m["name"] == "cluster-token" and m.get("readOnly") for m in c.get("volumeMounts", [])):
                    fail(variant, f"{name}/{c['name']}: the token is not mounted read-only")
    # (A source from a Secret shown in a spec: check_models, model by model.)
    keys = merged["gateway"]["apiKeys"]["existingSecret"]
    gw = [d for d in by_kind.get("Deployment", []) if d["metadata"]["name"] == "rel-preheat-gateway"]
    if gw:
        env = {e["name"] for e in gw[0]["spec"]["template"]["spec"]["containers"][0].get("env", [])}
        if bool(keys) != ("PREHEAT_API_KEYS_FILE" in env):
            fail(variant, "gateway.apiKeys.existingSecret and PREHEAT_API_KEYS_FILE disagree")
    if merged["networkPolicy"]["enabled"]:
        policies = {o["metadata"]["name"] for o in by_kind.get("NetworkPolicy", [])}
        for want in ["rel-preheat-prefill", "rel-preheat-decode", "rel-preheat-scaler"]:
            if want not in policies:
                fail(variant, f"no NetworkPolicy {want}")
        for o in by_kind.get("NetworkPolicy", []):
            if any(not r.get("from") for r in o["spec"].get("ingress", [])):
                fail(variant, f'NetworkPolicy/{o["metadata"]["name"]} has a rule open to everyone')
            if o["metadata"]["name"] == "rel-preheat-prefill":
                kv = [r for r in o["spec"]["ingress"] if any(p["port"] == merged["prefill"]["kvPort"] for p in r.get("ports", []))]
                comps = sorted(f["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for r in kv for f in r["from"])
                if comps != ["decode", "warmpool"]:
                    fail(variant, f"the prefill KV port is open to {comps}, want decode workers and the agents' standbys only")


def check_scaler_state(variant, merged, by_kind):
    """The scaler's state file sits on a writable volume of the kind the values ask for
    (an emptyDir, or the claim the chart creates or is given), and nowhere without it."""
    st = merged["scaler"]["state"]
    dep = [d for d in by_kind.get("Deployment", []) if d["metadata"]["name"] == "rel-preheat-scaler"]
    cms = [c for c in by_kind.get("ConfigMap", []) if c["metadata"]["name"] == "rel-preheat-scaler"]
    if not dep or not cms:
        return
    cfg = yaml.safe_load(cms[0]["data"]["scaler.yaml"])
    pod = dep[0]["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in pod["containers"][0].get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    claims = {o["metadata"]["name"] for o in by_kind.get("PersistentVolumeClaim", [])}
    if not st["enabled"]:
        if "state_file" in cfg or "state" in volumes or claims:
            fail(variant, "scaler.state.enabled is false, yet a state file, volume or claim is rendered")
        return
    m = mounts.get("state")
    if not m or m.get("readOnly") or not cfg.get("state_file", "").startswith(m["mountPath"] + "/"):
        fail(variant, f'scaler: state_file {cfg.get("state_file")} is not on its writable state volume')
    v = volumes.get("state", {})
    persistence = st["persistence"]
    if persistence["enabled"]:
        want = persistence["existingClaim"] or "rel-preheat-scaler-state"
        if v.get("persistentVolumeClaim", {}).get("claimName") != want:
            fail(variant, f"scaler: the state volume is not the claim {want}")
        if (want in claims) == bool(persistence["existingClaim"]):
            fail(variant, f"scaler: claim {want} rendered {want in claims}, existingClaim {persistence['existingClaim']!r}")
        for c in by_kind.get("PersistentVolumeClaim", []):
            kept = (c["metadata"].get("annotations") or {}).get("helm.sh/resource-policy") == "keep"
            if c["metadata"]["name"] == want and kept != bool(persistence["keep"]):
                fail(variant, f"scaler: claim {want} kept on uninstall {kept}, persistence.keep {persistence['keep']}")
        if pod.get("securityContext", {}).get("fsGroup") != 65532:
            fail(variant, "scaler: the claim is not writable by the scaler's group (fsGroup)")
    elif "emptyDir" not in v or claims:
        fail(variant, "scaler: the state volume is not an emptyDir")


def dns_label(s):
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")[:63].rstrip("-")


def expected_models(merged):
    """The models the values ask for, resolved here on their own (not by the chart's
    helper): name, object-name infix, source or Secret, each pool's values (the
    model's keys over the top-level ones), standbys per pool."""
    listed = bool(merged.get("models"))
    entries = merged["models"] if listed else [merged["model"]]
    out = []
    for e in entries:
        source = e.get("source") or ""
        name = e.get("name") or dns_label(re.sub(r"\.[^.]*$", "", os.path.basename(re.sub(r"[?#].*$", "", source))))
        pools = {}
        for role in ("prefill", "decode"):
            p = dict({"idleGraceSeconds": merged["scaler"]["idleGraceSeconds"]}, **merged[role])
            p.update(e.get(role) or {})
            pools[role] = p
        given = e.get("standbys") or {}
        sb = {r: given.get(r, merged["warmpool"]["standbys"][r]) if merged["warmpool"]["enabled"] else 0 for r in ("prefill", "decode")}
        secret = e.get("sourceSecret") or {}
        out.append({
            "name": name, "infix": f"-{name}" if listed else "", "listed": listed,
            "source": source, "secret": secret.get("name") or "", "secretKey": secret.get("key") or "source",
            "pools": pools, "standbys": sb, "priority": e.get("priority", 0),
        })
    return out


def mib(q):
    """A memory quantity in MiB, rounded up (as the chart adds them)."""
    m = re.fullmatch(r"([0-9.]+)([KMGT]i?B?|)", str(q))
    per = {"": 1 / 2**20, "K": 1e3 / 2**20, "M": 1e6 / 2**20, "G": 1e9 / 2**20, "T": 1e12 / 2**20,
           "Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 2**20}
    unit = m.group(2).rstrip("B") if m.group(2).endswith("iB") or m.group(2).endswith("B") else m.group(2)
    import math
    return math.ceil(float(m.group(1)) * per[unit] - 1e-9)


def selects(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def check_models(variant, merged, by_kind):
    """Every model gets its own pair of pools, wired through every component: its
    Deployments, Services, ScaledObjects, the gateway's flags, the scaler's models
    and RBAC, the agents' models and standbys; a pool's Service selects its own pods
    and no other model's."""
    models = expected_models(merged)
    deps = {d["metadata"]["name"]: d for d in by_kind.get("Deployment", [])}
    svcs = {o["metadata"]["name"]: o for o in by_kind.get("Service", [])}
    cms = {cm["metadata"]["name"]: cm for cm in by_kind.get("ConfigMap", [])}
    scaler_cfg = yaml.safe_load(cms["rel-preheat-scaler"]["data"]["scaler.yaml"])
    agent_cfg = yaml.safe_load(cms["rel-preheat-warmpool"]["data"]["warmpool.yaml"]) if "rel-preheat-warmpool" in cms else None
    pool_deps = {n: d for n, d in deps.items() if d["metadata"]["labels"].get("app.kubernetes.io/component") in ("prefill", "decode")}
    want_pools = {f"rel-preheat{m['infix']}-{r}" for m in models for r in ("prefill", "decode")}
    if set(pool_deps) != want_pools:
        fail(variant, f"pool Deployments {sorted(pool_deps)}, want {sorted(want_pools)}")
    want_gpus = max([int(m["pools"][r]["resources"]["limits"].get("nvidia.com/gpu", 0)) for m in models for r in ("prefill", "decode") if m["standbys"][r] > 0] or [0])
    if scaler_cfg["fleet"].get("standby_gpus") != want_gpus:
        fail(variant, f'scaler: fleet.standby_gpus {scaler_cfg["fleet"].get("standby_gpus")}, a parked standby holds {want_gpus}')
    if [m["name"] for m in scaler_cfg["models"]] != [m["name"] for m in models]:
        fail(variant, f'scaler models {[m["name"] for m in scaler_cfg["models"]]}, want {[m["name"] for m in models]}')
    gw = deps.get("rel-preheat-gateway")
    gw_c = gw["spec"]["template"]["spec"]["containers"][0] if gw else {"args": [], "env": []}
    gw_env = {e["name"]: e for e in gw_c.get("env", [])}
    ds = by_kind.get("DaemonSet", [])
    agent_env = {e["name"]: e for e in ds[0]["spec"]["template"]["spec"]["containers"][0].get("env", [])} if ds else {}
    so_names = {o["metadata"]["name"]: o for o in by_kind.get("ScaledObject", [])}
    for m in models:
        n = m["name"]
        sm = next((x for x in scaler_cfg["models"] if x["name"] == n), None)
        if sm and (sm.get("metrics_model_name") != n or sm.get("priority", 0) != m["priority"]):
            fail(variant, f"scaler model {n}: metrics_model_name {sm.get('metrics_model_name')}, priority {sm.get('priority')}")
        # The gateway serves it under its name, from its source or its Secret.
        args = gw_c.get("args", [])
        if m["listed"]:
            if m["secret"]:
                env = next((a.split("=", 2)[2] for a in args if a.startswith(f"--model-env={n}=")), None)
                ref = gw_env.get(env or "", {}).get("valueFrom", {}).get("secretKeyRef", {})
                if (ref.get("name"), ref.get("key")) != (m["secret"], m["secretKey"]):
                    fail(variant, f"gateway: model {n}'s source is not read from its Secret ({args}, {ref})")
            elif f"--model={n}={m['source']}" not in args:
                fail(variant, f"gateway: no --model={n}=<its source>")
        elif f"--served-model-name={n}" not in args:
            fail(variant, f"gateway: not serving {n}")
        for role in ("prefill", "decode"):
            p = m["pools"][role]
            dn = f"rel-preheat{m['infix']}-{role}"
            flag = f"--{role}-service={n + '=' if m['listed'] else ''}{dn}"
            if gw and flag not in args:
                fail(variant, f"gateway: no {flag}")
            d = pool_deps.get(dn)
            if not d:
                continue
            pod = d["spec"]["template"]["spec"]
            labels = d["spec"]["template"]["metadata"]["labels"]
            c = pod["containers"][0]
            if labels.get("preheat.dev/model") != n or f"--served-model-name={n}" not in c["args"]:
                fail(variant, f"{dn}: not a {n} worker")
            if not any(a.endswith(f"/{n}.preheat") for a in c["args"] if a.startswith("--model=")):
                fail(variant, f"{dn}: does not map {n}'s staged snapshot")
            if f"--kv-cache-mib={p['kvCacheMiB']}" not in c["args"]:
                fail(variant, f"{dn}: --kv-cache-mib is not the model's {p['kvCacheMiB']}")
            if c["resources"] != p["resources"] or (pod.get("nodeSelector") or {}) != (p.get("nodeSelector") or {}) or (pod.get("tolerations") or []) != (p.get("tolerations") or []):
                fail(variant, f"{dn}: resources, nodeSelector or tolerations are not the model's")
            if any(a not in c["args"] for a in p.get("extraArgs") or []):
                fail(variant, f"{dn}: the pool's extraArgs are missing")
            stage = next((i for i in pod.get("initContainers", []) if i["name"] == "stage"), None)
            if not stage or f"--name={n}" not in stage["args"]:
                fail(variant, f"{dn}: its stage step does not stage {n}")
            elif m["secret"]:
                ref = {e["name"]: e for e in stage.get("env", [])}.get("PREHEAT_MODEL_SOURCE", {}).get("valueFrom", {}).get("secretKeyRef", {})
                if ref.get("name") != m["secret"]:
                    fail(variant, f"{dn}: its stage step does not read {n}'s Secret")
            elif f"--source={m['source']}" not in stage["args"]:
                fail(variant, f"{dn}: its stage step does not fetch {n}'s source")
            # Its Service selects its pods, and no other pool's.
            svc = svcs.get(dn)
            if not svc:
                fail(variant, f"no Service {dn}")
            else:
                sel = svc["spec"]["selector"]
                hit = sorted(o for o, od in pool_deps.items() if selects(sel, od["spec"]["template"]["metadata"]["labels"]))
                if hit != [dn]:
                    fail(variant, f"Service {dn} selects the pods of {hit}")
                if not selects(d["spec"]["selector"]["matchLabels"], labels) or any(
                    selects(d["spec"]["selector"]["matchLabels"], od["spec"]["template"]["metadata"]["labels"]) for o, od in pool_deps.items() if o != dn):
                    fail(variant, f"Deployment {dn}'s selector is not its own pods'")
            # The scaler sizes this pool from its pods (or its Service's series) with
            # the model's policy, and sets or reads this Deployment.
            sp = (sm or {}).get(role) or {}
            if sp.get("deployment") != dn:
                fail(variant, f"scaler {n}/{role}: deployment {sp.get('deployment')}, want {dn}")
            if "selector" in sp:
                want = dict(kv.split("=") for kv in sp["selector"].split(","))
                hit = sorted(o for o, od in pool_deps.items() if selects(want, od["spec"]["template"]["metadata"]["labels"]))
                if hit != [dn]:
                    fail(variant, f"scaler {n}/{role}: selector {sp['selector']} finds {hit}")
            elif f'service="{dn}"' not in sp.get("prometheus_selector", ""):
                fail(variant, f"scaler {n}/{role}: prometheus_selector {sp.get('prometheus_selector')} is not {dn}'s")
            floor = 0 if merged["scaleToZero"] else p["minReplicas"]
            slo = ("slo_ttft_s", p.get("sloTtftSeconds")) if role == "prefill" else ("slo_itl_s", p.get("sloItlSeconds"))
            got = (sp.get("min_replicas"), sp.get("max_replicas"), sp.get("idle_grace_s"), sp.get("headroom"), sp.get(slo[0]))
            if got != (floor, p["maxReplicas"], p["idleGraceSeconds"], p["headroom"], slo[1]):
                fail(variant, f"scaler {n}/{role}: (min, max, idle grace, headroom, SLO) {got} are not the model's")
            if merged["scaler"]["mode"] == "keda":
                so = so_names.get(dn)
                if not so:
                    fail(variant, f"no ScaledObject {dn}")
                elif so["spec"]["triggers"][0]["metadata"].get("model") != n or so["spec"]["scaleTargetRef"]["name"] != dn or so["spec"]["maxReplicaCount"] != p["maxReplicas"]:
                    fail(variant, f"ScaledObject {dn} does not scale {n}'s {role} pool as its values say")
        # The agents stage it (from its Secret through the env, never in a spec).
        if agent_cfg is not None:
            am = next((x for x in agent_cfg["models"] if x["name"] == n), None)
            if not am:
                fail(variant, f"the agents do not keep {n}")
            elif m["secret"]:
                ref = agent_env.get(am.get("source_env") or "", {}).get("valueFrom", {}).get("secretKeyRef", {})
                if ref.get("name") != m["secret"] or "source" in am:
                    fail(variant, f"agents: {n}'s source is not read from its Secret")
            elif am.get("source") != m["source"]:
                fail(variant, f"agents: {n}'s source {am.get('source')}")
        if m["secret"] and m["source"]:
            for kind in ["Deployment", "DaemonSet", "ConfigMap"]:
                for o in by_kind.get(kind, []):
                    if m["source"] in json.dumps(o):
                        fail(variant, f'{kind}/{o["metadata"]["name"]} shows {n}\'s source although it comes from a Secret')
    if agent_cfg is not None and sorted(x["name"] for x in agent_cfg["models"]) != sorted(m["name"] for m in models):
        fail(variant, f'the agents keep {[x["name"] for x in agent_cfg["models"]]}, want every model')
    # The agent pod holds its standbys (2 × count workers of each pool, their memory
    # and GPUs) and, pinned, its hot set: its resources add them to warmpool.resources.
    if ds:
        got = ds[0]["spec"]["template"]["spec"]["containers"][0]["resources"]
        base = merged["warmpool"]["resources"]
        mi = lambda q: mib(q) if q is not None else 0
        want_req, want_lim, want_gpu = mi(base["requests"].get("memory")), mi(base["limits"].get("memory")), 0
        for m in models:
            for role in ("prefill", "decode"):
                n = m["standbys"][role]
                r = m["pools"][role]["resources"]
                want_req += 2 * n * mi(r["requests"].get("memory", r["limits"].get("memory")))
                want_lim += 2 * n * mi(r["limits"].get("memory", r["requests"].get("memory")))
                want_gpu += 2 * n * int(r["limits"].get("nvidia.com/gpu", 0))
        if merged["warmpool"]["mlock"]:
            want_req += mib(merged["warmpool"]["memoryBudget"])
            want_lim += mib(merged["warmpool"]["memoryBudget"])
        have = (mib(got["requests"]["memory"]), mib(got["limits"]["memory"]), int(got["limits"].get("nvidia.com/gpu", 0)))
        if have != (want_req, want_lim, want_gpu):
            fail(variant, f"agent resources (memory request, limit MiB, GPUs) {have}, its standbys and hot set need {(want_req, want_lim, want_gpu)}")
    # Standbys: each model's own pools on the agents, its count, ports that do not
    # collide, the node's budget, and the scaler told the agents' names of its pools.
    budget = merged["warmpool"]["standbys"].get("budget", 0)
    if agent_cfg is not None and agent_cfg.get("standby_budget", 0) != budget:
        fail(variant, f'agents: standby_budget {agent_cfg.get("standby_budget")}, warmpool.standbys.budget {budget}')
    ports = {}
    for s_ in (agent_cfg or {}).get("standbys") or []:
        for j in range(s_["count"]):
            port = s_["base_port"] + 2 * j
            for q in (port, port + 1):
                if q in ports:
                    fail(variant, f"standby port {q} of {s_['pool']} is also {ports[q]}'s")
                ports[q] = s_["pool"]
    for m in models:
        sm = next((x for x in scaler_cfg["models"] if x["name"] == m["name"]), {})
        for role in ("prefill", "decode"):
            want = m["standbys"][role]
            pool = f"{m['name']}-{role}" if m["listed"] else role
            got = [s_ for s_ in (agent_cfg or {}).get("standbys") or [] if s_["model"] == m["name"] and s_["pool"] == pool]
            if (got[0]["count"] if got else 0) != want:
                fail(variant, f"agents park {got[0]['count'] if got else 0} {m['name']} {role} standbys, want {want}")
            if want and (sm.get("standbys") or {}).get(f"{role}_pool", role) != pool:
                fail(variant, f"scaler {m['name']}: the agents' {role} pool is not named {pool}")


def check_variant(variant, values, defaults, schema, dump):
    merged = deep_merge(defaults, values)
    chart = helm_python.Chart.load(CHART)
    rendered = chart.render(values, name="rel", namespace="llm", is_install=True)
    objs = []
    for path, text in rendered.items():
        if path.endswith("NOTES.txt"):
            if "rel-preheat-gateway" not in text:
                fail(variant, "NOTES.txt does not say how to reach the gateway")
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objs.append((path, doc))
    by_kind = {}
    for path, o in objs:
        by_kind.setdefault(o["kind"], []).append(o)
        name = f'{o["kind"]}/{o["metadata"]["name"]}'
        if o["kind"] == "ScaledObject":
            try:
                jsonschema.validate(o, schema)
            except jsonschema.ValidationError as e:
                fail(variant, f"{name} fails KEDA's schema: {e.message} at {list(e.absolute_path)}")
        elif o["kind"] == "TriggerAuthentication":
            # No schema shipped here: the fields KEDA's external scaler reads.
            refs = o["spec"].get("secretTargetRef", [])
            params = sorted(r["parameter"] for r in refs)
            if params not in (["caCert"], ["caCert", "tlsClientCert", "tlsClientKey"]):
                fail(variant, f"{name}: parameters {params}")
            if any(not r.get("name") or not r.get("key") for r in refs):
                fail(variant, f"{name}: a secretTargetRef without name or key")
        elif o["kind"] == "ServiceMonitor":
            if not o["spec"].get("endpoints"):
                fail(variant, f"{name} has no endpoints")
            # The dashboard's per-node view reads `node`.
            for ep in o["spec"]["endpoints"]:
                if "node" not in {r.get("targetLabel") for r in ep.get("relabelings", [])}:
                    fail(variant, f"{name}: an endpoint without the `node` relabeling the dashboard reads")
        elif o["kind"] == "PodMonitor":
            pass  # checked below against the DaemonSet's standby ports
        elif o["kind"] == "PrometheusRule":
            check_rules(variant, name, o)
        else:
            try:
                kubernetes_validate.validate(o, KUBE_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                fail(variant, f"{name} fails the Kubernetes {KUBE_VERSION} schema: {e.message} at {list(e.path)}")
    check_dashboard(variant, merged, by_kind)
    check_monitoring(variant, merged, by_kind)
    if dump:
        # The simulator's KEDA model is checked against these (tests/chart.rs).
        for o in by_kind.get("ScaledObject", []):
            d = os.path.join(dump, variant)
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"scaledobject-{o['metadata']['name']}.json"), "w") as f:
                json.dump(o, f)
        for o in by_kind.get("PrometheusRule", []):
            d = os.path.join(dump, variant)
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "prometheusrule.json"), "w") as f:
                json.dump(o, f)
    if merged["prometheusRule"]["enabled"] != bool(by_kind.get("PrometheusRule")):
        fail(variant, "prometheusRule.enabled does not match the rendered PrometheusRules")
    for o in by_kind.get("PrometheusRule", []):
        state_alert = rule_for(o, "PreheatScalerStateNotSaved") is not None
        if state_alert != bool(merged["scaler"]["state"]["enabled"]):
            fail(variant, f"PreheatScalerStateNotSaved rendered {state_alert}, scaler.state.enabled {merged['scaler']['state']['enabled']}")
    names = lambda kind: {o["metadata"]["name"] for o in by_kind.get(kind, [])}
    deployments = names("Deployment")
    services = names("Service")
    for want in ["rel-preheat-gateway", "rel-preheat-scaler"]:
        if want not in deployments:
            fail(variant, f"no Deployment {want}")
    # Least privilege: no wildcards anywhere.
    for kind in ["Role", "ClusterRole"]:
        for r in by_kind.get(kind, []):
            for rule in r.get("rules", []):
                for key in ["apiGroups", "resources", "verbs", "resourceNames"]:
                    if "*" in rule.get(key, []):
                        fail(variant, f'{kind}/{r["metadata"]["name"]} grants a wildcard in {key}')
    # The gateway finds workers through EndpointSlices: exactly list and watch on them.
    gw_role = [r for r in by_kind.get("Role", []) if r["metadata"]["name"] == "rel-preheat-gateway"]
    gw_rules = gw_role[0].get("rules") or [] if gw_role else []
    if [(r.get("apiGroups"), r.get("resources"), sorted(r.get("verbs", []))) for r in gw_rules] != [(["discovery.k8s.io"], ["endpointslices"], ["list", "watch"])]:
        fail(variant, f"gateway Role is not exactly endpointslices list/watch: {gw_rules}")
    gw_dep = [d for d in by_kind.get("Deployment", []) if d["metadata"]["name"] == "rel-preheat-gateway"]
    bindings = [b for b in by_kind.get("RoleBinding", []) if b["roleRef"]["name"] == "rel-preheat-gateway"]
    if gw_dep and not any(s["name"] == gw_dep[0]["spec"]["template"]["spec"].get("serviceAccountName") for b in bindings for s in b["subjects"]):
        fail(variant, "the gateway's service account is not bound to its Role")
    scaler_role = [r for r in by_kind.get("Role", []) if r["metadata"]["name"] == "rel-preheat-scaler"]
    if not scaler_role:
        fail(variant, "no scaler Role")
    else:
        rules = scaler_role[0].get("rules") or []
        resources = {res for rule in rules for res in rule["resources"]}
        direct = merged["scaler"]["mode"] == "direct"
        # Read in both modes (a restart holds pools at their real size), patched only
        # in direct mode, and only the two pool Deployments.
        scale_verbs = {v for rule in rules if "deployments/scale" in rule["resources"] for v in rule["verbs"]}
        want_verbs = {"get", "patch"} if direct else {"get"}
        if scale_verbs != want_verbs:
            fail(variant, f"scaler Role may {sorted(scale_verbs)} deployments/scale in mode {merged['scaler']['mode']}, want {sorted(want_verbs)}")
        for rule in rules:
            pools = sorted(f"rel-preheat{m['infix']}-{r}" for m in expected_models(merged) for r in ("prefill", "decode"))
            if "deployments/scale" in rule["resources"] and sorted(rule.get("resourceNames") or []) != pools:
                fail(variant, f"deployments/scale is not limited to the pool Deployments {pools}")
        if "pods" not in resources:
            fail(variant, "the scaler cannot find the gateway pods (held requests)")
        pod_verbs = {v for rule in rules if "pods" in rule["resources"] for v in rule["verbs"]}
        marks = bool(merged["scaler"]["podDeletionCost"]) and not merged["scaler"]["prometheus"]["url"]
        want_pod_verbs = {"list", "watch"} | ({"patch"} if marks else set())
        if pod_verbs != want_pod_verbs:
            fail(variant, f"scaler Role may {sorted(pod_verbs)} pods, want {sorted(want_pod_verbs)} (deletion cost marked: {marks})")
        cms = [c for c in by_kind.get("ConfigMap", []) if c["metadata"]["name"] == "rel-preheat-scaler"]
        cfg = yaml.safe_load(cms[0]["data"]["scaler.yaml"]) if cms else {}
        if cms and cfg.get("kubernetes", {}).get("pod_deletion_cost") is not marks:
            fail(variant, "the scaler's pod_deletion_cost does not follow scaler.podDeletionCost")
    sc_dep = [d for d in by_kind.get("Deployment", []) if d["metadata"]["name"] == "rel-preheat-scaler"]
    if sc_dep and sc_dep[0]["spec"].get("strategy", {}).get("type") != "Recreate":
        fail(variant, "the scaler's rollout can run two scalers at once (strategy is not Recreate)")
    check_security(variant, merged, by_kind)
    check_scaler_state(variant, merged, by_kind)
    tls = merged["scaler"]["tls"]
    if tls["secret"] and merged["scaler"]["mode"] == "keda":
        auth = names("TriggerAuthentication")
        for so in by_kind.get("ScaledObject", []):
            refs = [t.get("authenticationRef", {}).get("name") for t in so["spec"]["triggers"]]
            if any(r not in auth for r in refs):
                fail(variant, f'{so["metadata"]["name"]}: TLS scaler without a TriggerAuthentication')
    if tls["clientSecret"] and not tls["secret"]:
        fail(variant, "scaler.tls.clientSecret without scaler.tls.secret")
    # Workers: probes sized for loading, drain covered by the grace period, warm affinity.
    for d in by_kind.get("Deployment", []):
        pod = d["spec"]["template"]["spec"]
        for c in pod["containers"]:
            if not c.get("resources", {}).get("limits"):
                fail(variant, f'{d["metadata"]["name"]}: container {c["name"]} has no limits')
        role = d["metadata"]["labels"].get("app.kubernetes.io/component")
        if role == "gateway":
            # The gateway knows its model from the start (Ready with both pools at
            # zero) and drains held requests and streams on a rollout.
            c = pod["containers"][0]
            args = c.get("args", [])
            one = expected_models(merged)[0]
            if one["listed"]:
                pass  # check_models: each model's flag
            elif one["secret"]:
                env = {e["name"]: e for e in c.get("env", [])}
                ref = env.get("PREHEAT_MODEL_SOURCE", {}).get("valueFrom", {}).get("secretKeyRef", {})
                if ref.get("name") != one["secret"] or any(a.startswith("--model=") for a in args):
                    fail(variant, "gateway: the model source is not taken from its Secret through the environment")
            elif f'--model={one["source"]}' not in args:
                fail(variant, "gateway: not started with --model=<model.source>")
            if f'--block-size={merged["kvBlockSize"]}' not in args:
                fail(variant, "gateway: --block-size does not follow kvBlockSize")
            drain = merged["gateway"]["drainGraceSeconds"]
            if f"--drain-grace={drain}s" not in args:
                fail(variant, "gateway: --drain-grace does not follow gateway.drainGraceSeconds")
            if pod.get("terminationGracePeriodSeconds", 30) <= drain:
                fail(variant, "gateway: grace period does not cover the drain")
            if "preStop" not in c.get("lifecycle", {}):
                fail(variant, "gateway: no preStop")
        if role in ("prefill", "decode"):
            c = pod["containers"][0]
            model = d["spec"]["template"]["metadata"]["labels"].get("preheat.dev/model")
            p = next((m["pools"][role] for m in expected_models(merged) if m["name"] == model), merged[role])
            # The image runs as 65532; workers only read the node's snapshots and stay
            # non-root, the staging step too once `own` (root, CAP_CHOWN alone) gave it the
            # node directory.
            if f'--block-size={merged["kvBlockSize"]}' not in c.get("args", []):
                fail(variant, f"{role}: --block-size does not follow kvBlockSize")
            psc = pod.get("securityContext", {})
            if not psc.get("runAsNonRoot") or psc.get("runAsUser", 0) == 0:
                fail(variant, f"{role}: workers do not run as a non-root user")
            check_own_then_non_root(variant, role, pod)
            if "startupProbe" not in c:
                fail(variant, f"{role}: no startupProbe")
            else:
                sp = c["startupProbe"]
                if sp["periodSeconds"] * sp["failureThreshold"] < p["startupSeconds"]:
                    fail(variant, f"{role}: startupProbe shorter than startupSeconds")
            if "preStop" not in c.get("lifecycle", {}):
                fail(variant, f"{role}: no preStop")
            if pod.get("terminationGracePeriodSeconds", 30) <= p["drainGraceSeconds"]:
                fail(variant, f"{role}: termination grace does not cover the drain")
            if "nvidia.com/gpu" not in c["resources"]["limits"]:
                fail(variant, f"{role}: no GPU limit")
            if merged["preferWarmNodes"] and "affinity" not in pod:
                fail(variant, f"{role}: no warm-node affinity")
    # KEDA: one ScaledObject per pool pointing at real objects.
    if merged["scaler"]["mode"] == "keda":
        sos = by_kind.get("ScaledObject", [])
        want = sorted(f"rel-preheat{m['infix']}-{r}" for m in expected_models(merged) for r in ("prefill", "decode"))
        if sorted(o["metadata"]["name"] for o in sos) != want:
            fail(variant, f"expected one ScaledObject per pool of every model: {want}")
        for so in sos:
            spec = so["spec"]
            if spec["scaleTargetRef"]["name"] not in deployments:
                fail(variant, f"{so['metadata']['name']} targets a missing Deployment")
            model = next(m for m in expected_models(merged) if m["name"] == so["spec"]["triggers"][0]["metadata"]["model"])
            want_min = 0 if merged["scaleToZero"] else model["pools"][so["metadata"]["labels"]["app.kubernetes.io/component"]]["minReplicas"]
            if spec["minReplicaCount"] != want_min:
                fail(variant, f"{so['metadata']['name']}: minReplicaCount {spec['minReplicaCount']} != {want_min}")
            trig = spec["triggers"][0]
            if trig["type"] != "external-push":
                fail(variant, "trigger is not external-push")
            svc = trig["metadata"]["scalerAddress"].split(".")[0]
            if svc not in services:
                fail(variant, f"scalerAddress names no Service ({svc})")
            if trig["metadata"]["pool"] not in ("prefill", "decode"):
                fail(variant, "trigger has no pool")
            # A scaler outage never shrinks a serving pool: KEDA feeds HPA
            # max(current, floor) instead of a fixed count.
            fb = spec.get("fallback")
            if merged["keda"]["fallback"]["enabled"]:
                if not fb or fb.get("behavior") != "currentReplicasIfHigher" or fb.get("replicas", 0) < 1:
                    fail(variant, f"{so['metadata']['name']}: fallback {fb} does not hold pools at their size")
            elif fb:
                fail(variant, "fallback rendered while keda.fallback.enabled is false")
            beh = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
            if "tolerance" not in beh["scaleUp"] or "tolerance" not in beh["scaleDown"]:
                fail(variant, "HPA tolerance not set")
    elif by_kind.get("ScaledObject"):
        fail(variant, "ScaledObjects rendered in direct mode")
    for ds in by_kind.get("DaemonSet", []):
        pod = ds["spec"]["template"]["spec"]
        check_own_then_non_root(variant, "agent", pod)
        sc = pod["containers"][0].get("securityContext", {})
        root = sc.get("runAsUser") == 0
        if root != bool(merged["warmpool"]["mlock"]):
            fail(variant, f"agent: root {root} with mlock {merged['warmpool']['mlock']} (root only to pin pages)")
        if not root and not sc.get("runAsNonRoot"):
            fail(variant, "agent: runAsNonRoot not set")
    for ds in by_kind.get("DaemonSet", []):
        args = ds["spec"]["template"]["spec"]["containers"][0]["args"]
        if f'--listen=$(POD_IP):{merged["warmpool"]["port"]}' not in args:
            fail(variant, "agent: its API is not bound to the pod IP")
    if merged["warmpool"]["enabled"] != bool(by_kind.get("DaemonSet")):
        fail(variant, "warm-pool DaemonSet does not follow warmpool.enabled")
    # Standbys: the agent parks them (at its pod IP), the gateway lists the serving
    # ones from the agents, the scaler promotes and retires them, and the agent's
    # grace covers their drain.
    models = expected_models(merged)
    want_sb = merged["warmpool"]["enabled"] and any(m["standbys"]["prefill"] > 0 or m["standbys"]["decode"] > 0 for m in models)
    cms = {cm["metadata"]["name"]: cm for cm in by_kind.get("ConfigMap", [])}
    agent_cfg = yaml.safe_load(cms["rel-preheat-warmpool"]["data"]["warmpool.yaml"]) if "rel-preheat-warmpool" in cms else {}
    scaler_cfg = yaml.safe_load(cms["rel-preheat-scaler"]["data"]["scaler.yaml"])
    gw_args = gw_dep[0]["spec"]["template"]["spec"]["containers"][0].get("args", []) if gw_dep else []
    has = {
        "agent standbys": bool(agent_cfg.get("standbys")),
        "gateway --standby-agents-service": "--standby-agents-service=rel-preheat-warmpool" in gw_args,
        "scaler standbys": any(m.get("standbys") for m in scaler_cfg["models"]),
    }
    for what, present in has.items():
        if present != want_sb:
            fail(variant, f"{what} {'missing' if want_sb else 'rendered'} with standbys {[m['standbys'] for m in models]}")
    check_models(variant, merged, by_kind)
    if want_sb:
        for s_ in agent_cfg["standbys"]:
            cmd = s_["command"]
            for want in ["--standby", "--port={port}", "--advertise=http://{host}:{port}", f'--block-size={merged["kvBlockSize"]}']:
                if want not in cmd:
                    fail(variant, f"standby {s_['pool']}: command lacks {want}")
        ds = by_kind["DaemonSet"][0]
        pod = ds["spec"]["template"]["spec"]
        labels = ds["spec"]["template"]["metadata"]["labels"]
        sel = next(m["standbys"] for m in scaler_cfg["models"] if m.get("standbys"))["agent_selector"]
        if not all(labels.get(k) == v for k, v in (kv.split("=") for kv in sel.split(","))):
            fail(variant, f"scaler agent_selector {sel} does not select the agent pods")
        if "--advertise-host=$(POD_IP)" not in pod["containers"][0]["args"]:
            fail(variant, "agent: standbys not advertised at the pod IP")
        for s_ in agent_cfg["standbys"]:
            need = s_["drain_grace_s"] + s_.get("unlist_delay_s", 5)
            role = s_["command"][2]
            p = next(m["pools"][role] for m in models if m["name"] == s_["model"])
            if s_["drain_grace_s"] != p["drainGraceSeconds"]:
                fail(variant, f"standby {s_['pool']}: drains for {s_['drain_grace_s']} s, its pool's pods for {p['drainGraceSeconds']} s")
            if pod.get("terminationGracePeriodSeconds", 30) <= need:
                fail(variant, f"agent: grace period does not cover the {s_['pool']} standbys' unlisting and drain ({need} s)")
            if any(a not in s_["command"] for a in p.get("extraArgs", [])):
                fail(variant, f"standby {s_['pool']}: the pool's extraArgs are missing")
    # The scaler's config parses as YAML and names both pools; with --dump, every
    # config file is written out for the Rust side to parse with the real parsers.
    for cm in by_kind.get("ConfigMap", []):
        for k, v in cm.get("data", {}).items():
            parsed = yaml.safe_load(v)
            if dump:
                d = os.path.join(dump, variant)
                os.makedirs(d, exist_ok=True)
                with open(os.path.join(d, k), "w") as f:
                    f.write(v)
            if k == "scaler.yaml" and any(not {"prefill", "decode"} <= set(m) for m in parsed["models"]):
                fail(variant, "scaler config misses a pool")
    return len(objs)


# The one-model form, as `helm install --set model.source=…` gives it.
ONE_MODEL = {"model": {"source": "https://models.example.com/llama-1b.phpack"}}

# Values the chart refuses (values.schema.json, or the chart's own checks where JSON
# Schema cannot say it), each with what the refusal must name.
REFUSED = [
    ({}, "/model"),
    ({"model": {"source": "https://x/a.phpack"}, "models": [{"name": "b", "source": "https://x/b.phpack"}]}, "/model/source"),
    ({"models": [{"name": "a", "source": "https://x/a.phpack"}, {"name": "a", "source": "https://x/b.phpack"}]}, '"a" appears twice'),
    ({"models": [{"name": "Llama_8B", "source": "https://x/a.phpack"}]}, "/models/0/name"),
    ({"models": [{"name": "a", "source": "https://x/a.phpack", "decode": {"maxReplica": 3}}]}, "'maxReplica' not allowed"),
    ({"models": [{"name": "a", "source": "https://x/a.phpack", "prefill": {"port": 9000}}]}, "'port' not allowed"),
    ({"model": {"source": "https://x/a.phpack"}, "warmpool": {"standbys": {"budgt": 2}}}, "'budgt' not allowed"),
    ({"model": {"source": "https://x/a.phpack"}, "warmpool": {"diskBudget": 200000000000}}, "/warmpool/diskBudget"),
    ({"model": {"source": "https://x/a.phpack"}, "decode": {"maxReplica": 3}}, "'maxReplica' not allowed"),
    ({"models": [{"name": "a", "source": "https://x/a.phpack", "sourceSecret": {"name": "s"}}]}, "/models/0"),
    ({"models": [{"name": "a"}]}, "/models/0"),
    ({"models": [{"name": "a" * 60, "source": "https://x/a.phpack"}]}, "longer than 63"),
    ({"model": {"sourceSecret": {"name": "s", "key": "url"}}}, "model.name is required"),
    ({"model": {"source": "https://x/a.phpack"}, "modles": []}, "modles"),
    # `--set-string` would turn it on in the Role while the config read "false".
    ({"model": {"source": "https://x/a.phpack"}, "scaler": {"podDeletionCost": "false"}}, "podDeletionCost"),
]


def check_refused():
    chart = helm_python.Chart.load(CHART)
    for values, needle in REFUSED:
        try:
            chart.render(values, name="rel", namespace="llm", is_install=True)
        except Exception as e:  # the SDK raises its Go error as one exception type
            if needle not in str(e):
                fail("refused", f"{json.dumps(values)[:120]}: refused without naming {needle!r}: {e}")
            continue
        fail("refused", f"{json.dumps(values)[:120]}: rendered, should be refused naming {needle!r}")


def main():
    dump = sys.argv[2] if len(sys.argv) > 2 and sys.argv[1] == "--dump" else None
    lint = helm_python.lint(CHART, ONE_MODEL, strict=True, kube_version="v" + KUBE_VERSION)
    for m in lint.get("messages", []):
        # 1 = info (e.g. "icon is recommended"); warnings and errors fail.
        if m.get("severity", 0) > 1:
            fail("lint", f'{m.get("path")}: {m.get("error")}')
    for e in lint.get("errors", []):
        fail("lint", str(e))
    check_refused()
    schema = keda_schema()
    with open(os.path.join(CHART, "values.yaml")) as f:
        defaults = yaml.safe_load(f)
    variants = [("default", ONE_MODEL)]
    for p in sorted(glob.glob(os.path.join(CHART, "ci", "*-values.yaml"))):
        with open(p) as f:
            variants.append((os.path.basename(p), yaml.safe_load(f) or {}))
    total = 0
    for name, values in variants:
        lint_v = helm_python.lint(CHART, values, strict=True, kube_version="v" + KUBE_VERSION)
        for e in lint_v.get("errors", []):
            fail(name, f"lint: {e}")
        total += check_variant(name, values, defaults, schema, dump)
    if problems:
        print("\n".join(problems))
        return 1
    print(f"chart ok: {len(variants)} variants, {total} objects validated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
