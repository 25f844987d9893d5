//! Packed-file header and chunk table.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = preheat_snapshot::packed::PackedIndex::parse(data, data.len() as u64);
});
