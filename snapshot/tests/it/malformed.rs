//! A corpus of malformed snapshots: every one must be rejected by `Snapshot::open` (or
//! `verify`) with a typed error, never a panic and never a silently accepted file.

use preheat_snapshot::format::{ALIGN, FORMAT_VERSION, HEADER_LEN, Header};
use preheat_snapshot::{Checksum, Error, NoProgress, Snapshot, TargetDtype, convert, parse};
use serde_json::Value;

fn good() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("t.preheat");
    convert(
        &preheat_testkit::model_fixture("llama-tiny"),
        &p,
        TargetDtype::Keep,
        &NoProgress,
    )
    .unwrap();
    std::fs::read(p).unwrap()
}

fn header(b: &[u8]) -> Header {
    Header::decode(b, b.len() as u64).unwrap()
}

fn manifest(b: &[u8]) -> Value {
    let h = header(b);
    serde_json::from_slice(&b[64..64 + h.manifest_len as usize]).unwrap()
}

/// Rewrites the manifest with `edit` applied, fixing up every checksum so that only the
/// edited fact is wrong: the reader must catch it by validation, not by digest.
fn with_manifest(b: &[u8], edit: impl FnOnce(&mut Value)) -> Vec<u8> {
    let mut m = manifest(b);
    edit(&mut m);
    let json = serde_json::to_vec(&m).unwrap();
    let h = header(b);
    assert!(
        HEADER_LEN as u64 + json.len() as u64 <= h.data_offset,
        "edit made the manifest too long"
    );
    let mut out = b.to_vec();
    out[64..h.data_offset as usize].fill(0);
    out[64..64 + json.len()].copy_from_slice(&json);
    let nh = Header {
        manifest_len: json.len() as u64,
        manifest_checksum: Checksum::of(&json),
        ..h
    };
    out[..64].copy_from_slice(&nh.encode());
    out
}

fn open_bytes(b: &[u8]) -> Result<Snapshot, Error> {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.preheat");
    std::fs::write(&p, b).unwrap();
    Snapshot::open(&p)
}

#[test]
fn the_unmodified_file_opens_and_parses() {
    let b = good();
    assert!(parse(&b).is_ok());
    assert!(open_bytes(&b).is_ok());
    assert!(with_manifest(&b, |_| {}).len() == b.len());
    assert!(
        open_bytes(&with_manifest(&b, |_| {})).is_ok(),
        "the helper itself must not break files"
    );
}

#[test]
fn truncated_at_every_section_boundary() {
    let b = good();
    let h = header(&b);
    let m = manifest(&b);
    let mut cuts = vec![
        0,
        1,
        7,
        8,
        12,
        63,
        64,
        65,
        64 + h.manifest_len / 2,
        64 + h.manifest_len,
        h.data_offset,
    ];
    for t in m["tensors"].as_array().unwrap() {
        let (o, n) = (t["offset"].as_u64().unwrap(), t["nbytes"].as_u64().unwrap());
        cuts.extend([o, o + 1, o + n / 2, o + n - 1]);
    }
    cuts.push(b.len() as u64 - 1);
    for cut in cuts {
        let r = open_bytes(&b[..cut as usize]);
        assert!(r.is_err(), "truncated at {cut} opened");
        assert!(
            matches!(r, Err(Error::Truncated { .. } | Error::BadMagic { .. })),
            "cut {cut}: {r:?}"
        );
    }
}

#[test]
fn trailing_garbage_is_rejected() {
    let mut b = good();
    b.extend_from_slice(&[0u8; 100]);
    assert!(matches!(open_bytes(&b), Err(Error::OutOfBounds { .. })));
}

#[test]
fn random_bytes_and_random_corruption_never_panic() {
    let b = good();
    let mut s = 0x1234_5678_9abc_def0u64;
    let mut next = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    for len in [0usize, 3, 64, 100, 4096, 10_000] {
        let junk: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        assert!(parse(&junk).is_err());
    }
    // Random junk after a valid magic.
    let mut junk: Vec<u8> = (0..8192).map(|_| next() as u8).collect();
    junk[..8].copy_from_slice(b"PREHEAT\0");
    assert!(parse(&junk).is_err());
    // Flip random bytes in header and manifest: digests must catch every one.
    let end = 64 + header(&b).manifest_len as usize;
    for _ in 0..2000 {
        let mut c = b.clone();
        let i = next() as usize % end;
        c[i] ^= (next() as u8) | 1;
        assert!(parse(&c).is_err(), "flip at {i} accepted");
    }
}

/// One manifest mutation of the corpus.
type Edit = Box<dyn Fn(&mut Value)>;

