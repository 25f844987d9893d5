//! GGUF container, model config and tokenizer rebuild.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = preheat_snapshot::source::gguf::validate_bytes(data);
});
