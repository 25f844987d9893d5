use super::*;
use crate::kv::transfer::{FORMAT_VERSION, KvHeader, KvMessage};
use crate::sampling::SamplingParams;

fn msg(request_id: &str, prompt: Vec<u32>, params: SamplingParams) -> KvMessage {
    KvMessage {
        header: KvHeader {
            version: FORMAT_VERSION,
            request_id: request_id.into(),
            compat: "0".repeat(16),
            // Forged: hashes that would file this K/V under another prefix.
            block_hashes: vec![42; prompt.len() / 4],
            prompt,
            first_token: 1,
            first_logprob: None,
            first_top_logprobs: Vec::new(),
            params,
            rng_state: 0,
            num_layers: 1,
            num_blocks: 1,
            block_bytes: 1,
            payload_xxh3: String::new(),
        },
        payload: Vec::new(),
    }
}

#[test]
fn kv_is_taken_only_for_its_request_and_hashed_here() {
    let params = SamplingParams::default();
    let b = GenerateBody {
        request_id: "r1".into(),
        prompt: (1..=8).collect(),
        params: params.clone(),
        prefill: Some("tcp://p:1".into()),
    };
    let other_params = SamplingParams {
        temperature: 0.0,
        ..params.clone()
    };
    for (why, mut m) in [
        (
            "another request",
            msg("r2", b.prompt.clone(), params.clone()),
        ),
        (
            "another prompt",
            msg("r1", (2..=9).collect(), params.clone()),
        ),
        (
            "other parameters",
            msg("r1", b.prompt.clone(), other_params),
        ),
    ] {
        assert!(
            check_matches(&mut m, &b, 4, crate::kv::PrefixKey::UNKEYED).is_err(),
            "{why} accepted"
        );
    }
    let mut m = msg("r1", b.prompt.clone(), params);
    check_matches(&mut m, &b, 4, crate::kv::PrefixKey::UNKEYED).unwrap();
    assert_eq!(
        m.header.block_hashes,
        crate::kv::PrefixKey::UNKEYED.block_hashes(&b.prompt, 4),
        "the wire's block hashes were kept"
    );
}
