//! A served model on a loopback port, and helpers for reading its answers: what the
//! API-level test modules share.

use std::path::PathBuf;
use std::time::Duration;

use preheat_engine::colocated::{ServeOptions, serve_on};
use preheat_testkit::wait_for_async;
use serde_json::{Value, json};

use preheat_testkit::model_fixture as fixture;

pub(crate) fn reference(name: &str) -> Value {
    serde_json::from_slice(&std::fs::read(fixture(name).join("reference.json")).unwrap()).unwrap()
}

/// A listener on a free loopback port, and its base URL.
pub(crate) async fn listen() -> (tokio::net::TcpListener, String) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    (l, url)
}

/// Whether `base`'s `/health` answers 200 (503 while the model loads), for `wait_for`.
pub(crate) async fn healthy(client: &reqwest::Client, base: &str) -> Result<(), String> {
    match client.get(format!("{base}/health")).send().await {
        Ok(r) if r.status() == 200 => Ok(()),
        Ok(r) => Err(r.status().to_string()),
        Err(e) => Err(e.to_string()),
    }
}

/// `GET url` as JSON (`Null` when it does not answer with JSON).
pub(crate) async fn get_json(client: &reqwest::Client, url: &str) -> Value {
    match client.get(url).send().await {
        Ok(r) => r.json().await.unwrap_or_default(),
        Err(_) => Value::Null,
    }
}

/// `base`'s `/metrics` page.
pub(crate) async fn scrape(client: &reqwest::Client, base: &str) -> String {
    let r = client.get(format!("{base}/metrics")).send().await.unwrap();
    r.text().await.unwrap()
}

/// The sum of a metric's samples (every label set) in a Prometheus text page; 0 when
/// absent.
pub(crate) fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub(crate) struct Server {
    pub(crate) base: String,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<preheat_engine::Result<()>>,
    pub(crate) client: reqwest::Client,
}

impl Server {
    pub(crate) async fn start(model: PathBuf, tweak: impl FnOnce(&mut ServeOptions)) -> Server {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut opts = ServeOptions::new(model, addr);
        opts.served_model_name = Some("m".into());
        opts.kv_cache_bytes = 8 << 20;
        tweak(&mut opts);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve_on(listener, opts, async move {
            let _ = rx.await;
        }));
        let s = Server {
            base: format!("http://{addr}"),
            stop: Some(tx),
            task,
            client: reqwest::Client::new(),
        };
        wait_for_async("the server healthy", Duration::from_secs(30), async || {
            healthy(&s.client, &s.base).await
        })
        .await;
        s
    }

    pub(crate) async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self
            .client
            .post(format!("{}{path}", self.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// Streams a request; returns the parsed `data:` payloads (without `[DONE]`) and
    /// whether `[DONE]` came last.
    pub(crate) async fn stream(&self, path: &str, body: Value) -> (Vec<Value>, bool) {
        let r = self
            .client
            .post(format!("{}{path}", self.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let text = r.text().await.unwrap();
        let datas: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .collect();
        let done = datas.last() == Some(&"[DONE]");
        (
            datas
                .iter()
                .filter(|d| **d != "[DONE]")
                .map(|d| serde_json::from_str(d).unwrap())
                .collect(),
            done,
        )
    }

    pub(crate) async fn metrics_text(&self) -> String {
        scrape(&self.client, &self.base).await
    }

    pub(crate) async fn metric(&self, name: &str) -> f64 {
        metric_sum(&self.metrics_text().await, name)
    }

    pub(crate) async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
    }
}

pub(crate) fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub(crate) fn greedy_body(prompt: &[u32], n: usize) -> Value {
    json!({"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": true,
           "logprobs": 0, "return_tokens_as_token_ids": true})
}

pub(crate) fn token_ids_of(resp: &Value) -> Vec<u32> {
    resp["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            t.as_str()
                .unwrap()
                .strip_prefix("token_id:")
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect()
}
