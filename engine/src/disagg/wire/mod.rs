//! Everything that crosses between preheat's processes on the disaggregated path, and
//! how it is read back:
//!
//! - gateway ⇄ workers, JSON over HTTP ([`messages`]): registration, heartbeats,
//!   load, the model, the generate request, and the decode worker's NDJSON events;
//!   the gateway's typed side of a generate request is [`decode_client`] (a stream of
//!   events, or a [`decode_client::Refusal`]).
//! - prefill → decode worker, one K/V message per sequence ([`kv_message`]: an
//!   exported sequence with its header and digest), pulled through a
//!   [`kv_transport::KvTransport`]: the KV port's TCP frames behind a cluster-token
//!   handshake ([`tcp`]), or the body of an HTTP answer ([`http_pull`]).

pub mod decode_client;
pub mod http_pull;
pub mod kv_message;
pub mod kv_transport;
pub mod messages;
pub mod tcp;
