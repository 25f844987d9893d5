//! The attack suite: what a peer on the cluster network that is not ours, or a client
//! without a key, tries against a running deployment (gateway, prefill and decode
//! workers, warm-pool agent, each started as operators start them, with the cluster
//! token). Each test asserts the refusal AND that serving goes on: a request started
//! before the attack completes in full.
//!
//! Closer to their code: forged and mismatched K/V
//! (`kv_is_taken_only_for_its_request_and_hashed_here`, engine worker unit tests),
//! oversized KV frames, stalled KV peers, a KV peer without the token and the
//! connection cap (`the_kv_port_cuts_off_stalled_and_oversized_peers_and_caps_connections`,
//! engine/tests/it/transfer.rs), credentials in a source URL
//! (`regression_credentials_in_a_source_url_reached_errors_and_logs`, cli_warmpool),
//! every sampling bound (`every_bound_is_refused_by_its_field`, engine), prefill addresses
//! no gateway announced (`regression_a_decode_worker_pulled_kv_from_any_address_a_body_named`,
//! engine/tests/it/disagg_worker.rs), the connection
//! cap and body deadline (`slow_peers_are_cut_off_and_connections_capped`, edge), planted
//! kernels (`a_keyed_cache_takes_only_entries_signed_for_their_id`, snapshot).

mod harness;

use std::process::Stdio;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use preheat_testkit::{KillOnDrop, free_port, model_fixture};
use serde_json::{Value, json};

const KEY: &str = "sk-attack-suite-client";

/// A deployment for one attack: its processes are killed when it drops (a suite-wide
/// one in a static would outlive the test binary and hold its output pipe open).
struct Deployment {
    stack: harness::Stack,
    _agent: KillOnDrop,
    /// The gateway's public and internal base URLs.
    public: String,
    internal: String,
    decode: String,
    agent: String,
    _dir: tempfile::TempDir,
    _one_at_a_time: std::sync::MutexGuard<'static, ()>,
}

/// Deployments one at a time: four processes each, on two cores.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn deployment() -> Deployment {
    let lock = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("api-keys");
    std::fs::write(&keys, format!("{KEY}\n")).unwrap();
    let m = model_fixture("llama-tiny");
    let ap = free_port();
    let cfg = dir.path().join("agent.yaml");
    std::fs::write(
        &cfg,
        json!({"dir": dir.path().join("node"), "disk_budget": "1GiB",
               "listen": format!("127.0.0.1:{ap}"), "models": []})
        .to_string(),
    )
    .unwrap();
    // The agent starts while the workers load.
    let agent = harness::spawn(
        &["warmpool", "run", "--config", cfg.to_str().unwrap()],
        Stdio::inherit(),
    );
    let stack = harness::stack()
        .gateway(
            harness::gateway()
                .model(m.to_str().unwrap())
                .args(&["--api-keys-file", keys.to_str().unwrap()])
                .through_prefill(),
        )
        .model(&m)
        .prefill(1)
        .decode(1)
        .kv_mib(16)
        .ready_within(90)
        .start();
    harness::wait_healthy(ap, 30);
    Deployment {
        public: stack.url().to_owned(),
        internal: stack.internal().to_owned(),
        decode: stack.decode[0].url.clone(),
        agent: format!("http://127.0.0.1:{ap}"),
        stack,
        _agent: agent,
        _dir: dir,
        _one_at_a_time: lock,
    }
}

fn client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

fn workers(d: &Deployment) -> Vec<Value> {
    d.stack.workers()
}

/// A listener that reports its first connection: where a request body points a worker
/// that must not go there.
fn trap() -> (std::net::SocketAddr, std::sync::mpsc::Receiver<()>) {
    let (seen_tx, seen_rx) = std::sync::mpsc::channel();
    let trap = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = trap.local_addr().unwrap();
    std::thread::spawn(move || {
        if trap.accept().is_ok() {
            let _ = seen_tx.send(());
        }
    });
    (addr, seen_rx)
}

/// Runs `attack` while a 48-token request is in flight through the gateway, then
/// checks that request finished in full.
fn while_serving(attack: impl FnOnce(&Deployment)) {
    let d = &deployment();
    let url = format!("{}/v1/completions", d.public);
    let req = std::thread::spawn(move || {
        let prompt: Vec<u32> = (1..40).collect();
        client()
            .post(url)
            .bearer_auth(KEY)
            .json(
                &json!({"prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": true}),
            )
            .send()
            .map(|r| {
                (
                    r.status().as_u16(),
                    r.json::<Value>().unwrap_or(Value::Null),
                )
            })
    });
    attack(d);
    let (status, body) = req.join().unwrap().expect("the request in flight");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 48, "{body}");
    // Accepted requests are counted by the key's hash, never the key.
    let text = client()
        .get(format!("{}/metrics", d.public))
        .send()
        .unwrap()
        .text()
        .unwrap();
    assert!(
        text.lines()
            .any(|l| l.starts_with("preheat:api_key_requests_total{key=\"key-")),
        "{text}"
    );
    assert!(!text.contains(KEY), "a key in /metrics");
}

