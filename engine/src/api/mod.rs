//! The OpenAI-compatible HTTP API over a [`Frontend`]: the local engine, or a
//! gateway's front.

mod choices;
pub mod error;
pub mod openai;
mod respond;
mod tools;
pub mod unread_fields;

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};

use self::error::ApiError;
use self::openai::{ChatRequest, CompletionRequest, Prompt};
use self::respond::{Style, generate};
use crate::engine::Engine;
use crate::frontend::Frontend;
use crate::{EngineError, Result};

/// Largest request body accepted.
pub const DEFAULT_MAX_BODY: usize = 4 << 20;

/// What requests are served through, shared by every connection.
type Front = Arc<dyn Frontend>;

/// The models the API serves: a front per model name, and the models configured
/// but not servable, with why.
#[derive(Default)]
struct Fronts {
    by_name: BTreeMap<String, Front>,
    unavailable: BTreeMap<String, String>,
}

/// Shared state of the API: a front per served model once it is loaded (one for an
/// engine, one per model for a gateway).
#[derive(Clone)]
pub struct ApiState {
    fronts: Arc<RwLock<Fronts>>,
    /// A standby's loaded engine, waiting for promotion.
    parked: Arc<std::sync::Mutex<Option<Engine>>>,
    max_body: usize,
    /// The API's keys, when it asks for them (their per-key counts join `/metrics`).
    api_keys: Option<Arc<preheat_edge::ApiKeys>>,
}

impl std::fmt::Debug for ApiState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiState")
            .field("state", &self.state())
            .field("max_body", &self.max_body)
            .finish_non_exhaustive()
    }
}

impl ApiState {
    #[must_use]
    pub fn new(max_body: usize) -> Self {
        ApiState {
            fronts: Arc::default(),
            parked: Arc::default(),
            max_body,
            api_keys: None,
        }
    }

    /// Asks clients of `/v1/*` for one of `keys` (see [`public_router`]).
    #[must_use]
    pub fn with_api_keys(mut self, keys: Option<Arc<preheat_edge::ApiKeys>>) -> Self {
        self.api_keys = keys;
        self
    }

    /// Installs the loaded engine; `/health` turns 200.
    pub fn set_engine(&self, e: Engine) {
        self.set_frontend(Arc::new(e));
    }

    /// Serves `front`'s model through it from now on (the first front installed for a
    /// name stays).
    pub fn set_frontend(&self, front: Front) {
        let mut f = self.write();
        let name = front.model_name().to_owned();
        f.unavailable.remove(&name);
        f.by_name.entry(name).or_insert(front);
    }

