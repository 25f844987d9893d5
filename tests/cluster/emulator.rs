//! A small Kubernetes for the chart as rendered: every Deployment and DaemonSet runs as
//! Docker containers of the image `.ci/image` builds, on a private network, with exactly
//! its rendered args, env, security context and volumes; init containers first;
//! startup, readiness and liveness probes as rendered; preStop and the termination grace
//! period on every stop; Services that route only to Ready pods; and an API server that
//! serves what the components read (pods and EndpointSlices, list and watch; the
//! Deployments' scale subresource; pods' annotations, patched). A scale-down picks its
//! pods as a ReplicaSet does: not ready, then the lowest deletion cost, then the newest.
//!
//! What it does not emulate, and why that is fine for what the cluster run proves: no
//! scheduler resources (GPU requests are ignored; pods go round-robin over the nodes),
//! no DNS (nothing in the chart resolves a name in a pod any more; Services are reached
//! by the emulator itself, for clients and for KEDA), and the service account's
//! in-cluster credentials are a kubeconfig naming this API server (mounted where the
//! chart automounts a token).
//!
//! Why one file over 600 lines: it is one emulator (pods, probes, Services and the API
//! server share its state and lock), and splitting it would spread that state across files.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

pub const NS: &str = "llm";

/// One pod: a container (after its init containers) on a node.
#[derive(Clone, Debug)]
pub struct Pod {
    pub name: String,
    /// The Deployment or DaemonSet it belongs to.
    pub owner: String,
    pub labels: BTreeMap<String, String>,
    pub ip: String,
    pub node: String,
    /// Container started (init containers done).
    pub running: bool,
    /// The startup probe passed (or there is none).
    pub started: bool,
    pub ready: bool,
    pub terminating: bool,
    pub restarts: u32,
    /// Annotations set through the API (the scaler's deletion cost).
    pub annotations: BTreeMap<String, String>,
    spec: Value,
    created: Instant,
    /// Next probe time and consecutive failures, by probe kind.
    probes: HashMap<&'static str, (Instant, u32)>,
}

#[derive(Default)]
pub struct State {
    pub objects: Vec<Value>,
    /// Deployment → replicas (the scale subresource).
    pub scale: BTreeMap<String, i64>,
    /// Every replica count set, in order, by whom.
    pub scale_history: Vec<(String, i64, &'static str)>,
    pub pods: BTreeMap<String, Pod>,
    /// Pods that exited for good (name, owner).
    pub gone: Vec<(String, String)>,
    /// Pods a rollout added past the replica count (its surge): the controller does
    /// not count them until the pod they replace is gone.
    pub surge: std::collections::HashSet<String>,
    /// Every pod a scale-down removed: (pod, owner, its deletion cost, the costs of
    /// the ready pods it left), as the controller saw them when it picked.
    pub scaled_away: Vec<ScaledAway>,
}

/// A pod a Deployment's scale-down picked to remove.
#[derive(Clone, Debug)]
pub struct ScaledAway {
    pub pod: String,
    pub owner: String,
    pub ready: bool,
    pub cost: Option<i32>,
    /// The deletion costs of the ready pods that stayed.
    pub kept: Vec<Option<i32>>,
}

/// A pod's `controller.kubernetes.io/pod-deletion-cost`: `None` when unset or
/// unreadable, which the ReplicaSet controller reads as 0.
pub fn deletion_cost(p: &Pod) -> Option<i32> {
    p.annotations
        .get("controller.kubernetes.io/pod-deletion-cost")
        .and_then(|c| c.parse().ok())
}

pub type Shared = Arc<Mutex<State>>;

/// The emulated cluster. Dropping it removes every container and the network.
pub struct Cluster {
    pub state: Shared,
    pub dir: tempfile::TempDir,
    pub net: String,
    /// `10.x.y` prefix of the private network (`10.<slot>.0` unless that was taken);
    /// the host is `.1`.
    pub prefix: String,
    pub nodes: Vec<String>,
    pub api_url: String,
    image: String,
    next_ip: AtomicU64,
    next_pod: AtomicU64,
    stop: Arc<std::sync::atomic::AtomicBool>,
    pub rt: tokio::runtime::Handle,
    /// Shut down in the background on drop: the last handle may go inside one of its
    /// own tasks, where a runtime cannot be dropped.
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
}

fn docker(args: &[&str]) -> std::process::Output {
    Command::new("docker")
        .args(args)
        .output()
        .expect("run docker")
}

/// Creates the bridge network `net` on `10.<subnet>.0.0/24`, or, when something else
/// on this Docker engine (another job's network) already holds that range, on the
/// first free `10.x.y.0/24` from 10.200.0.0 up; returns its `10.x.y` prefix.
fn create_network(net: &str, subnet: u8) -> String {
    let preferred = format!("10.{subnet}.0");
    let mut taken: Vec<(u32, u32)> = Vec::new();
    for attempt in 0..8 {
        let prefix = if attempt == 0 {
            preferred.clone()
        } else {
            taken.extend(docker_subnets());
            free_prefix(&taken, subnet)
                .unwrap_or_else(|| panic!("no free 10.x.y.0/24 for {net} (taken: {taken:?})"))
        };
        let cidr = format!("{prefix}.0/24");
        let out = docker(&["network", "create", "--subnet", &cidr, net]);
        if out.status.success() {
            if attempt > 0 {
                eprintln!("{net}: {preferred}.0/24 was taken on this Docker engine; using {cidr}");
            }
            return prefix;
        }
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("overlaps"),
            "docker network create --subnet {cidr} {net}: {err}"
        );
        // Taken between our listing and our create (or by a range docker does not
        // list): skip it on the next pass.
        taken.extend(parse_cidr(&cidr));
    }
    panic!("docker network create {net}: every subnet tried overlapped another network");
}

