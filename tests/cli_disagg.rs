//! Disaggregated serving as operators run it: a gateway, prefill and decode worker
//! processes on the tiny fixture. Greedy output through the gateway equals `engine
//! serve`; a worker of another model is refused at registration; a decode worker
//! killed mid-stream ends the client's stream with an error, not a hang; a dead prefill
//! worker's requests are retried on another; under load (the README's example, a
//! worker killed mid-batch, requests waiting for room) nothing fails or is overtaken.
//!
//! Why one file over 600 lines: every test starts the same process stack through the
//! harness and drives it as a client would; split, each part would repeat its helpers.

mod harness;

use std::process::Command;
use std::time::{Duration, Instant};

use harness::{Log, gateway, stack};
use preheat_testkit::{Wait, model_fixture, wait_for_async};
use serde_json::{Value, json};

async fn complete(c: &reqwest::Client, base: &str, prompt: &Value, max_tokens: usize) -> Value {
    c.post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Asserts two completions answer alike: text, token ids, finish reason and usage
/// exactly; logprobs and top logprobs to 1e-3 (batching may change the last bits).
fn same_answer(a: &Value, b: &Value) {
    let (ca, cb) = (&a["choices"][0], &b["choices"][0]);
    for k in ["text", "finish_reason"] {
        assert_eq!(ca[k], cb[k], "{k}:\n{a}\n{b}");
    }
    // (cached_tokens depends on each engine's prefix cache, not on the answer.)
    for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(a["usage"][k], b["usage"][k], "usage:\n{a}\n{b}");
    }
    let (la, lb) = (&ca["logprobs"], &cb["logprobs"]);
    assert_eq!(la["tokens"], lb["tokens"], "tokens:\n{a}\n{b}");
    let n = lb["token_logprobs"].as_array().unwrap().len();
    assert!(n > 0, "{b}");
    for i in 0..n {
        let (x, y) = (&la["token_logprobs"][i], &lb["token_logprobs"][i]);
        assert!(
            (x.as_f64().unwrap() - y.as_f64().unwrap()).abs() < 1e-3,
            "token {i}: {x} vs {y}"
        );
        let (ta, tb) = (
            la["top_logprobs"][i].as_object().unwrap(),
            lb["top_logprobs"][i].as_object().unwrap(),
        );
        // Five alternatives, fewer keys only where two decode to the same text.
        assert!(
            !ta.is_empty() && ta.len() <= 5,
            "token {i}: top_logprobs {ta:?}"
        );
        assert_eq!(
            ta.keys().collect::<Vec<_>>(),
            tb.keys().collect::<Vec<_>>(),
            "token {i}: top_logprobs"
        );
        for (k, v) in ta {
            assert!(
                (v.as_f64().unwrap() - tb[k].as_f64().unwrap()).abs() < 1e-3,
                "token {i} {k}"
            );
        }
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn gateway_prefill_decode_serve_like_colocated_and_survive_faults() {
    let tiny = model_fixture("llama-tiny");
    // The colocated engine loads while the deployment starts.
    let colocated = harness::serve(&tiny).kv_mib(16).log(Log::Piped).start();
    // Workers register on the gateway's internal port (behind the cluster token); the
    // prefill workers are named to the decode worker once it was told about them.
    let mut s = stack()
        .gateway(gateway().through_prefill())
        .prefill(2)
        .decode(1)
        .kv_mib(16)
        .log(Log::Piped)
        .ready_within(70)
        .start();
    let (gw, gwi) = (s.url().to_owned(), s.internal().to_owned());
    let (pa_port, pb_port, dport) = (s.prefill[0].port, s.prefill[1].port, s.decode[0].port);
    let serve = colocated.url.clone();
    let refj: Value =
        serde_json::from_slice(&std::fs::read(tiny.join("reference.json")).unwrap()).unwrap();
    colocated.wait_healthy(60);
    rt().block_on(async {
        let c = reqwest::Client::new();
        // Greedy through prefill → KV transfer → decode equals the colocated engine.
        // (Each pair is asked of both deployments at once: they share no process.)
        for case in refj["cases"].as_array().unwrap() {
            let (a, b) = tokio::join!(
                complete(&c, &gw, &case["input_ids"], 24),
                complete(&c, &serve, &case["input_ids"], 24)
            );
            assert_eq!(a["choices"][0]["text"], b["choices"][0]["text"], "{a}\n{b}");
            assert_eq!(a["usage"]["completion_tokens"], 24, "{a}");
        }
        // The prefill workers did the prefills (announced to the decode worker; a
        // gateway that never names them would pass the comparison above on its own).
        let prefilled = async |port: u16| -> f64 {
            let t = c.get(format!("http://127.0.0.1:{port}/metrics")).send().await.unwrap().text().await.unwrap();
            t.lines()
                .find(|l| l.starts_with("vllm:prompt_tokens_total"))
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        assert!(
            prefilled(pa_port).await + prefilled(pb_port).await > 0.0,
            "no prompt was prefilled on a prefill worker"
        );
        // Every field a client reads, with logprobs, as the colocated engine answers it
        // (regression: the first token's top_logprobs arrived empty when it was
        // computed on the prefill worker).
        for case in refj["cases"].as_array().unwrap() {
            let body = json!({"prompt": case["input_ids"], "max_tokens": 4, "temperature": 0,
                              "ignore_eos": true, "logprobs": 5});
            let get = async |base: &str| -> Value {
                c.post(format!("{base}/v1/completions")).json(&body).send().await.unwrap().json().await.unwrap()
            };
            let (a, b) = tokio::join!(get(&gw), get(&serve));
            same_answer(&a, &b);
        }
        // Penalties and biases travel with the K/V: the first token is chosen on the
        // prefill worker, the rest on the decode worker, as the colocated engine does.
        for case in refj["cases"].as_array().unwrap() {
            let body = json!({"prompt": case["input_ids"], "max_tokens": 6, "temperature": 0,
                              "ignore_eos": true, "logprobs": 2, "repetition_penalty": 1.5,
                              "frequency_penalty": 1.0, "presence_penalty": 0.5,
                              "logit_bias": {"5": 3.0}, "min_tokens": 2});
            let get = async |base: &str| -> Value {
                c.post(format!("{base}/v1/completions")).json(&body).send().await.unwrap().json().await.unwrap()
            };
            let (a, b) = tokio::join!(get(&gw), get(&serve));
            same_answer(&a, &b);
        }
        // Several choices: the same sequences (seed + i each) through prefill → decode
        // as colocated, best_of ranked the same, the prompt counted once; streamed,
        // every choice finishes.
        let prompt = &refj["cases"][0]["input_ids"];
        // Grammars travel with the K/V too: the prefill worker masks the first token, the
        // decode worker's matcher takes it and masks the rest.
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                            "required": ["a"], "additionalProperties": false});
        for extra in [
            json!({"n": 3}),
            json!({"n": 2, "best_of": 4}),
            json!({"n": 2, "guided_regex": "[a-z]{3,6}!"}),
            json!({"n": 2, "guided_json": schema}),
        ] {
            let mut body = json!({"prompt": prompt, "max_tokens": 16, "temperature": 1.0, "seed": 5,
                                  "ignore_eos": true, "logprobs": 1});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            let get = async |base: &str| -> Value {
                c.post(format!("{base}/v1/completions")).json(&body).send().await.unwrap().json().await.unwrap()
            };
            let (a, b) = tokio::join!(get(&gw), get(&serve));
            let n = b["choices"].as_array().map_or(0, Vec::len);
            assert_eq!(n, body["n"].as_u64().unwrap() as usize, "{b}");
            for k in ["prompt_tokens", "completion_tokens"] {
                assert_eq!(a["usage"][k], b["usage"][k], "usage:\n{a}\n{b}");
            }
            for i in 0..n {
                let (ca, cb) = (&a["choices"][i], &b["choices"][i]);
                assert_eq!(ca["index"], i);
                if body.get("guided_json").is_some() {
                    let v: Value = serde_json::from_str(ca["text"].as_str().unwrap()).unwrap();
                    assert!(v["a"].as_i64().is_some_and(|a| (0..=99).contains(&a)), "{a}");
                }
                if body.get("guided_regex").is_some() {
                    let t = ca["text"].as_str().unwrap();
                    assert!(t.ends_with('!') && (4..=7).contains(&t.len()), "{a}");
                }
                assert_eq!(
                    (&ca["text"], &ca["logprobs"]["tokens"]),
                    (&cb["text"], &cb["logprobs"]["tokens"]),
                    "choice {i}:\n{a}\n{b}"
                );
            }
        }
        let body = json!({"prompt": prompt, "max_tokens": 4, "n": 2, "stream": true});
        let text = c.post(format!("{gw}/v1/completions")).json(&body).send().await.unwrap().text().await.unwrap();
        let finished: Vec<u64> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str::<Value>(d).unwrap())
            .filter(|v| !v["choices"][0]["finish_reason"].is_null())
            .map(|v| v["choices"][0]["index"].as_u64().unwrap())
            .collect();
        assert_eq!(finished.len(), 2, "{text}");
        assert!(finished.contains(&0) && finished.contains(&1), "{text}");
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        // The decode worker holds nothing afterwards.
        let dm = format!("http://127.0.0.1:{dport}/metrics");
        wait_for_async("the decode worker's KV released", Duration::from_secs(10), async || {
            let t = c.get(&dm).send().await.unwrap().text().await.unwrap();
            t.lines().any(|l| l.starts_with("vllm:kv_cache_usage_perc") && l.ends_with(" 0"))
        })
        .await;

        // Regression: a worker of an older KV format (one that drops a grammar it does
        // not know without a word) registered on a newer gateway. Now refused by version.
        // (Its registration has the same compatibility hash, and no kv_format field.)
        let info: Value = c
            .get(format!("http://127.0.0.1:{dport}/internal/model"))
            .header("authorization", harness::bearer())
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let compat = info["compat"].clone();
        assert!(compat.is_string(), "{info}");
        let r = c
            .post(format!("{gwi}/internal/register"))
            .header("authorization", harness::bearer())
            .json(&json!({"id": "old-1", "role": "decode", "url": "http://127.0.0.1:9",
                          "model": "llama-tiny", "compat": compat}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 409);
        assert!(r.text().await.unwrap().contains("KV format version"));
        assert_eq!(s.workers().len(), 3, "the old worker joined");
        // A worker of another model is refused at registration, with a clear reason.
        let mut other = s.gateway.worker("decode", &model_fixture("qwen2-tiny")).kv_mib(16).log(Log::Piped).start();
        let status = wait_for_async("the other-model worker refused", Duration::from_secs(60), async || {
            other.proc.0.try_wait().unwrap()
        })
        .await;
        assert!(!status.success());
        let mut err = String::new();
        std::io::Read::read_to_string(other.proc.0.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert!(err.contains("refused") && err.contains("compatibility hash"), "{err}");
        assert_eq!(s.workers().len(), 3);

        // A dead prefill worker: its requests are retried on the other one; with both
        // dead (before the gateway notices), the decode worker prefills itself.
        let b_before = prefilled(pb_port).await;
        for (i, p) in s.prefill.iter_mut().enumerate() {
            p.proc.0.kill().unwrap();
            let _ = p.proc.0.wait();
            for case in refj["cases"].as_array().unwrap() {
                let a = complete(&c, &gw, &case["input_ids"], 4).await;
                assert_eq!(a["usage"]["completion_tokens"], 4, "{a}");
            }
            if i == 0 {
                // The survivor took the retries (a failed transfer does not make the
                // decode worker forget which prefill workers it may use).
                assert!(prefilled(pb_port).await > b_before, "prefill_b took nothing after prefill_a died");
            }
        }

        // The decode worker dies mid-stream: the client's stream ends with an error
        // within 5 s, and the gateway stops routing to it.
        let mut resp = c
            .post(format!("{gw}/v1/completions"))
            .json(&json!({"prompt": refj["cases"][0]["input_ids"], "max_tokens": 400, "temperature": 0, "ignore_eos": true, "stream": true}))
            .send()
            .await
            .unwrap();
        let first = resp.chunk().await.unwrap().unwrap();
        assert!(String::from_utf8_lossy(&first).contains("data:"));
        s.decode[0].proc.0.kill().unwrap();
        let killed = Instant::now();
        let mut body = String::new();
        let read = tokio::time::timeout(Duration::from_secs(5), async {
            while let Ok(Some(chunk)) = resp.chunk().await {
                body.push_str(&String::from_utf8_lossy(&chunk));
            }
        })
        .await;
        assert!(read.is_ok(), "stream still open 5 s after the decode worker died");
        assert!(body.contains("\"error\""), "no error event: {body}");
        assert!(killed.elapsed() < Duration::from_secs(5));
        wait_for_async("the decode worker dropped", Duration::from_secs(5), async || {
            !s.workers().iter().any(|w| w["role"] == "decode")
        })
        .await;
    });
}

#[test]
fn sigterm_on_a_decode_worker_deregisters_and_finishes_what_it_holds() {
    // The worker registers on the gateway's internal port (behind the cluster token).
    let mut s = stack().decode(1).kv_mib(16).log(Log::Piped).start();
    let gw = s.url().to_owned();
    rt().block_on(async {
        let c = reqwest::Client::new();
        // Enough concurrent work that some is still running when SIGTERM lands.
        let mut streams = Vec::new();
        for i in 0..16u32 {
            let prompt: Vec<u32> = (1..20).map(|t| t + i).collect();
            let r = c
                .post(format!("{gw}/v1/completions"))
                .json(&json!({"prompt": prompt, "max_tokens": 480, "temperature": 0, "ignore_eos": true, "stream": true}))
                .send()
                .await
                .unwrap();
            streams.push(r);
        }
        // Every stream has a token, so every request is held by the worker (a request
        // still on its way would find no decode worker once this one drains).
        let mut firsts = Vec::new();
        for s in &mut streams {
            firsts.push(s.chunk().await.unwrap().unwrap().to_vec());
        }
        let st = Command::new("kill").args(["-TERM", &s.decode[0].proc.0.id().to_string()]).status().unwrap();
        assert!(st.success());
        // Out of the rotation at once...
        wait_for_async("deregistered", Duration::from_secs(5), async || s.workers().is_empty()).await;
        // ...while every stream it held completes normally.
        for (i, mut s) in streams.into_iter().enumerate() {
            let mut body = std::mem::take(&mut firsts[i]);
            while let Some(chunk) = s.chunk().await.unwrap() {
                body.extend_from_slice(&chunk);
            }
            let body = String::from_utf8_lossy(&body);
            assert!(body.contains("\"finish_reason\":\"length\"") && body.ends_with("data: [DONE]\n\n"), "stream {i}: {body}");
            assert!(!body.contains("\"error\""), "stream {i}: {body}");
        }
        let status = wait_for_async("the worker to exit after draining", Duration::from_secs(30), async || {
            s.decode[0].proc.0.try_wait().unwrap()
        })
        .await;
        assert!(status.success(), "{status}");
    });
}

#[test]
fn regression_an_unreachable_decode_worker_failed_requests_another_could_serve() {
    // The bug: a connect error on the chosen decode worker failed the request although
    // nothing had been sent and another decode worker was listed. Kill one of two
    // (before the gateway notices: heartbeats lapse only after seconds) and every
    // request is still answered.
    let mut s = stack()
        .gateway(gateway().args(&["--worker-timeout-secs", "30"]))
        .decode(2)
        .kv_mib(16)
        .log(Log::Piped)
        .start();
    let gw = s.url().to_owned();
    rt().block_on(async {
        let c = reqwest::Client::new();
        let mut victim = s.decode.remove(0);
        victim.proc.0.kill().unwrap();
        let _ = victim.proc.0.wait();
        assert_eq!(s.workers().len(), 2, "the gateway has not noticed yet");
        // Rounds of concurrent requests (the survivor's reported load rises, so the
        // gateway turns to the dead one) until it has been tried and dropped; every
        // request is answered all the same.
        let mut n = 0;
        for round in 0..20u32 {
            let prompts: Vec<Value> = (0..6u32).map(|k| json!([1 + round, 2 + k, 3])).collect();
            // Long enough that a heartbeat reports the survivor busy.
            let reqs = prompts.iter().map(|p| complete(&c, &gw, p, 500));
            for v in futures_util::future::join_all(reqs).await {
                assert_eq!(v["usage"]["completion_tokens"], 500, "request {n}: {v}");
                n += 1;
            }
            if s.workers().len() == 1 {
                break;
            }
        }
        assert_eq!(
            s.workers().len(),
            1,
            "the dead worker was never tried in {n} requests: the scenario proves nothing"
        );
    });
}

/// The "Disaggregated serving" example of docs/engine.md (the README's when this was
/// found) as written: a gateway that knows its
/// model, one prefill and one decode worker on SmolLM2, then `bench serve` replaying
/// 100 requests of the Azure code trace at 10× (about five times what 2 cores serve).
/// Every request must complete: workers that are merely busy make a request wait at the
/// gateway, they do not fail it, and it waits its turn (see
/// `regression_requests_waiting_for_room_were_overtaken_and_timed_out`).
#[test]
fn regression_the_readme_disaggregated_example_failed_requests_with_429() {
    let Some(model) = preheat_testkit::smollm2_gguf() else {
        return;
    };
    let m = model.to_str().unwrap();
    // Both workers registered and the prefill worker announced. (The README leaves the
    // KV port at its default, --port + 1; a test takes a free one, as another test's
    // process may hold that one.)
    let s = stack()
        .gateway(gateway().model(m))
        .model(&model)
        .prefill(1)
        .decode(1)
        .log(Log::Null)
        .ready_within(120)
        .start();
    let trace = preheat_testkit::testdata().join("traces/azure_code_2023.csv");
    let out = harness::preheat([
        "bench",
        "serve",
        "--url",
        s.url(),
        "--trace",
        trace.to_str().unwrap(),
        "--speedup",
        "10",
        "--token-scale",
        "0.05",
        "--max-requests",
        "100",
        "--json",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "bench serve printed no report ({e}):\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    eprintln!(
        "README example: {} requests, {} failed, {:.1} s, TTFT p50 {} p99 {}",
        report["requests"],
        report["failed"],
        report["duration_s"].as_f64().unwrap_or(0.0),
        report["ttft_p50"],
        report["ttft_p99"]
    );
    assert_eq!(
        (report["requests"].as_u64(), report["failed"].as_u64()),
        (Some(100), Some(0)),
        "errors: {}",
        report["errors"]
    );
    assert!(out.status.success(), "bench serve exited {}", out.status);
}

/// The bug: requests waiting at the gateway for room in a decode worker each asked again
/// on a timer of their own, a pause growing to 1 s, so whichever timer fired just after
/// room freed went next: a request that had just come (20 ms pause) beat one that had
/// waited long (1 s pause). Under sustained overload the oldest waited past their
/// clients' timeouts (the disaggregated example in CI: 6 of 200 timed out after 300 s
/// while the median first token took 40 s). Now they wait in arrival order.
#[test]
fn regression_requests_waiting_for_room_were_overtaken_and_timed_out() {
    let Some(model) = preheat_testkit::smollm2_gguf() else {
        return;
    };
    let mut s = stack().log(Log::Piped).start();
    // One running and one queued request: every other request waits at the gateway.
    let w = s
        .gateway
        .worker("decode", &model)
        .args(&["--max-running", "1", "--max-waiting", "1"])
        .log(Log::Piped)
        .start();
    s.decode.push(w);
    s.wait_ready(120);
    let gw = s.url().to_owned();
    rt().block_on(async {
        let c = reqwest::Client::new();
        let mut tasks = Vec::new();
        for i in 0..8u32 {
            let (c, gw) = (c.clone(), gw.clone());
            tasks.push(tokio::spawn(async move {
                let v = complete(&c, &gw, &json!([1, 2 + i, 3]), 24).await;
                assert_eq!(v["usage"]["completion_tokens"], 24, "request {i}: {v}");
                (Instant::now(), i)
            }));
            // Deliberate: requests arrive one after another, while earlier ones wait.
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        let mut done = Vec::new();
        for t in tasks {
            done.push(t.await.unwrap());
        }
        done.sort();
        let order: Vec<u32> = done.iter().map(|d| d.1).collect();
        assert_eq!(
            order,
            (0..8).collect::<Vec<_>>(),
            "finished out of arrival order"
        );
    });
}

/// A decode worker killed (SIGKILL) while it runs requests whose clients have had
/// nothing yet (not streamed): each is run again on the other decode worker and
/// completes. Before, each failed with "decode worker …: error sending request" or
/// "failed mid-stream". A seeded sample replayed answers as it would have.
#[test]
fn regression_a_killed_decode_worker_lost_requests_nothing_had_been_sent_for() {
    // Started once the workers registered and the prefill worker was announced to
    // each decode worker.
    let mut s = stack()
        .gateway(gateway().through_prefill())
        .prefill(1)
        .decode(2)
        .kv_mib(16)
        .log(Log::Null)
        .start();
    let gw = s.url().to_owned();
    rt().block_on(async {
        let c = reqwest::Client::new();
        let running = async |port: u16| -> f64 {
            let Ok(r) = c.get(format!("http://127.0.0.1:{port}/metrics")).send().await else {
                return 0.0;
            };
            r.text()
                .await
                .unwrap_or_default()
                .lines()
                .find(|l| l.starts_with("vllm:num_requests_running"))
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        let replays = async || -> f64 {
            let t = c.get(format!("{gw}/metrics")).send().await.unwrap().text().await.unwrap();
            t.lines()
                .find(|l| l.starts_with("preheat:gateway_replays_total"))
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        let body = |i: u32| {
            let prompt: Vec<u32> = (1..24).map(|t| t + 3 * i).collect();
            json!({"prompt": prompt, "max_tokens": 480, "temperature": 1.0, "seed": i, "ignore_eos": true})
        };
        let post_all = |bodies: Vec<Value>| {
            let (c, url) = (c.clone(), format!("{gw}/v1/completions"));
            tokio::spawn(futures_util::future::join_all(bodies.into_iter().map(move |b| {
                let (c, url) = (c.clone(), url.clone());
                async move {
                    let r = c.post(url).json(&b).send().await.unwrap();
                    (r.status().as_u16(), r.json::<Value>().await.unwrap_or(Value::Null))
                }
            })))
        };
        // Under load: 32 requests over both decode workers, one killed while it runs
        // its share.
        let load = post_all((0..32).map(body).collect());
        let (doomed, other) = (s.decode[0].port, s.decode[1].port);
        wait_for_async("both decode workers running requests", Duration::from_secs(30), async || {
            running(doomed).await > 0.0 && running(other).await > 0.0
        })
        .await;
        let mut dead = s.decode.remove(0);
        dead.proc.0.kill().unwrap();
        let _ = dead.proc.0.wait();
        let answers = tokio::time::timeout(Duration::from_secs(120), load)
            .await
            .expect("requests still open 120 s after the kill")
            .unwrap();
        let lost: Vec<&Value> = answers.iter().filter(|(st, _)| *st != 200).map(|(_, r)| r).collect();
        assert!(lost.is_empty(), "{} of 32 requests failed: {lost:?}", lost.len());
        for (i, (_, a)) in answers.iter().enumerate() {
            assert_eq!(a["usage"]["completion_tokens"], 480, "request {i}: {a}");
        }
        let replayed_under_load = replays().await;
        assert!(replayed_under_load >= 1.0, "the kill found nothing to replay");

        // A seeded sample replays to the same answer. Alone, so that the reference and
        // the replay run in batches of one (a batch's shape changes the logits' last
        // bits, which can flip a sample), each after the prompt is cached. Alone, the
        // request runs for a fraction of a second: where it finished before the kill,
        // the try is made again with a new decode worker.
        let one = || post_all(vec![body(99)]);
        let mut tried = 0;
        let (answer, reference) = loop {
            tried += 1;
            assert!(tried <= 5, "the seeded request finished before the kill five times");
            s.add("decode");
            s.wait_ready(60);
            let warm = one().await.unwrap();
            assert_eq!(warm[0].0, 200, "{}", warm[0].1);
            let reference = one().await.unwrap().remove(0).1;
            let before = replays().await;
            let replayed = one();
            let ports: Vec<u16> = s.decode.iter().map(|d| d.port).collect();
            // Looked for without a pause: it runs for a fraction of a second.
            let busy = Wait::new("the seeded request running", Duration::from_secs(30))
                .every(Duration::ZERO)
                .until_async(async || {
                    for (i, p) in ports.iter().enumerate() {
                        if running(*p).await > 0.0 {
                            return Some(i);
                        }
                    }
                    None
                })
                .await;
            let mut dead = s.decode.remove(busy);
            dead.proc.0.kill().unwrap();
            let _ = dead.proc.0.wait();
            let (st, a) = tokio::time::timeout(Duration::from_secs(60), replayed)
                .await
                .expect("the seeded request still open 60 s after the kill")
                .unwrap()
                .remove(0);
            assert_eq!(st, 200, "{a}");
            if replays().await > before {
                break (a, reference);
            }
        };
        assert_eq!(
            answer["choices"][0]["text"], reference["choices"][0]["text"],
            "the seeded request sampled another answer on its replay"
        );
    });
}
