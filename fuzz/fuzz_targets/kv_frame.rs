//! A KV transfer message as a peer sends it (header, then payload), checked against a
//! small layout: every input is refused or accepted without a panic, and nothing is
//! allocated beyond the bound the reader is given.
#![no_main]
use preheat_engine::backend::KvLayout;
use preheat_engine::disagg::wire::kv_message::KvMessage;
use preheat_engine::kv::payload::compat_hash;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let layout = KvLayout {
        num_layers: 2,
        num_blocks: 0,
        block_size: 4,
        num_kv_heads: 2,
        head_dim: 8,
    };
    let compat = compat_hash(0, &layout);
    let _ = KvMessage::from_vec(data.to_vec(), &compat, &layout, 1 << 20);
    // The streaming reader, as the KV port's client runs it.
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let mut r = data;
    let _ = rt.block_on(KvMessage::read_from(&mut r, &compat, &layout, 1 << 20));
});