/// The IPv4 ranges of every network on this Docker engine, as (base, mask).
fn docker_subnets() -> Vec<(u32, u32)> {
    let ids = docker(&["network", "ls", "-q"]);
    let ids: Vec<String> = String::from_utf8_lossy(&ids.stdout)
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    if ids.is_empty() {
        return Vec::new();
    }
    let mut args = vec![
        "network",
        "inspect",
        "--format",
        "{{range .IPAM.Config}}{{.Subnet}} {{end}}",
    ];
    args.extend(ids.iter().map(String::as_str));
    let out = docker(&args);
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(parse_cidr)
        .collect()
}

/// `a.b.c.d/n` as (base, mask); `None` for IPv6 or anything malformed.
fn parse_cidr(cidr: &str) -> Option<(u32, u32)> {
    let (addr, len) = cidr.split_once('/')?;
    let addr: std::net::Ipv4Addr = addr.parse().ok()?;
    let len: u32 = len.parse().ok().filter(|l| *l <= 32)?;
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    Some((u32::from(addr) & mask, mask))
}

/// The first `10.x.y` (x from 200, starting at this test's slot) whose /24 overlaps
/// none of `taken`.
fn free_prefix(taken: &[(u32, u32)], subnet: u8) -> Option<String> {
    let start = u32::from(subnet.max(200));
    (start..=254)
        .chain(200..start)
        .flat_map(|x| (1..=255u32).map(move |y| (x, y)))
        .find(|&(x, y)| {
            let base = (10 << 24) | (x << 16) | (y << 8);
            let mask = u32::MAX << 8;
            // Two ranges overlap when either contains the other's base.
            taken
                .iter()
                .all(|&(b, m)| base & m != b && b & mask != base)
        })
        .map(|(x, y)| format!("10.{x}.{y}"))
}

fn labels_of(v: &Value) -> BTreeMap<String, String> {
    v.as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                .collect()
        })
        .unwrap_or_default()
}

/// `k=v,k2=v2` equality selectors, as the components send them.
pub fn matches(selector: &str, labels: &BTreeMap<String, String>) -> bool {
    selector
        .split(',')
        .filter(|s| !s.is_empty())
        .all(|kv| match kv.split_once('=') {
            Some((k, v)) => labels.get(k.trim()).is_some_and(|l| l == v.trim()),
            None => false,
        })
}

impl Cluster {
    /// Creates the network and the API server of an empty cluster of `nodes` nodes.
    pub fn install(image: &str, nodes: usize, subnet: u8) -> Cluster {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let net = format!("preheat-cluster-{}-{subnet}", std::process::id());
        // What an earlier run left on this slot (a killed test process): only a dead
        // process's, never a concurrent run's on a shared Docker engine.
        let nets = docker(&["network", "ls", "--format", "{{.Name}}"]);
        for old in String::from_utf8_lossy(&nets.stdout).lines() {
            let owner = old
                .strip_prefix("preheat-cluster-")
                .and_then(|r| r.strip_suffix(&format!("-{subnet}")))
                .and_then(|pid| pid.parse::<u32>().ok());
            let dead = owner.is_some_and(|pid| {
                pid == std::process::id() || !std::path::Path::new(&format!("/proc/{pid}")).exists()
            });
            if dead {
                remove_containers(old);
                let _ = docker(&["network", "rm", old]);
            }
        }
        let prefix = create_network(&net, subnet);
        let state = Shared::default();
        let host = format!("{prefix}.1");
        let api_url = rt.block_on(super::api::serve(Arc::clone(&state), &host));
        let c = Cluster {
            state,
            dir,
            net,
            prefix,
            nodes: (1..=nodes).map(|i| format!("node-{i}")).collect(),
            api_url,
            image: image.to_owned(),
            next_ip: AtomicU64::new(10),
            next_pod: AtomicU64::new(0),
            stop: Arc::default(),
            rt: rt.handle().clone(),
            runtime: Mutex::new(Some(rt)),
        };
        std::fs::write(
            c.dir.path().join("kubeconfig"),
            format!(
                "apiVersion: v1\nkind: Config\nclusters: [{{name: c, cluster: {{server: \"{}\"}}}}]\nusers: [{{name: u, user: {{}}}}]\ncontexts: [{{name: c, context: {{cluster: c, user: u, namespace: {NS}}}}}]\ncurrent-context: c\n",
                c.api_url
            ),
        )
        .unwrap();
        c
    }

    /// Applies rendered `objects`: Deployments start at their rendered replicas,
    /// DaemonSets on every node (once [`Cluster::start`] runs the controllers).
    pub fn apply(&self, objects: Vec<Value>) {
        let mut s = self.state.lock().unwrap();
        for o in &objects {
            if o["kind"] == "Deployment" {
                let name = o["metadata"]["name"].as_str().unwrap().to_owned();
                let r = o["spec"]["replicas"].as_i64().unwrap_or(1);
                s.scale.insert(name.clone(), r);
                s.scale_history.push((name, r, "install"));
            }
        }
        s.objects = objects;
    }

    /// The Docker name of a pod's container: unique across clusters of one run.
    fn cname(&self, pod: &str) -> String {
        format!("{}-{pod}", self.net)
    }

