//! Hugging Face checkpoints: values survive conversion exactly (or rounded to nearest
//! even when narrowing), in every config form and shard layout the format allows.

use std::path::Path;

use half::bf16;
use preheat_snapshot::{DType, Error, NoProgress, RopeScaling, Snapshot, TargetDtype, convert};
use safetensors::SafeTensors;

fn reference_tensors(dir: &Path) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| {
            let vals = t
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (n, t.shape().to_vec(), vals)
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn fixtures_round_trip_exactly_and_narrow_with_rounding() {
    for model in ["llama-tiny", "qwen2-tiny"] {
        let src = preheat_testkit::model_fixture(model);
        let dir = tempfile::tempdir().unwrap();
        let keep = dir.path().join("keep.preheat");
        let narrow = dir.path().join("bf16.preheat");
        convert(&src, &keep, TargetDtype::Keep, &NoProgress).unwrap();
        convert(&src, &narrow, TargetDtype::To(DType::BF16), &NoProgress).unwrap();
        let (k, n) = (
            Snapshot::open(&keep).unwrap(),
            Snapshot::open(&narrow).unwrap(),
        );
        for (name, shape, vals) in reference_tensors(&src) {
            let t = k.require(&name).unwrap();
            assert_eq!(
                t.shape().iter().map(|&d| d as usize).collect::<Vec<_>>(),
                shape
            );
            assert_eq!(t.as_f32().unwrap(), vals.as_slice(), "{model} {name}");
            let b = n.require(&name).unwrap().as_bf16().unwrap();
            assert!(
                b.iter().zip(&vals).all(|(b, v)| *b == bf16::from_f32(*v)),
                "{model} {name}"
            );
            // Zero-copy views really point into the mapping, page-aligned.
            assert_eq!(t.bytes.as_ptr() as usize % 4096, 0);
        }
        let tok = tokenizers::Tokenizer::from_bytes(k.tokenizer_json().unwrap().unwrap()).unwrap();
        assert!(tok.get_vocab_size(true) >= 512);
        assert!(
            k.manifest()
                .chat_template
                .as_deref()
                .unwrap()
                .contains("im_start")
        );
        assert_eq!(
            k.manifest()
                .tokenizer
                .as_ref()
                .unwrap()
                .eos_token
                .as_deref(),
            Some("<|im_end|>")
        );
    }
}

#[test]
fn qwen2_biases_and_config() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("q.preheat");
    convert(
        &preheat_testkit::model_fixture("qwen2-tiny"),
        &out,
        TargetDtype::Keep,
        &NoProgress,
    )
    .unwrap();
    let s = Snapshot::open(&out).unwrap();
    assert!(s.manifest().model.attention_bias);
    assert!(s.tensor("model.layers.0.self_attn.q_proj.bias").is_some());
    assert!(s.tensor("model.layers.0.self_attn.o_proj.bias").is_none());
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

#[test]
fn sharded_checkpoint_gives_the_same_tensors() {
    let src = preheat_testkit::model_fixture("llama-tiny");
    let dir = tempfile::tempdir().unwrap();
    let sharded = dir.path().join("sharded");
    copy_dir(&src, &sharded);
    std::fs::remove_file(sharded.join("model.safetensors")).unwrap();
    // Split tensors across two shards with an index, as `save_pretrained` does.
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(str::to_owned).collect();
    names.sort();
    let mut weight_map = serde_json::Map::new();
    for (k, part) in names.chunks(names.len() / 2 + 1).enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", k + 1);
        let views: Vec<_> = part
            .iter()
            .map(|n| (n.clone(), st.tensor(n).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &sharded.join(&file)).unwrap();
        for n in part {
            weight_map.insert(n.clone(), file.clone().into());
        }
    }
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        serde_json::to_vec(&serde_json::json!({"metadata": {}, "weight_map": weight_map})).unwrap(),
    )
    .unwrap();
    let (a, b) = (dir.path().join("a.preheat"), dir.path().join("b.preheat"));
    convert(&src, &a, TargetDtype::Keep, &NoProgress).unwrap();
    convert(&sharded, &b, TargetDtype::Keep, &NoProgress).unwrap();
    let (a, b) = (Snapshot::open(&a).unwrap(), Snapshot::open(&b).unwrap());
    assert_eq!(a.manifest().tensors, b.manifest().tensors);
}

