//! Packed encoding: bit-exact round trips, corruption caught per chunk, resumption.

use preheat_snapshot::packed::{self, Codec, PackOptions, PackedIndex};
use preheat_snapshot::synth::{SynthOptions, synthesize};
use preheat_snapshot::{DType, Error, NoProgress, Snapshot};

fn synth(dir: &std::path::Path) -> std::path::PathBuf {
    let p = dir.join("tiny.preheat");
    synthesize(
        "tiny",
        &p,
        SynthOptions {
            dtype: DType::BF16,
            seed: 3,
            threads: 2,
        },
        &NoProgress,
    )
    .unwrap();
    p
}

fn small_chunks() -> PackOptions {
    PackOptions {
        chunk_size: 16 << 10,
        threads: 3,
        ..PackOptions::default()
    }
}

#[test]
fn round_trip_is_bit_exact_and_uses_byte_planes() {
    let dir = tempfile::tempdir().unwrap();
    let src = synth(dir.path());
    let pk = dir.path().join("t.phpack");
    let out = dir.path().join("back.preheat");
    let s = packed::pack(&src, &pk, small_chunks(), &NoProgress).unwrap();
    assert!(s.ratio() > 1.2, "ratio {}", s.ratio());
    let bytes = std::fs::read(&pk).unwrap();
    let idx = PackedIndex::parse(&bytes, bytes.len() as u64).unwrap();
    assert!(idx.chunks.iter().any(|c| c.codec == Codec::ZstdPlanes16));
    let u = packed::unpack(&pk, &out, 2, &NoProgress).unwrap();
    assert_eq!(u.resumed_chunks, 0);
    assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&out).unwrap());
    assert!(
        Snapshot::open(&out)
            .unwrap()
            .verify(2)
            .unwrap()
            .mismatches
            .is_empty()
    );
    assert!(!packed::partial_path(&out).exists());
}

#[test]
fn byte_planes_beat_plain_zstd_on_bf16() {
    let dir = tempfile::tempdir().unwrap();
    let src = synth(dir.path());
    let a = packed::pack(
        &src,
        &dir.path().join("a"),
        PackOptions::default(),
        &NoProgress,
    )
    .unwrap();
    let b = packed::pack(
        &src,
        &dir.path().join("b"),
        PackOptions {
            byte_planes: false,
            ..PackOptions::default()
        },
        &NoProgress,
    )
    .unwrap();
    assert!(a.packed_len < b.packed_len, "{a:?} vs {b:?}");
}

#[test]
fn corrupt_chunk_fails_and_publishes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let src = synth(dir.path());
    let pk = dir.path().join("t.phpack");
    packed::pack(&src, &pk, small_chunks(), &NoProgress).unwrap();
    let mut bytes = std::fs::read(&pk).unwrap();
    let idx = PackedIndex::parse(&bytes, bytes.len() as u64).unwrap();
    let c = idx.chunks[idx.chunks.len() / 2];
    bytes[(c.packed_offset + c.packed_len / 2) as usize] ^= 0x55;
    std::fs::write(&pk, &bytes).unwrap();
    let out = dir.path().join("back.preheat");
    let err = packed::unpack(&pk, &out, 2, &NoProgress).unwrap_err();
    assert!(
        matches!(
            err,
            Error::ChecksumMismatch { .. } | Error::InvalidPacked(_)
        ),
        "{err}"
    );
    assert!(!out.exists());
}

#[test]
fn malformed_packed_headers_are_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let src = synth(dir.path());
    let pk = dir.path().join("t.phpack");
    packed::pack(&src, &pk, small_chunks(), &NoProgress).unwrap();
    let bytes = std::fs::read(&pk).unwrap();
    let n = bytes.len() as u64;
    assert!(PackedIndex::parse(&bytes[..10], n).is_err());
    assert!(
        PackedIndex::parse(&bytes, n - 1000).is_err(),
        "chunks past the end"
    );
    for i in [0usize, 9, 20, 40, 70, 100] {
        let mut c = bytes.clone();
        c[i] ^= 1;
        assert!(PackedIndex::parse(&c, n).is_err(), "flip at {i}");
    }
}

#[test]
fn interrupted_unpack_resumes_from_intact_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let src = synth(dir.path());
    let pk = dir.path().join("t.phpack");
    packed::pack(&src, &pk, small_chunks(), &NoProgress).unwrap();
    let out = dir.path().join("back.preheat");
    packed::unpack(&pk, &out, 2, &NoProgress).unwrap();
    // Simulate a crash: the partial file holds every chunk but two, one of them torn.
    let partial = packed::partial_path(&out);
    std::fs::rename(&out, &partial).unwrap();
    let bytes = std::fs::read(&pk).unwrap();
    let idx = PackedIndex::parse(&bytes, bytes.len() as u64).unwrap();
    let mut p = std::fs::read(&partial).unwrap();
    let (c1, c2) = (idx.chunks[1], idx.chunks[idx.chunks.len() - 2]);
    p[c1.orig_offset as usize..(c1.orig_offset + c1.orig_len) as usize].fill(0);
    p[(c2.orig_offset + 5) as usize] ^= 0xff;
    std::fs::write(&partial, &p).unwrap();
    let u = packed::unpack(&pk, &out, 2, &NoProgress).unwrap();
    assert_eq!(u.resumed_chunks, u.chunks - 2);
    assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&out).unwrap());
}

#[test]
fn writer_failure_leaves_nothing_behind() {
    use preheat_snapshot::synth::{llama_tensors, preset_config};
    use preheat_snapshot::{SnapshotBuilder, manifest::SourceInfo};
    let dir = tempfile::tempdir().unwrap();
    let dest = dir.path().join("fail.preheat");
    let cfg = preset_config("tiny").unwrap();
    let mut b = SnapshotBuilder::new(cfg.clone(), SourceInfo::default());
    b.tensors = llama_tensors(&cfg, DType::F32);
    let r = b.write(
        &dest,
        |i, spec, out| {
            if i == 5 {
                return Err(Error::InvalidSource("source vanished".into()));
            }
            out.resize(spec.nbytes()? as usize, 0);
            Ok(())
        },
        &NoProgress,
    );
    assert!(r.is_err());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "no file, no temp file"
    );
}

#[test]
fn regression_written_snapshots_were_unreadable_by_other_users() {
    // The bug: snapshots and packed files kept their temporary file's 0600, so a
    // worker running as a non-root user could not map what a converter or the
    // warm-pool agent (another user) had written.
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let src = synth(dir.path());
    let pk = dir.path().join("t.phpack");
    packed::pack(&src, &pk, small_chunks(), &NoProgress).unwrap();
    for f in [&src, &pk] {
        let mode = std::fs::metadata(f).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o644, "{}: {mode:o}", f.display());
    }
}