    /// Whether the cluster holds object `kind`/`name`.
    pub fn has(&self, kind: &str, name: &str) -> bool {
        let s = self.state.lock().unwrap();
        s.objects
            .iter()
            .any(|o| o["kind"] == kind && o["metadata"]["name"] == name)
    }

    /// `helm upgrade` to `objects`. The cluster token Secret is kept (the chart's
    /// `lookup` keeps it in a cluster; rendered off one it would be new). A Deployment
    /// gone has its pods terminated, each draining as on a scale-down; a new one starts
    /// at its rendered replicas; one whose pod template changed is rolled out (one pod
    /// at a time, the old one terminated once its replacement is Ready); a changed
    /// DaemonSet's pods are replaced node by node. Returns once every rollout is done.
    pub fn upgrade(self: &Arc<Self>, mut objects: Vec<Value>, timeout: Duration) {
        let old = self.state.lock().unwrap().objects.clone();
        let by_kind = |list: &[Value], kind: &str| -> BTreeMap<String, Value> {
            list.iter()
                .filter(|o| o["kind"] == kind)
                .map(|o| {
                    (
                        o["metadata"]["name"].as_str().unwrap().to_owned(),
                        o.clone(),
                    )
                })
                .collect()
        };
        let old_secrets = by_kind(&old, "Secret");
        for o in &mut objects {
            if o["kind"] == "Secret"
                && let Some(prev) = o["metadata"]["name"]
                    .as_str()
                    .and_then(|n| old_secrets.get(n))
            {
                *o = prev.clone();
            }
        }
        let (old_d, new_d) = (by_kind(&old, "Deployment"), by_kind(&objects, "Deployment"));
        let (old_ds, new_ds) = (by_kind(&old, "DaemonSet"), by_kind(&objects, "DaemonSet"));
        {
            let mut s = self.state.lock().unwrap();
            for (name, d) in &new_d {
                if !old_d.contains_key(name) {
                    let r = d["spec"]["replicas"].as_i64().unwrap_or(1);
                    s.scale.insert(name.clone(), r);
                    s.scale_history.push((name.clone(), r, "upgrade"));
                }
            }
            s.objects = objects;
        }
        for name in old_d.keys().filter(|n| !new_d.contains_key(*n)) {
            for p in self.pods_of(name) {
                self.terminate(&p.name);
            }
        }
        for (name, d) in &new_d {
            if old_d
                .get(name)
                .is_some_and(|o| o["spec"]["template"] != d["spec"]["template"])
            {
                self.rollout(name, timeout);
            }
        }
        for (name, d) in &new_ds {
            if old_ds
                .get(name)
                .is_some_and(|o| o["spec"]["template"] != d["spec"]["template"])
            {
                for p in self.pods_of(name) {
                    // The controller starts its replacement on the node at once.
                    self.terminate(&p.name);
                    preheat_testkit::wait_for(
                        format!("upgrade: a new {name} pod Ready on {}", p.node),
                        timeout,
                        || {
                            self.pods_of(name)
                                .iter()
                                .any(|q| q.node == p.node && q.name != p.name && q.ready)
                        },
                    );
                }
            }
        }
    }

    pub fn object(&self, kind: &str, name: &str) -> Value {
        let s = self.state.lock().unwrap();
        s.objects
            .iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no {kind} {name}"))
    }

    /// A key of a rendered Secret, decoded.
    pub fn secret(&self, name: &str, key: &str) -> Vec<u8> {
        let obj = self.object("Secret", name);
        base64_decode(
            obj["data"][key]
                .as_str()
                .unwrap_or_else(|| panic!("no {key} in {name}")),
        )
    }

    pub fn scale(&self, deployment: &str) -> i64 {
        self.state.lock().unwrap().scale[deployment]
    }

    /// Ready pod IPs of an owner.
    pub fn ready(&self, owner: &str) -> Vec<String> {
        let s = self.state.lock().unwrap();
        s.pods
            .values()
            .filter(|p| p.owner == owner && p.ready && !p.terminating)
            .map(|p| p.ip.clone())
            .collect()
    }

    pub fn pods_of(&self, owner: &str) -> Vec<Pod> {
        let s = self.state.lock().unwrap();
        s.pods
            .values()
            .filter(|p| p.owner == owner)
            .cloned()
            .collect()
    }

    /// Runs the kubelet and controllers until the cluster is dropped.
    pub fn start(self: &Arc<Self>) {
        let c = Arc::clone(self);
        std::thread::spawn(move || {
            while !c.stop.load(Ordering::SeqCst) {
                c.reconcile();
                c.probe();
                // Deliberate: the controllers' loop period, not a wait for anything.
                std::thread::sleep(Duration::from_millis(200));
            }
        });
    }