    /// Names a configured model that cannot be served, and why: requests for it are
    /// answered 503 with the cause, and the other models serve.
    pub fn set_unavailable(&self, model: &str, why: impl Into<String>) {
        let mut f = self.write();
        if !f.by_name.contains_key(model) {
            f.unavailable.insert(model.to_owned(), why.into());
        }
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Fronts> {
        self.fronts
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Fronts> {
        self.fronts
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Every front installed, in model-name order.
    fn all(&self) -> Vec<Front> {
        self.read().by_name.values().cloned().collect()
    }

    /// Holds a loaded engine as a parked standby: `/health` stays 503 and the API
    /// refuses requests until [`ApiState::promote`].
    pub fn park(&self, e: Engine) {
        *self.parked.lock().expect("no panics while held") = Some(e);
    }

    /// Serves the parked engine from now on; the start-up record restarts with
    /// source `standby`. Returns the seconds promotion took, `None` when nothing is
    /// parked.
    pub fn promote(&self) -> Option<f64> {
        let t0 = std::time::Instant::now();
        let e = self.parked.lock().expect("no panics while held").take()?;
        e.metrics.set_startup_origin(t0, "standby");
        let m = Arc::clone(&e.metrics);
        self.set_engine(e);
        Some(m.mark_startup("ready"))
    }

    /// `loading`, `standby` or `serving`.
    #[must_use]
    pub fn state(&self) -> &'static str {
        if !self.read().by_name.is_empty() {
            "serving"
        } else if self.parked.lock().expect("no panics while held").is_some() {
            "standby"
        } else {
            "loading"
        }
    }

    /// What requests are served through, once loaded: the one front (the first, in
    /// name order, where there are several).
    pub fn front(&self) -> Result<Front> {
        self.read()
            .by_name
            .values()
            .next()
            .cloned()
            .ok_or_else(|| EngineError::Unavailable("the model is still loading".into()))
    }

    /// The front of the model a request names (`model`); a request that names none is
    /// served where one model is served, and refused by name where there are several.
    pub fn front_for(&self, model: Option<&str>) -> Result<Front> {
        let f = self.read();
        let Some(model) = model else {
            let mut names = f.by_name.keys().chain(f.unavailable.keys());
            return match (
                f.by_name.values().next(),
                f.by_name.len() + f.unavailable.len(),
            ) {
                (Some(front), 1) => Ok(Arc::clone(front)),
                (_, 0) => Err(EngineError::Unavailable(
                    "the model is still loading".into(),
                )),
                (None, 1) => {
                    let name = names.next().cloned().unwrap_or_default();
                    Err(unavailable(&name, &f.unavailable[&name]))
                }
                _ => Err(EngineError::invalid(
                    format!(
                        "this server serves several models; name one in `model`: {}",
                        names.cloned().collect::<Vec<_>>().join(", ")
                    ),
                    "model",
                )),
            };
        };
        if let Some(front) = f.by_name.get(model) {
            return Ok(Arc::clone(front));
        }
        if let Some(why) = f.unavailable.get(model) {
            return Err(unavailable(model, why));
        }
        if f.by_name.is_empty() && f.unavailable.is_empty() {
            return Err(EngineError::Unavailable(
                "the model is still loading".into(),
            ));
        }
        Err(EngineError::UnknownModel {
            model: model.to_owned(),
            known: f
                .by_name
                .keys()
                .chain(f.unavailable.keys())
                .cloned()
                .collect(),
        })
    }
}

/// A configured model that cannot be served: 503, naming the cause.
fn unavailable(model: &str, why: &str) -> EngineError {
    EngineError::NoWorkers {
        message: format!("model {model:?} cannot be served: {why}"),
        retry_after_secs: 30,
    }
}

/// The client-facing routes (OpenAI API, `/health`, `/metrics`) as a public listener
/// serves them: `/internal/` answers 404 and, with API keys, `/v1/*` needs one.
pub fn public_router(state: ApiState) -> Router {
    let keys = state.api_keys.clone();
    let r = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .with_state(state);
    preheat_edge::routes::public(r, keys)
}

/// A parked standby's control routes (`/internal/state`, `/internal/promote`), for an
/// [`preheat_edge::listener::InternalServer`] (the cluster token on all but `/health`
/// and `/metrics`).
pub fn control_router(state: ApiState) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/internal/state", get(state_route))
        .route("/internal/promote", post(promote_route))
        .with_state(state)
}

async fn state_route(State(st): State<ApiState>) -> Response {
    axum::Json(serde_json::json!({"state": st.state()})).into_response()
}

async fn promote_route(State(st): State<ApiState>) -> Response {
    match st.promote() {
        Some(secs) => axum::Json(serde_json::json!({"state": "serving", "promote_ms": secs * 1e3}))
            .into_response(),
        None => (
            StatusCode::CONFLICT,
            axum::Json(
                serde_json::json!({"state": st.state(), "error": "nothing parked to promote"}),
            ),
        )
            .into_response(),
    }
}

async fn health(State(st): State<ApiState>) -> Response {
    // Healthy while any model can be served (a gateway's others may be unavailable).
    let fronts = st.all();
    let front = fronts.iter().find(|f| f.is_alive()).or(fronts.first());
    health_of(front.map(|f| &**f))
}

async fn metrics(State(st): State<ApiState>) -> Response {
    let fronts = st.all();
    if fronts.is_empty()
        && let Some(e) = st.parked.lock().expect("no panics while held").as_ref()
    {
        // A standby reports its load phases while parked.
        return metrics_of(Some(e as &dyn Frontend));
    }
    let mut r = match fronts.as_slice() {
        [] => metrics_of(None),
        [one] => metrics_of(Some(&**one)),
        several => text_metrics(render_merged(several.iter().map(|f| &**f))),
    };
    if let Some(keys) = &st.api_keys
        && let Ok(more) = prometheus::TextEncoder::new().encode_to_string(&keys.registry().gather())
    {
        let body = std::mem::take(r.body_mut());
        let mut text = axum::body::to_bytes(body, usize::MAX)
            .await
            .unwrap_or_default()
            .to_vec();
        text.extend_from_slice(more.as_bytes());
        *r.body_mut() = Body::from(text);
    }
    r
}

/// `/health`: 200 once an engine is loaded, 503 before.
pub fn health_of(engine: Option<&dyn Frontend>) -> Response {
    match engine {
        Some(e) if e.is_alive() => (StatusCode::OK, "ok").into_response(),
        Some(_) => (StatusCode::SERVICE_UNAVAILABLE, "engine failed").into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, "loading").into_response(),
    }
}

/// `/metrics` in the Prometheus text format (empty before the engine loads).
pub fn metrics_of(engine: Option<&dyn Frontend>) -> Response {
    text_metrics(engine.map(|e| e.metrics().render()).unwrap_or_default())
}

fn text_metrics(body: String) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