#[test]
fn a_forged_registration_without_the_token_is_refused_and_changes_nothing() {
    while_serving(|d| {
        let before = workers(d);
        let real = before[0]["id"].as_str().unwrap().to_owned();
        let forged = json!({"id": real, "role": "decode", "url": "http://127.0.0.1:1",
                            "model": "llama-tiny", "compat": "x"});
        for auth in [None, Some("Bearer not-the-token-0123456789abcdef0123")] {
            let mut rb = client()
                .post(format!("{}/internal/register", d.internal))
                .json(&forged);
            if let Some(a) = auth {
                rb = rb.header("authorization", a);
            }
            assert_eq!(rb.send().unwrap().status(), 401, "auth {auth:?}");
            let dereg = client()
                .post(format!("{}/internal/deregister", d.internal))
                .json(&json!({"id": real}))
                .send()
                .unwrap();
            assert_eq!(dereg.status(), 401);
            let list = client()
                .get(format!("{}/internal/workers", d.internal))
                .send()
                .unwrap();
            assert_eq!(list.status(), 401, "the worker list is not for strangers");
        }
        let after = workers(d);
        assert_eq!(before.len(), after.len());
        assert!(
            after.iter().all(|w| w["url"] != "http://127.0.0.1:1"),
            "{after:?}"
        );
    });
}

#[test]
fn registration_and_every_internal_path_on_the_public_port_answer_404() {
    while_serving(|d| {
        for path in [
            "/internal/register",
            "/internal/workers",
            "/internal/promote",
            "/internal",
        ] {
            let r = client()
                .post(format!("{}{path}", d.public))
                .header("authorization", harness::bearer())
                .json(&json!({}))
                .send()
                .unwrap();
            assert_eq!(r.status(), 404, "{path}");
        }
    });
}

#[test]
fn ssrf_through_a_request_body_needs_the_token_first() {
    while_serving(|d| {
        // A decode worker's /internal/generate names the prefill address in its body:
        // without the token it never gets as far as connecting anywhere.
        let (trap_addr, seen_rx) = trap();
        let body = json!({"request_id": "ssrf", "prompt": [1, 2, 3],
            "params": {"max_tokens": 1}, "prefill": format!("tcp://{trap_addr}")});
        let r = client()
            .post(format!("{}/internal/generate", d.decode))
            .json(&body)
            .send()
            .unwrap();
        assert_eq!(r.status(), 401);
        for path in [
            "/internal/load",
            "/internal/model",
            "/internal/prefill",
            "/internal/promote",
        ] {
            let r = client().get(format!("{}{path}", d.decode)).send().unwrap();
            assert!(
                [401, 405].contains(&r.status().as_u16()),
                "{path}: {}",
                r.status()
            );
        }
        assert!(
            seen_rx.recv_timeout(Duration::from_millis(500)).is_err(),
            "the decode worker connected to the address in an unauthenticated body"
        );
        // Probes and Prometheus still read what they need without it.
        for path in ["/health", "/metrics"] {
            assert_eq!(
                client()
                    .get(format!("{}{path}", d.decode))
                    .send()
                    .unwrap()
                    .status(),
                200
            );
        }
    });
}

#[test]
fn ssrf_with_the_token_reaches_only_prefill_workers_the_gateway_announced() {
    while_serving(|d| {
        // Even a holder of the token cannot point a decode worker at another host: the
        // address must be on the list its gateway announced.
        let (trap_addr, seen_rx) = trap();
        let body = preheat_engine::disagg::wire::messages::GenerateBody {
            request_id: "ssrf".into(),
            prompt: vec![1, 2, 3],
            params: preheat_engine::sampling::SamplingParams::default(),
            prefill: Some(format!("tcp://{trap_addr}")),
        };
        let r = client()
            .post(format!("{}/internal/generate", d.decode))
            .header("authorization", harness::bearer())
            .json(&body)
            .send()
            .unwrap();
        assert_eq!(r.status(), 502);
        let e: Value = r.json().unwrap();
        assert_eq!(e["prefill_failed"], true, "{e}");
        assert!(e["message"].as_str().unwrap().contains("announced"), "{e}");
        assert!(
            seen_rx.recv_timeout(Duration::from_millis(500)).is_err(),
            "the decode worker connected to an address only a request body named"
        );
    });
}