    fn reconcile(self: &Arc<Self>) {
        let (deploys, daemons) = {
            let s = self.state.lock().unwrap();
            let kind = |k: &str| -> Vec<Value> {
                s.objects
                    .iter()
                    .filter(|o| o["kind"] == k)
                    .cloned()
                    .collect()
            };
            (kind("Deployment"), kind("DaemonSet"))
        };
        for d in deploys {
            let name = d["metadata"]["name"].as_str().unwrap().to_owned();
            let (want, live) = {
                let s = self.state.lock().unwrap();
                let live: Vec<Pod> = s
                    .pods
                    .values()
                    .filter(|p| p.owner == name && !p.terminating && !s.surge.contains(&p.name))
                    .cloned()
                    .collect();
                (s.scale[&name].max(0) as usize, live)
            };
            for i in live.len()..want {
                let node = self.nodes
                    [(self.next_pod.load(Ordering::SeqCst) as usize + i) % self.nodes.len()]
                .clone();
                let _ = self.create_pod(&d, &name, &node);
            }
            if live.len() > want {
                // Not-Ready first, then the lowest deletion cost, then the newest, as
                // a ReplicaSet picks.
                let extra = live.len() - want;
                let mut victims = live;
                victims.sort_by_key(|p| {
                    (
                        p.ready,
                        deletion_cost(p).unwrap_or(0),
                        std::cmp::Reverse(p.created),
                    )
                });
                let kept: Vec<Option<i32>> = victims[extra..]
                    .iter()
                    .filter(|p| p.ready)
                    .map(deletion_cost)
                    .collect();
                for p in victims.into_iter().take(extra) {
                    self.state.lock().unwrap().scaled_away.push(ScaledAway {
                        pod: p.name.clone(),
                        owner: p.owner.clone(),
                        ready: p.ready,
                        cost: deletion_cost(&p),
                        kept: kept.clone(),
                    });
                    self.terminate(&p.name);
                }
            }
        }
        for d in daemons {
            let name = d["metadata"]["name"].as_str().unwrap().to_owned();
            for node in self.nodes.clone() {
                let has = {
                    let s = self.state.lock().unwrap();
                    s.pods
                        .values()
                        .any(|p| p.owner == name && p.node == node && !p.terminating)
                };
                if !has {
                    let _ = self.create_pod(&d, &name, &node);
                }
            }
        }
    }

    /// Replaces every pod of `owner` (a rollout with maxSurge 0: one at a time, the old
    /// pod terminated once its replacement is Ready).
    pub fn rollout(self: &Arc<Self>, owner: &str, timeout: Duration) {
        let old: Vec<String> = self.pods_of(owner).into_iter().map(|p| p.name).collect();
        for name in old {
            let d = self.object("Deployment", owner);
            let node = self.state.lock().unwrap().pods[&name].node.clone();
            let before = self.ready(owner).len();
            // Surge one, wait for it to be Ready, then retire the old one.
            let new = self.create_pod(&d, owner, &node);
            self.state.lock().unwrap().surge.insert(new.clone());
            let ready =
                preheat_testkit::Wait::new(format!("rollout: the new {owner} pod Ready"), timeout)
                    .poll(|| {
                        if self.ready(owner).len() > before {
                            Ok(())
                        } else {
                            Err(format!("ready {:?}", self.ready(owner)))
                        }
                    });
            if let Err(e) = ready {
                let logs: Vec<String> = self
                    .pods_of(owner)
                    .iter()
                    .filter(|p| p.name != name)
                    .map(|p| format!("{}: {}", p.name, self.all_logs(&p.name)))
                    .collect();
                panic!("{e}\n{}", logs.join("\n---\n"));
            }
            self.terminate(&name);
            // The old pod is terminating (out of the count): the new one takes its place.
            self.state.lock().unwrap().surge.remove(&new);
        }
    }

    /// Starts a pod of `d` on `node`; its name.
    fn create_pod(self: &Arc<Self>, d: &Value, owner: &str, node: &str) -> String {
        let n = self.next_pod.fetch_add(1, Ordering::SeqCst);
        let ip = format!(
            "{}.{}",
            self.prefix,
            self.next_ip.fetch_add(1, Ordering::SeqCst)
        );
        let name = format!("{owner}-{n}");
        let spec = d["spec"]["template"]["spec"].clone();
        let pod = Pod {
            name: name.clone(),
            owner: owner.to_owned(),
            labels: labels_of(&d["spec"]["template"]["metadata"]["labels"]),
            ip: ip.clone(),
            node: node.to_owned(),
            running: false,
            started: false,
            ready: false,
            terminating: false,
            restarts: 0,
            annotations: BTreeMap::new(),
            spec: spec.clone(),
            created: Instant::now(),
            probes: HashMap::new(),
        };
        self.state.lock().unwrap().pods.insert(name.clone(), pod);
        let pod_name = name.clone();
        let c = Arc::clone(self);
        let node = node.to_owned();
        std::thread::spawn(move || {
            for init in spec["initContainers"]
                .as_array()
                .cloned()
                .unwrap_or_default()
            {
                if c.stopped() {
                    return;
                }
                let args = c.run_args(&name, &spec, &init, &ip, &node, true);
                let out = Command::new("docker").args(&args).output().unwrap();
                if !out.status.success() {
                    eprintln!(
                        "[cluster] {name}: init {} failed: {}",
                        init["name"],
                        String::from_utf8_lossy(&out.stderr)
                    );
                    let mut s = c.state.lock().unwrap();
                    if let Some(p) = s.pods.remove(&name) {
                        s.gone.push((p.name, p.owner));
                    }
                    return;
                }
            }
            let main = spec["containers"][0].clone();
            if c.stopped() {
                return;
            }
            let args = c.run_args(&name, &spec, &main, &ip, &node, false);
            let out = Command::new("docker").args(&args).output().unwrap();
            let mut s = c.state.lock().unwrap();
            if let Some(p) = s.pods.get_mut(&name) {
                if out.status.success() {
                    p.running = true;
                    p.started = main.get("startupProbe").is_none();
                } else {
                    eprintln!("[cluster] {name}: {}", String::from_utf8_lossy(&out.stderr));
                }
            }
        });
        pod_name
    }