/// Several models' metrics as one exposition: each family once, with every model's
/// series in it (a family written twice is refused by Prometheus' parser).
fn render_merged<'a>(fronts: impl Iterator<Item = &'a dyn Frontend>) -> String {
    let mut families: BTreeMap<String, prometheus::proto::MetricFamily> = BTreeMap::new();
    for f in fronts {
        for mut fam in f.metrics().registry.gather() {
            match families.get_mut(fam.name()) {
                Some(into) => {
                    let more = fam.take_metric();
                    into.mut_metric().extend(more);
                }
                None => {
                    families.insert(fam.name().to_owned(), fam);
                }
            }
        }
    }
    let all: Vec<_> = families.into_values().collect();
    prometheus::TextEncoder::new()
        .encode_to_string(&all)
        .unwrap_or_default()
}

/// Every model served, those at zero included; a configured model that cannot be
/// served is listed too, saying why.
async fn models(State(st): State<ApiState>) -> std::result::Result<Json<Value>, ApiError> {
    let (fronts, unavailable) = {
        let f = st.read();
        (
            f.by_name.values().cloned().collect::<Vec<_>>(),
            f.unavailable.clone(),
        )
    };
    if fronts.is_empty() && unavailable.is_empty() {
        return Err(EngineError::Unavailable("the model is still loading".into()).into());
    }
    let mut data: Vec<Value> = fronts
        .iter()
        .map(|e| {
            json!({
                "id": e.model_name(), "object": "model", "created": now(), "owned_by": "preheat",
                "root": e.model_name(), "max_model_len": e.max_model_len(),
            })
        })
        .collect();
    data.extend(unavailable.iter().map(|(name, why)| {
        json!({
            "id": name, "object": "model", "created": now(), "owned_by": "preheat",
            "root": name, "available": false, "reason": why,
        })
    }));
    data.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
    Ok(Json(json!({"object": "list", "data": data})))
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn request_id(prefix: &str, id: u64) -> String {
    format!("{prefix}-{:x}{id:x}", now())
}

/// Reads and parses a JSON body, with the size limit and OpenAI-style errors.
async fn parse_body<T: serde::de::DeserializeOwned>(body: Body, limit: usize) -> Result<T> {
    let bytes: Bytes = axum::body::to_bytes(body, limit).await.map_err(|_| {
        EngineError::invalid(
            format!("request body is larger than {limit} bytes or unreadable"),
            "body",
        )
    })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| EngineError::invalid(format!("invalid JSON body: {e}"), "body"))
}

/// Runs template rendering and tokenisation on the blocking pool: megabytes of text
/// take milliseconds of CPU that would otherwise stall every connection sharing this
/// runtime thread.
async fn off_runtime<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| EngineError::Internal(format!("tokenizer task: {e}")))?
}

/// Compiles the request's grammar once here (off the runtime), so one that does not
/// compile is refused naming the field that carried it.
async fn check_grammar(
    e: &Front,
    grammar: Option<(crate::sampling::grammar::Grammar, &'static str)>,
) -> Result<()> {
    if let Some((g, field)) = grammar {
        let tok = Arc::clone(e.tokenizer());
        off_runtime(move || {
            let compiler = tok.grammar().map_err(|e| {
                EngineError::invalid(
                    format!("structured outputs are not available for this model: {e}"),
                    field,
                )
            })?;
            compiler.compile(&g, field).map(drop)
        })
        .await?;
    }
    Ok(())
}

/// A request with more sequences than the engine runs at once would start some of them
/// and then be refused the rest, every time: a 400 up front instead.
fn check_capacity(e: &dyn Frontend, c: openai::Choices) -> Result<()> {
    match e.max_sequences() {
        Some(max) if c.best_of > max => {
            let param = if c.best_of > c.n { "best_of" } else { "n" };
            Err(EngineError::invalid(
                format!(
                    "{param} = {} is more sequences than this server runs at once ({max})",
                    c.best_of
                ),
                param,
            ))
        }
        _ => Ok(()),
    }
}

async fn completions(
    State(st): State<ApiState>,
    body: Body,
) -> std::result::Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(body, st.max_body).await?;
    unread_fields::check(&req.rest, unread_fields::Endpoint::Completions)?;
    let e = &st.front_for(req.common.model.as_deref())?;
    if req.echo && req.logprobs.is_some() {
        // Echo with logprobs asks for the prompt tokens' logprobs, not computed here.
        return Err(EngineError::invalid(
            "echo together with logprobs (prompt logprobs) is not supported",
            "echo",
        )
        .into());
    }
    // The cheap checks first: nothing is tokenised for a request refused anyway.
    let choices = openai::choices(&req.common, req.best_of)?;
    check_capacity(&**e, choices)?;
    let sampling = openai::sampling(&req.common, req.logprobs, 16)?;
    check_grammar(e, sampling.grammar()).await?;
    let params = sampling.params;
    let tok = Arc::clone(e.tokenizer());
    // A text prompt echoes as sent; token ids are decoded below, once known to be one.
    let mut echo_text = match (&req.prompt, req.echo) {
        (Prompt::Text(t), true) => Some(t.clone()),
        (Prompt::Texts(v), true) => v.first().cloned(),
        _ => None,
    };
    let prompt = match req.prompt {
        Prompt::Text(t) => off_runtime(move || tok.encode(&t)).await?,
        Prompt::Tokens(ids) => ids,
        Prompt::Texts(mut v) if v.len() == 1 => {
            let t = v.pop().unwrap_or_default();
            off_runtime(move || tok.encode(&t)).await?
        }
        Prompt::TokenLists(v) if v.len() == 1 => v.into_iter().next().unwrap_or_default(),
        _ => {
            return Err(EngineError::invalid(
                "batched prompts are not supported; send one prompt per request",
                "prompt",
            )
            .into());
        }
    };
    if req.echo && echo_text.is_none() {
        let (tok, ids) = (Arc::clone(e.tokenizer()), prompt.clone());
        echo_text = Some(off_runtime(move || tok.decode(&ids)).await?);
    }
    let style = Style::new(false, params.logprobs.is_some(), &req.common);
    Ok(generate(
        e,
        prompt,
        params,
        choices,
        style,
        req.common.stream,
        echo_text,
        None,
    )
    .await?)
}

