//! The `preheat snapshot` command-line contract that other parts and their tests use.

mod harness;

use harness::{ok, ok_json, preheat};
use preheat_testkit::model_fixture;

#[test]
fn convert_inspect_verify() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("llama.preheat");
    let s = ok(["snapshot", "convert"].map(Into::into).into_iter().chain([
        model_fixture("llama-tiny").into_os_string(),
        "-o".into(),
        out.clone().into_os_string(),
    ]));
    assert!(s.contains("21 tensors"), "{s}");
    let j = ok_json([
        "snapshot".as_ref(),
        "inspect".as_ref(),
        out.as_os_str(),
        "--json".as_ref(),
    ]);
    let tensors = j["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), 21);
    let len = std::fs::metadata(&out).unwrap().len();
    for t in tensors {
        for key in ["name", "dtype", "shape", "offset", "nbytes"] {
            assert!(t.get(key).is_some(), "{key} missing in {t}");
        }
        let (off, n) = (t["offset"].as_u64().unwrap(), t["nbytes"].as_u64().unwrap());
        assert_eq!(off % 4096, 0);
        assert!(off + n <= len);
    }
    assert_eq!(j["model"]["hidden_size"], 64);
    let human = ok(["snapshot".as_ref(), "inspect".as_ref(), out.as_os_str()]);
    assert!(
        human.contains("model.layers.1.mlp.down_proj.weight"),
        "{human}"
    );
    let v = ok(["snapshot".as_ref(), "verify".as_ref(), out.as_os_str()]);
    assert!(v.starts_with("ok:"), "{v}");
}

#[test]
fn verify_fails_naming_the_corrupt_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q.preheat");
    ok([
        "snapshot".as_ref(),
        "convert".as_ref(),
        model_fixture("qwen2-tiny").as_os_str(),
        "-o".as_ref(),
        out.as_os_str(),
        "--dtype".as_ref(),
        "bf16".as_ref(),
    ]);
    let j = ok_json([
        "snapshot".as_ref(),
        "inspect".as_ref(),
        out.as_os_str(),
        "--json".as_ref(),
    ]);
    let victim = &j["tensors"][3];
    assert_eq!(victim["dtype"], "bf16");
    let mut bytes = std::fs::read(&out).unwrap();
    bytes[victim["offset"].as_u64().unwrap() as usize + 2] ^= 1;
    std::fs::write(&out, bytes).unwrap();
    let r = preheat(["snapshot".as_ref(), "verify".as_ref(), out.as_os_str()]);
    assert!(!r.status.success());
    let stdout = String::from_utf8_lossy(&r.stdout);
    assert!(
        stdout.contains(victim["name"].as_str().unwrap()),
        "{stdout}"
    );
    let rj = preheat([
        "snapshot".as_ref(),
        "verify".as_ref(),
        out.as_os_str(),
        "--json".as_ref(),
    ]);
    assert!(!rj.status.success());
    let v: serde_json::Value = serde_json::from_slice(&rj.stdout).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(v["corrupt"][0]["name"], victim["name"]);
}

#[test]
fn synth_pack_unpack_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().join("tiny.preheat");
    let pk = dir.path().join("tiny.phpack");
    let back = dir.path().join("back.preheat");
    let s = ok_json([
        "snapshot".as_ref(),
        "synth".as_ref(),
        "--preset".as_ref(),
        "tiny".as_ref(),
        "-o".as_ref(),
        snap.as_os_str(),
        "--json".as_ref(),
    ]);
    assert_eq!(s["tensors"], 21);
    let p = ok_json([
        "snapshot".as_ref(),
        "pack".as_ref(),
        snap.as_os_str(),
        "-o".as_ref(),
        pk.as_os_str(),
        "--json".as_ref(),
    ]);
    assert!(p["ratio"].as_f64().unwrap() > 1.0);
    ok([
        "snapshot".as_ref(),
        "unpack".as_ref(),
        pk.as_os_str(),
        "-o".as_ref(),
        back.as_os_str(),
    ]);
    assert_eq!(std::fs::read(&snap).unwrap(), std::fs::read(&back).unwrap());
}

#[test]
fn bad_input_is_a_clear_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.preheat");
    std::fs::write(&junk, b"definitely not a snapshot").unwrap();
    for args in [
        vec![
            "snapshot".into(),
            "inspect".into(),
            junk.clone().into_os_string(),
        ],
        vec![
            "snapshot".into(),
            "verify".into(),
            junk.clone().into_os_string(),
        ],
        vec![
            "snapshot".into(),
            "unpack".into(),
            junk.clone().into_os_string(),
            "-o".into(),
            dir.path().join("x").into_os_string(),
        ],
        vec![
            "snapshot".into(),
            "convert".into(),
            junk.clone().into_os_string(),
            "-o".into(),
            dir.path().join("y").into_os_string(),
        ],
        vec![
            "snapshot".into(),
            "synth".into(),
            "--preset".into(),
            "nope".into(),
            "-o".into(),
            dir.path().join("z").into_os_string(),
        ],
    ] {
        let r = preheat(&args);
        let err = String::from_utf8_lossy(&r.stderr);
        assert_eq!(r.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.starts_with("error: "), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn help_explains_each_command() {
    let h = ok(["snapshot", "--help"]);
    for cmd in ["convert", "inspect", "verify", "pack", "unpack", "synth"] {
        assert!(h.contains(cmd), "{cmd} missing from help:\n{h}");
    }
}