    /// `docker run` arguments for one container of a pod, as the kubelet would start it.
    fn run_args(
        &self,
        pod: &str,
        spec: &Value,
        ctr: &Value,
        ip: &str,
        node: &str,
        init: bool,
    ) -> Vec<String> {
        let cname = ctr["name"].as_str().unwrap();
        let mut a: Vec<String> = vec!["run".into()];
        if init {
            a.extend([
                "--rm".into(),
                "--name".into(),
                format!("{}-init-{cname}", self.cname(pod)),
            ]);
            a.extend(["--network".into(), self.net.clone()]);
        } else {
            a.extend(["-d".into(), "--name".into(), self.cname(pod)]);
            a.extend([
                "--network".into(),
                self.net.clone(),
                "--ip".into(),
                ip.to_owned(),
            ]);
        }
        // Security context: the container's over the pod's; the image's user otherwise.
        let psc = &spec["securityContext"];
        let sc = &ctr["securityContext"];
        let user = sc["runAsUser"]
            .as_i64()
            .or_else(|| psc["runAsUser"].as_i64());
        let non_root = sc["runAsNonRoot"]
            .as_bool()
            .or_else(|| psc["runAsNonRoot"].as_bool());
        if non_root == Some(true) && user == Some(0) {
            panic!("{pod}/{cname}: runAsNonRoot with runAsUser 0 is refused by the kubelet");
        }
        if let Some(u) = user {
            a.extend(["--user".into(), format!("{u}:{u}")]);
        }
        if sc["readOnlyRootFilesystem"].as_bool() == Some(true) {
            a.push("--read-only".into());
        }
        if sc["allowPrivilegeEscalation"].as_bool() == Some(false) {
            a.extend(["--security-opt".into(), "no-new-privileges".into()]);
        }
        for cap in sc["capabilities"]["drop"].as_array().into_iter().flatten() {
            a.extend(["--cap-drop".into(), cap.as_str().unwrap().to_owned()]);
        }
        for cap in sc["capabilities"]["add"].as_array().into_iter().flatten() {
            a.extend(["--cap-add".into(), cap.as_str().unwrap().to_owned()]);
        }
        // Env, with the downward API.
        let mut env: Vec<(String, String)> = Vec::new();
        for e in ctr["env"].as_array().into_iter().flatten() {
            let name = e["name"].as_str().unwrap().to_owned();
            let value = match e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                Some("status.podIP") => ip.to_owned(),
                Some("spec.nodeName") => node.to_owned(),
                Some("metadata.name") => pod.to_owned(),
                Some(other) => panic!("fieldRef {other} not emulated"),
                None => e["value"].as_str().unwrap_or_default().to_owned(),
            };
            env.push((name, value));
        }
        // The service account's credentials: a kubeconfig for this API server.
        let automount = spec["automountServiceAccountToken"]
            .as_bool()
            .unwrap_or(true);
        if automount && spec.get("serviceAccountName").is_some() {
            a.extend([
                "-v".into(),
                format!(
                    "{}:/var/run/preheat-kubeconfig:ro",
                    self.dir.path().join("kubeconfig").display()
                ),
            ]);
            env.push(("KUBECONFIG".into(), "/var/run/preheat-kubeconfig".into()));
        }
        for (k, v) in &env {
            a.extend(["-e".into(), format!("{k}={v}")]);
        }
        // Volumes.
        let volumes: HashMap<String, Value> = spec["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|v| (v["name"].as_str().unwrap().to_owned(), v.clone()))
            .collect();
        for m in ctr["volumeMounts"].as_array().into_iter().flatten() {
            let v = &volumes[m["name"].as_str().unwrap()];
            let src = self.volume_dir(pod, node, v);
            let ro = if m["readOnly"].as_bool() == Some(true) {
                ":ro"
            } else {
                ""
            };
            a.extend([
                "-v".into(),
                format!("{}:{}{ro}", src.display(), m["mountPath"].as_str().unwrap()),
            ]);
        }
        a.push(ctr["image"].as_str().unwrap_or(&self.image).to_owned());
        let expand = |s: &str| {
            let mut s = s.to_owned();
            for (k, v) in &env {
                s = s.replace(&format!("$({k})"), v);
            }
            s
        };
        assert!(
            ctr.get("command").is_none(),
            "{pod}: command not emulated (the image's entrypoint runs the args)"
        );
        a.extend(
            ctr["args"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|x| expand(x.as_str().unwrap())),
        );
        a
    }