#[test]
fn manifest_facts_are_validated() {
    let b = good();
    let len = b.len() as u64;
    let cases: Vec<(&str, Edit)> = vec![
        (
            "offset past the end",
            Box::new(move |m| m["tensors"][0]["offset"] = (len + ALIGN).into()),
        ),
        (
            "offset near u64::MAX",
            Box::new(|m| m["tensors"][0]["offset"] = (u64::MAX - 4095).into()),
        ),
        (
            "unaligned offset",
            Box::new(|m| {
                let o = m["tensors"][0]["offset"].as_u64().unwrap();
                m["tensors"][0]["offset"] = (o + 4).into();
            }),
        ),
        (
            "overlapping tensors",
            Box::new(|m| {
                let o = m["tensors"][0]["offset"].clone();
                m["tensors"][1]["offset"] = o;
            }),
        ),
        (
            "tensor inside the manifest region",
            Box::new(|m| m["tensors"][0]["offset"] = 0.into()),
        ),
        (
            "shape disagrees with nbytes",
            Box::new(|m| m["tensors"][0]["shape"][0] = 3.into()),
        ),
        (
            "shape overflows",
            Box::new(|m| m["tensors"][0]["shape"] = serde_json::json!([u64::MAX, u64::MAX])),
        ),
        (
            "unknown dtype",
            Box::new(|m| m["tensors"][0]["dtype"] = "q4_k".into()),
        ),
        (
            "duplicate name",
            Box::new(|m| {
                let n = m["tensors"][0]["name"].clone();
                m["tensors"][1]["name"] = n;
            }),
        ),
        (
            "format version mismatch",
            Box::new(|m| m["format_version"] = 2.into()),
        ),
        (
            "bad config",
            Box::new(|m| m["model"]["num_key_value_heads"] = 3.into()),
        ),
        (
            "tokenizer past the end",
            Box::new(move |m| m["tokenizer"]["blob"]["offset"] = (len * 2).into()),
        ),
        (
            "missing tensors key",
            Box::new(|m| {
                m.as_object_mut().unwrap().remove("tensors");
            }),
        ),
        (
            "checksum not hex",
            Box::new(|m| m["tensors"][0]["checksum"] = "zzzzzzzzzzzzzzzz".into()),
        ),
    ];
    for (what, edit) in cases {
        let r = open_bytes(&with_manifest(&b, edit));
        assert!(r.is_err(), "{what}: accepted");
        let e = r.unwrap_err();
        match what {
            "unknown dtype" => assert!(matches!(e, Error::UnknownDtype { .. }), "{what}: {e}"),
            "offset past the end" | "overlapping tensors" | "unaligned offset" => {
                assert!(matches!(e, Error::OutOfBounds { .. }), "{what}: {e}")
            }
            _ => {}
        }
    }
}

#[test]
fn header_level_faults_are_typed() {
    let b = good();
    let mut v = b.clone();
    v[0] = b'X';
    assert!(matches!(open_bytes(&v), Err(Error::BadMagic { .. })));
    let h = header(&b);
    let mut v = b.clone();
    v[..64].copy_from_slice(
        &Header {
            version: FORMAT_VERSION + 1,
            ..h
        }
        .encode(),
    );
    assert!(matches!(
        open_bytes(&v),
        Err(Error::UnsupportedVersion { found: 2, .. })
    ));
    let mut v = b.clone();
    v[..64].copy_from_slice(
        &Header {
            manifest_len: h.data_offset,
            ..h
        }
        .encode(),
    );
    assert!(matches!(open_bytes(&v), Err(Error::OutOfBounds { .. })));
    let mut v = b.clone();
    v[70] ^= 1;
    assert!(
        matches!(open_bytes(&v), Err(Error::ChecksumMismatch { ref what, .. }) if what == "manifest")
    );
}

#[test]
fn corrupt_tensor_data_opens_but_verify_names_the_tensor() {
    let b = good();
    let m = manifest(&b);
    let t = &m["tensors"][5];
    let name = t["name"].as_str().unwrap();
    let mut v = b.clone();
    v[t["offset"].as_u64().unwrap() as usize + 17] ^= 0x40;
    let snap = open_bytes(&v).expect("open does not read tensor data");
    let report = snap.verify(2).unwrap();
    assert_eq!(report.mismatches.len(), 1);
    assert_eq!(report.mismatches[0].name, name);
    let err = report.into_result().unwrap_err();
    assert!(err.to_string().contains(name), "{err}");
    // A corrupt tokenizer is caught where it is read.
    let tok = m["tokenizer"]["blob"]["offset"].as_u64().unwrap() as usize;
    let mut v = b.clone();
    v[tok + 3] ^= 1;
    let snap = open_bytes(&v).unwrap();
    assert!(snap.tokenizer_json().is_err());
}