#[test]
fn a_missing_or_wrong_api_key_gets_401_in_the_openai_shape() {
    while_serving(|d| {
        let req = json!({"prompt": "hi", "max_tokens": 1});
        for auth in [None, Some("Bearer sk-wrong"), Some(KEY)] {
            let mut rb = client()
                .post(format!("{}/v1/completions", d.public))
                .json(&req);
            if let Some(a) = auth {
                rb = rb.header("authorization", a); // (the last lacks "Bearer ")
            }
            let r = rb.send().unwrap();
            assert_eq!(r.status(), 401, "{auth:?}");
            let v: Value = r.json().unwrap();
            assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
            assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
            assert!(!v.to_string().contains("sk-wrong"), "{v}");
        }
        // Health and metrics stay open; the metrics count the key by its hash only.
        assert_eq!(
            client()
                .get(format!("{}/health", d.public))
                .send()
                .unwrap()
                .status(),
            200
        );
        let text = client()
            .get(format!("{}/metrics", d.public))
            .send()
            .unwrap()
            .text()
            .unwrap();
        assert!(!text.contains(KEY), "a key in /metrics");
    });
}

#[test]
fn a_stop_string_flood_is_refused_by_name() {
    while_serving(|d| {
        let stops: Vec<String> = (0..1000).map(|i| format!("stop-{i}")).collect();
        let r = client()
            .post(format!("{}/v1/completions", d.public))
            .bearer_auth(KEY)
            .json(&json!({"prompt": "hi", "max_tokens": 1, "stop": stops}))
            .send()
            .unwrap();
        assert_eq!(r.status(), 400);
        let v: Value = r.json().unwrap();
        assert_eq!(v["error"]["param"], "stop", "{v}");
    });
}

#[test]
fn unauthenticated_promote_and_standby_changes_at_the_agent_are_refused() {
    while_serving(|d| {
        let c = client();
        let tries = [
            c.post(format!("{}/standbys/decode/promote", d.agent)),
            c.post(format!("{}/standbys/decode/retire", d.agent)),
            c.put(format!("{}/standbys/decode", d.agent))
                .json(&json!({"count": 100})),
            c.get(format!("{}/standbys", d.agent)),
            c.get(format!("{}/models", d.agent)),
            c.post(format!("{}/models/x/stage", d.agent)),
            c.get(format!("{}/snapshots/x.preheat", d.agent)),
        ];
        for rb in tries {
            let r = rb.send().unwrap();
            assert_eq!(r.status(), 401, "{}", r.url());
        }
        assert_eq!(
            c.get(format!("{}/health", d.agent))
                .send()
                .unwrap()
                .status(),
            200
        );
    });
}

#[test]
fn path_traversal_on_snapshots_is_refused_even_with_the_token() {
    while_serving(|d| {
        for file in [
            "..%2F..%2F..%2Fetc%2Fpasswd",
            "%2Fetc%2Fpasswd",
            "..",
            "x%00.preheat",
        ] {
            let r = client()
                .get(format!("{}/snapshots/{file}", d.agent))
                .header("authorization", harness::bearer())
                .send()
                .unwrap();
            assert!(r.status().is_client_error(), "{file}: {}", r.status());
            let body = r.text().unwrap();
            assert!(!body.contains("root:"), "{file}: {body}");
        }
    });
}

#[test]
fn slow_loris_connections_are_cut_off_at_the_header_deadline() {
    use std::io::{Read, Write};
    while_serving(|d| {
        // Every listener: the gateway's two, a worker's, the agent's.
        let targets = [&d.public, &d.internal, &d.decode, &d.agent];
        let t0 = Instant::now();
        let mut conns: Vec<std::net::TcpStream> = targets
            .iter()
            .map(|base| {
                let addr = base.trim_start_matches("http://");
                let mut s = std::net::TcpStream::connect(addr).unwrap();
                s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                    .unwrap();
                s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                s
            })
            .collect();
        for (s, base) in conns.iter_mut().zip(targets) {
            let mut b = [0u8; 256];
            // EOF, a reset or a 408 before the read timeout: cut off, not waited on.
            let n = s.read(&mut b).unwrap_or(0);
            assert!(
                n == 0 || String::from_utf8_lossy(&b[..n]).starts_with("HTTP/1.1 408"),
                "{base}: {}",
                String::from_utf8_lossy(&b[..n])
            );
        }
        let took = t0.elapsed();
        assert!(took < Duration::from_secs(15), "{took:?}");
    });
}