    /// The host directory behind a volume: hostPaths per node (shared by that node's
    /// pods), ConfigMaps and Secrets as files, PersistentVolumeClaims per claim,
    /// emptyDirs per pod.
    fn volume_dir(&self, pod: &str, node: &str, v: &Value) -> PathBuf {
        let root = self.dir.path();
        if let Some(hp) = v["hostPath"]["path"].as_str() {
            let d = root
                .join("nodes")
                .join(node)
                .join(hp.trim_start_matches('/'));
            std::fs::create_dir_all(&d).unwrap();
            return d;
        }
        if let Some(cm) = v["configMap"]["name"].as_str() {
            let obj = self.object("ConfigMap", cm);
            let d = root.join("configmaps").join(cm);
            std::fs::create_dir_all(&d).unwrap();
            for (k, text) in obj["data"].as_object().into_iter().flatten() {
                std::fs::write(d.join(k), text.as_str().unwrap()).unwrap();
            }
            return d;
        }
        if let Some(name) = v["secret"]["secretName"].as_str() {
            let obj = self.object("Secret", name);
            let d = root.join("secrets").join(name);
            std::fs::create_dir_all(&d).unwrap();
            for (k, b64) in obj["data"].as_object().into_iter().flatten() {
                std::fs::write(d.join(k), base64_decode(b64.as_str().unwrap())).unwrap();
            }
            // Readable by the pod's user (defaultMode 0444), as the kubelet mounts it.
            let _ = Command::new("chmod").args(["-R", "a+rX"]).arg(&d).status();
            return d;
        }
        if let Some(claim) = v["persistentVolumeClaim"]["claimName"].as_str() {
            // A claim outlives its pods: one directory per claim, whichever pod mounts it.
            let d = root.join("claims").join(claim);
            std::fs::create_dir_all(&d).unwrap();
            // Writable by the pod's user, as fsGroup makes a claim's volume.
            let _ = Command::new("chmod").args(["1777"]).arg(&d).status();
            return d;
        }
        if v.get("emptyDir").is_some() {
            let d = root
                .join("pods")
                .join(pod)
                .join(v["name"].as_str().unwrap());
            std::fs::create_dir_all(&d).unwrap();
            // World-writable, as an emptyDir is for the pod's user.
            let _ = Command::new("chmod").args(["1777"]).arg(&d).status();
            return d;
        }
        panic!("volume {v} not emulated");
    }

    /// Terminating: out of every Service at once, then preStop, then SIGTERM, then the
    /// grace period, then SIGKILL.
    pub fn terminate(self: &Arc<Self>, name: &str) {
        let (grace, pre_stop) = {
            let mut s = self.state.lock().unwrap();
            let Some(p) = s.pods.get_mut(name) else {
                return;
            };
            if p.terminating {
                return;
            }
            p.terminating = true;
            p.ready = false;
            let grace = p.spec["terminationGracePeriodSeconds"]
                .as_u64()
                .unwrap_or(30);
            let pre = p.spec["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
                .as_u64()
                .unwrap_or(0);
            (grace, pre)
        };
        let c = Arc::clone(self);
        let name = name.to_owned();
        std::thread::spawn(move || {
            // Deliberate: the pod's preStop sleep, as the kubelet runs it.
            std::thread::sleep(Duration::from_secs(pre_stop.min(grace)));
            let left = grace.saturating_sub(pre_stop);
            let _ = docker(&["stop", "-t", &left.to_string(), &c.cname(&name)]);
            let _ = docker(&["rm", "-f", &c.cname(&name)]);
            let mut s = c.state.lock().unwrap();
            if let Some(p) = s.pods.remove(&name) {
                s.gone.push((p.name, p.owner));
            }
        });
    }

    /// Kills a pod's container at once (a crash or `kubectl delete --force`); the
    /// controller replaces the pod.
    pub fn kill(self: &Arc<Self>, name: &str) {
        let _ = docker(&["rm", "-f", &self.cname(name)]);
        let mut s = self.state.lock().unwrap();
        if let Some(p) = s.pods.remove(name) {
            s.gone.push((p.name, p.owner));
        }
    }

    /// One round of probes for every running pod whose probe is due.
    fn probe(self: &Arc<Self>) {
        let due: Vec<(String, &'static str, Value, String)> = {
            let s = self.state.lock().unwrap();
            let now = Instant::now();
            let mut v = Vec::new();
            for p in s.pods.values().filter(|p| p.running && !p.terminating) {
                let ctr = &p.spec["containers"][0];
                let kinds: &[&'static str] = if p.started {
                    &["readinessProbe", "livenessProbe"]
                } else {
                    &["startupProbe"]
                };
                for &k in kinds {
                    let probe = &ctr[k];
                    if probe.is_null() {
                        continue;
                    }
                    if p.probes.get(k).is_none_or(|(next, _)| now >= *next) {
                        v.push((p.name.clone(), k, probe.clone(), p.ip.clone()));
                    }
                }
            }
            v
        };
        for (name, kind, probe, ip) in due {
            // A pod deleted since the list was taken is not probed.
            let Some(port) = self.port_of(&name, &probe["httpGet"]["port"]) else {
                continue;
            };
            let path = probe["httpGet"]["path"].as_str().unwrap_or("/");
            let ok = http_ok(&format!("http://{ip}:{port}{path}"));
            let period = probe["periodSeconds"].as_u64().unwrap_or(10);
            let threshold = probe["failureThreshold"].as_u64().unwrap_or(3) as u32;
            let mut restart = None;
            {
                let mut s = self.state.lock().unwrap();
                let Some(p) = s.pods.get_mut(&name) else {
                    continue;
                };
                let e = p.probes.entry(kind).or_insert((Instant::now(), 0));
                e.0 = Instant::now() + Duration::from_secs(period);
                e.1 = if ok { 0 } else { e.1 + 1 };
                let fails = e.1;
                match kind {
                    "startupProbe" if ok => {
                        p.started = true;
                        p.probes.remove("readinessProbe");
                    }
                    "readinessProbe" => p.ready = ok,
                    "livenessProbe" | "startupProbe" if fails >= threshold => {
                        p.restarts += 1;
                        p.ready = false;
                        p.started = p.spec["containers"][0].get("startupProbe").is_none();
                        p.probes.clear();
                        restart = Some(
                            p.spec["terminationGracePeriodSeconds"]
                                .as_u64()
                                .unwrap_or(30),
                        );
                    }
                    _ => {}
                }
            }
            if let Some(grace) = restart {
                eprintln!("[cluster] {name}: {kind} failed {threshold} times; restarting");
                let _ = docker(&["restart", "-t", &grace.to_string(), &self.cname(&name)]);
            }
        }
    }

    /// A probe's port: a number, or the name of one of the container's ports; `None`
    /// once the pod is gone.
    fn port_of(&self, pod: &str, port: &Value) -> Option<u64> {
        if let Some(n) = port.as_u64() {
            return Some(n);
        }
        let s = self.state.lock().unwrap();
        let spec = &s.pods.get(pod)?.spec;
        let n = spec["containers"][0]["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["name"] == *port)
            .and_then(|p| p["containerPort"].as_u64())
            .unwrap_or_else(|| panic!("{pod}: no port {port}"));
        Some(n)
    }

    /// The host directory behind a PersistentVolumeClaim.
    pub fn claim_dir(&self, claim: &str) -> PathBuf {
        self.dir.path().join("claims").join(claim)
    }

    /// The logs of a pod's container (for failure messages).
    pub fn logs(&self, pod: &str) -> String {
        self.logs_tail(pod, "30")
    }

    /// All the logs of a pod's container.
    pub fn all_logs(&self, pod: &str) -> String {
        self.logs_tail(pod, "all")
    }

    fn logs_tail(&self, pod: &str, tail: &str) -> String {
        let out = docker(&["logs", "--tail", tail, &self.cname(pod)]);
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }
}

/// Removes every container of the cluster on network `net` (named after it).
fn remove_containers(net: &str) {
    let ids = docker(&["ps", "-aq", "--filter", &format!("name={net}-")]);
    let ids = String::from_utf8_lossy(&ids.stdout).to_string();
    let ids: Vec<&str> = ids.split_whitespace().collect();
    if !ids.is_empty() {
        let mut a = vec!["rm", "-f"];
        a.extend(ids);
        let _ = docker(&a);
    }
}

pub fn set_scale(state: &Shared, deployment: &str, replicas: i64, by: &'static str) {
    let mut s = state.lock().unwrap();
    if s.scale.get(deployment) != Some(&replicas) {
        s.scale.insert(deployment.to_owned(), replicas);
        s.scale_history.push((deployment.to_owned(), replicas, by));
    }
}

fn http_ok(url: &str) -> bool {
    reqwest::blocking::Client::new()
        .get(url)
        .timeout(Duration::from_secs(1))
        .send()
        .is_ok_and(|r| r.status().is_success())
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.teardown();
        if let Some(rt) = self.runtime.lock().unwrap().take() {
            rt.shutdown_background();
        }
    }
}

impl Cluster {
    /// Whether the cluster was torn down (its loops end).
    pub fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    /// Removes every container and the network; the loops stop. Idempotent.
    pub fn teardown(&self) {
        if self.stop.swap(true, Ordering::SeqCst) {
            return;
        }
        // Twice: a pod starting while the first pass ran may have come up since.
        for _ in 0..2 {
            remove_containers(&self.net);
            if docker(&["network", "rm", &self.net]).status.success() {
                break;
            }
            // Deliberate: a pause before the second (and last) try; nothing to wait for.
            std::thread::sleep(Duration::from_secs(1));
        }
        // Files the containers wrote as root.
        let _ = Command::new("chmod")
            .args(["-R", "u+rwX"])
            .arg(self.dir.path())
            .status();
    }
}

/// The Pod object the API serves.
pub fn pod_json(p: &Pod, rv: u64) -> Value {
    let mut meta = json!({"name": p.name, "namespace": NS, "labels": p.labels,
                          "annotations": p.annotations,
                          "resourceVersion": rv.to_string(), "uid": p.name});
    if p.terminating {
        meta["deletionTimestamp"] = json!("2026-12-01T00:00:00Z");
    }
    json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": meta,
        "spec": {"nodeName": p.node, "containers": []},
        "status": {"phase": if p.running { "Running" } else { "Pending" }, "podIP": p.ip,
                   "conditions": [{"type": "Ready", "status": if p.ready { "True" } else { "False" }}]}
    })
}