async fn chat_completions(
    State(st): State<ApiState>,
    body: Body,
) -> std::result::Result<Response, ApiError> {
    let req: ChatRequest = parse_body(body, st.max_body).await?;
    unread_fields::check(&req.rest, unread_fields::Endpoint::Chat)?;
    let e = &st.front_for(req.common.model.as_deref())?;
    let top = if req.logprobs {
        Some(req.top_logprobs.unwrap_or(0))
    } else {
        None
    };
    // The cheap checks first: nothing is rendered or tokenised for a request refused
    // anyway (the real default for max_tokens needs the prompt's length, below: until
    // then the context's length stands in for it).
    let choices = openai::choices(&req.common, None)?;
    check_capacity(&**e, choices)?;
    let mut sampling = openai::sampling(&req.common, top, e.max_model_len())?;
    let tools = tools::parse(
        req.tools.as_deref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
        e.tokenizer().chat_template(true),
    )?
    .map(Arc::new);
    // The request's own grammar or the one forcing a call: never both, compiled once.
    if let Some(forced) = tools.as_deref().and_then(tools::Tools::grammar) {
        if let Some(field) = sampling.grammar_field {
            return Err(EngineError::invalid(
                format!("tool_choice forces a tool call, which {field} would constrain too; give one of them"),
                "tool_choice",
            )
            .into());
        }
        sampling.params.grammar = Some(forced);
        sampling.grammar_field = Some("tool_choice");
    }
    check_grammar(e, sampling.grammar()).await?;
    let messages = openai::to_messages(&req.messages)?;
    let tok = Arc::clone(e.tokenizer());
    let add_generation_prompt = req.add_generation_prompt;
    let raw_tools = tools.as_ref().map(|t| t.raw.clone());
    let prompt = off_runtime(move || {
        let text =
            tok.apply_chat_template(&messages, raw_tools.as_deref(), add_generation_prompt)?;
        // The template already placed BOS where the model wants it.
        tok.encode_no_bos(&text)
    })
    .await?;
    sampling.default_max_tokens(e.max_model_len().saturating_sub(prompt.len()).max(1))?;
    let mut params = sampling.params;
    if let Some(t) = &tools {
        params.stop.extend(t.stops());
    }
    let style = Style::new(true, req.logprobs, &req.common);
    Ok(generate(
        e,
        prompt,
        params,
        choices,
        style,
        req.common.stream,
        None,
        tools,
    )
    .await?)
}

/// Waits up to `grace` for `in_flight` to reach 0; what is still in flight after.
pub(crate) async fn settle(in_flight: impl Fn() -> usize, grace: Duration) -> usize {
    let deadline = tokio::time::Instant::now() + grace;
    while in_flight() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    in_flight()
}

/// Stops new requests to every model and waits up to `grace` for in-flight ones to
/// finish.
pub async fn drain(state: &ApiState, grace: Duration) {
    let fronts = state.all();
    for e in &fronts {
        e.drain();
    }
    let in_flight = || fronts.iter().map(|e| e.in_flight()).sum::<usize>();
    if settle(in_flight, grace).await > 0 {
        tracing::warn!(
            in_flight = in_flight(),
            "grace period over; exiting with requests in flight"
        );
    }
}
