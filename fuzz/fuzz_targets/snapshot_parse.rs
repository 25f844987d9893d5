//! Header and manifest validation of a whole snapshot image.
#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = preheat_snapshot::parse(data);
});