/// The EndpointSlice of a Service: its selector's pods, Ready as the pods are.
pub fn endpoint_slice(svc: &Value, pods: &[&Pod], rv: u64) -> Value {
    let name = svc["metadata"]["name"].as_str().unwrap();
    let sel = labels_of(&svc["spec"]["selector"]);
    let members: Vec<&&Pod> = pods
        .iter()
        .filter(|p| sel.iter().all(|(k, v)| p.labels.get(k) == Some(v)))
        .collect();
    let ports: Vec<Value> = svc["spec"]["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            // targetPort by name: the container port of that name.
            let target = match &p["targetPort"] {
                Value::String(n) => members
                    .first()
                    .and_then(|m| {
                        m.spec["containers"][0]["ports"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .find(|cp| cp["name"] == n.as_str())
                            .and_then(|cp| cp["containerPort"].as_u64())
                    })
                    .unwrap_or(0),
                v => v
                    .as_u64()
                    .unwrap_or_else(|| p["port"].as_u64().unwrap_or(0)),
            };
            json!({"name": p["name"], "port": target, "protocol": "TCP"})
        })
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{name}-slice"), "namespace": NS, "resourceVersion": rv.to_string(),
                     "labels": {"kubernetes.io/service-name": name,
                                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4",
        "ports": ports,
        "endpoints": members.iter().filter(|p| p.running).map(|p| json!({
            "addresses": [p.ip], "nodeName": p.node,
            "conditions": {"ready": p.ready && !p.terminating, "serving": p.ready, "terminating": p.terminating}
        })).collect::<Vec<_>>(),
    })
}