#[test]
fn old_config_form_and_llama3_scaling() {
    let src = preheat_testkit::model_fixture("llama-tiny");
    let dir = tempfile::tempdir().unwrap();
    let old = dir.path().join("old");
    copy_dir(&src, &old);
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(old.join("config.json")).unwrap()).unwrap();
    let obj = cfg.as_object_mut().unwrap();
    obj.remove("rope_parameters");
    obj.insert("rope_theta".into(), 500000.0.into());
    obj.insert(
        "rope_scaling".into(),
        serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128}),
    );
    std::fs::write(old.join("config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
    let out = dir.path().join("o.preheat");
    convert(&old, &out, TargetDtype::Keep, &NoProgress).unwrap();
    let m = Snapshot::open(&out).unwrap().manifest().model.clone();
    assert_eq!(m.rope_theta, 500000.0);
    assert!(matches!(m.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 8.0));
}

#[test]
fn broken_checkpoints_are_clear_errors() {
    let src = preheat_testkit::model_fixture("llama-tiny");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.preheat");
    // A tensor whose shape disagrees with config.json.
    let bad = dir.path().join("bad");
    copy_dir(&src, &bad);
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(bad.join("config.json")).unwrap()).unwrap();
    cfg["intermediate_size"] = 200.into();
    std::fs::write(bad.join("config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
    let err = convert(&bad, &out, TargetDtype::Keep, &NoProgress).unwrap_err();
    assert!(matches!(err, Error::InvalidConfig(_)), "{err}");
    assert!(err.to_string().contains("mlp.gate_proj"), "{err}");
    // Truncated weights.
    let trunc = dir.path().join("trunc");
    copy_dir(&src, &trunc);
    let w = std::fs::read(trunc.join("model.safetensors")).unwrap();
    std::fs::write(trunc.join("model.safetensors"), &w[..w.len() / 2]).unwrap();
    assert!(convert(&trunc, &out, TargetDtype::Keep, &NoProgress).is_err());
    // No config at all.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    assert!(matches!(
        convert(&empty, &out, TargetDtype::Keep, &NoProgress),
        Err(Error::Io { .. })
    ));
    assert!(
        !out.exists(),
        "no snapshot may appear after a failed conversion"
    );
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| {
            let n = e.unwrap().file_name().to_string_lossy().into_owned();
            n.ends_with(".partial").then_some(n)
        })
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn export_to_hf_reads_back_identically() {
    use preheat_snapshot::synth::{SynthOptions, synthesize};
    let d = tempfile::tempdir().unwrap();
    let snap_path = d.path().join("tiny.preheat");
    synthesize("tiny", &snap_path, SynthOptions::default(), &NoProgress).unwrap();
    let snap = Snapshot::open(&snap_path).unwrap();
    let hf = d.path().join("hf");
    preheat_snapshot::source::hf::export(&snap, &hf).unwrap();
    let back_path = d.path().join("back.preheat");
    preheat_snapshot::convert(&hf, &back_path, TargetDtype::Keep, &NoProgress).unwrap();
    let back = Snapshot::open(&back_path).unwrap();
    assert_eq!(back.manifest().model, snap.manifest().model);
    assert_eq!(back.manifest().tensors.len(), snap.manifest().tensors.len());
    for t in snap.tensors() {
        let b = back.require(t.name()).unwrap();
        assert_eq!(b.shape(), t.shape());
        assert_eq!(b.bytes(), t.bytes(), "{}", t.name());
    }
    assert_eq!(
        back.tokenizer_json().unwrap(),
        snap.tokenizer_json().unwrap()
    );
}