/// Where a Service routes now: one Ready pod's address for its `port`, round-robin.
pub fn service_target(c: &Cluster, service: &str, port: u64, turn: usize) -> Option<String> {
    let svc = c.object("Service", service);
    let sel = labels_of(&svc["spec"]["selector"]);
    let s = c.state.lock().unwrap();
    let ready: Vec<&Pod> = s
        .pods
        .values()
        .filter(|p| {
            p.ready && !p.terminating && sel.iter().all(|(k, v)| p.labels.get(k) == Some(v))
        })
        .collect();
    if ready.is_empty() {
        return None;
    }
    let p = ready[turn % ready.len()];
    let sp = svc["spec"]["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|sp| sp["port"].as_u64() == Some(port))?;
    let target = match &sp["targetPort"] {
        Value::String(n) => p.spec["containers"][0]["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|cp| cp["name"] == n.as_str())
            .and_then(|cp| cp["containerPort"].as_u64())?,
        v => v.as_u64().unwrap_or(port),
    };
    Some(format!("{}:{target}", p.ip))
}

/// Runs a TCP proxy on loopback for a Service port: each connection goes to a Ready pod
/// (kube-proxy's behaviour). Returns the loopback address.
pub fn expose(c: &Arc<Cluster>, service: &str, port: u64) -> String {
    let l =
        c.rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let c2 = Arc::clone(c);
    let service = service.to_owned();
    c.rt.spawn(async move {
        let mut turn = 0usize;
        loop {
            let Ok((mut inbound, _)) = l.accept().await else {
                return;
            };
            turn += 1;
            let target = service_target(&c2, &service, port, turn);
            tokio::spawn(async move {
                let Some(t) = target else { return };
                if let Ok(mut out) = tokio::net::TcpStream::connect(&t).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
                }
            });
        }
    });
    addr
}

/// The chart's values for a local run: the image built here, a tiny model from `source`,
/// quick loops, small KV caches.
pub fn values(image_tag: &str, source: &str, extra: Value) -> Value {
    let mut v = json!({
        "image": {"repository": "preheat", "tag": image_tag, "pullPolicy": "Never"},
        "model": {"name": "tiny", "source": source},
        "gateway": {"holdTimeoutSeconds": 120, "drainGraceSeconds": 20},
        "prefill": {"kvCacheMiB": 16, "drainGraceSeconds": 10, "startupSeconds": 60},
        "decode": {"kvCacheMiB": 16, "drainGraceSeconds": 10, "startupSeconds": 60, "sloItlSeconds": 0.0001},
        "scaler": {"intervalSeconds": 1, "windowSeconds": 10, "idleGraceSeconds": 8,
                   "scaleDownStabilizationSeconds": 10},
        "keda": {"pollingInterval": 1, "cooldownPeriod": 5},
        "warmpool": {"labelNodes": false, "memoryBudget": "256MiB", "diskBudget": "1GiB"}
    });
    merge(&mut v, extra);
    v
}

fn merge(a: &mut Value, b: Value) {
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

/// Renders the chart with Helm's SDK for `values`.
pub fn render(values: &Value) -> Vec<Value> {
    crate::harness::helm_render(values)
}

/// A Secret as an operator (or cert-manager) would create it beside the release.
pub fn secret_object(name: &str, data: &[(&str, &[u8])]) -> Value {
    let data: serde_json::Map<String, Value> = data
        .iter()
        .map(|(k, v)| {
            let out = Command::new("base64")
                .arg("-w0")
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .and_then(|mut c| {
                    use std::io::Write;
                    c.stdin.take().unwrap().write_all(v)?;
                    c.wait_with_output()
                })
                .unwrap();
            (
                (*k).to_owned(),
                Value::String(String::from_utf8(out.stdout).unwrap()),
            )
        })
        .collect();
    serde_json::json!({"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                       "metadata": {"name": name}, "data": data})
}

/// A Secret's value (`base64 -d`, coreutils).
fn base64_decode(b64: &str) -> Vec<u8> {
    let out = Command::new("base64")
        .arg("-d")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin.take().unwrap().write_all(b64.as_bytes())?;
            c.wait_with_output()
        })
        .unwrap();
    assert!(out.status.success(), "not base64: {b64}");
    out.stdout
}

#[test]
fn a_subnet_another_network_holds_falls_back_to_a_free_one() {
    // CI's Docker engine once held a range over 10.214.0.0/24 ("Pool overlaps with
    // other one on this address space"): the slot's range is skipped, and so is any
    // other that a listed network covers or sits inside.
    let taken: Vec<(u32, u32)> = [
        "10.214.0.0/16",
        "10.215.1.0/24",
        "10.215.2.128/25",
        "fd00::/64",
    ]
    .iter()
    .filter_map(|c| parse_cidr(c))
    .collect();
    assert_eq!(taken.len(), 3, "IPv6 is not an IPv4 range");
    assert_eq!(free_prefix(&taken, 214).as_deref(), Some("10.215.3"));
    assert_eq!(free_prefix(&[], 214).as_deref(), Some("10.214.1"));
    // A /8 over everything leaves nothing to pick.
    assert_eq!(free_prefix(&[parse_cidr("10.0.0.0/8").unwrap()], 214), None);
    assert_eq!(parse_cidr("10.1.2.3/24"), parse_cidr("10.1.2.0/24"));
    assert_eq!(parse_cidr("10.1.2.0/33"), None);
}
