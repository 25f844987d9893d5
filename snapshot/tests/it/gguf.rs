//! GGUF conversion against gguf-py (llama.cpp's reference library): dequantisation
//! bit for bit, layout and names against the HF checkpoint it was made from, and the
//! rebuilt tokenizer against the original tokenizer.json.

use crate::common;

use preheat_snapshot::source::gguf::dequant::dequantize;
use preheat_snapshot::source::gguf::parse::parse;
use preheat_snapshot::{DType, NoProgress, Snapshot, TargetDtype, convert};

#[test]
fn dequantisation_is_bit_exact_with_gguf_py() {
    let bytes = std::fs::read(common::test_fixture("quant_types.gguf")).unwrap();
    let h = parse(&bytes).unwrap();
    let mut checked = 0;
    for t in h.tensors.iter().filter(|t| !t.name.ends_with(".expected")) {
        let exp = h
            .tensors
            .iter()
            .find(|e| e.name == format!("{}.expected", t.name))
            .unwrap();
        let expected: Vec<f32> = bytes[exp.start..exp.start + exp.len]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        let mut got = vec![0f32; t.numel() as usize];
        dequantize(t.ty, &bytes[t.start..t.start + t.len], &mut got);
        assert_eq!(got.len(), expected.len(), "{}", t.name);
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(
                g.to_bits(),
                e.to_bits(),
                "{} element {i}: {g} vs {e}",
                t.name
            );
        }
        checked += 1;
    }
    assert_eq!(checked, 7, "Q4_0 Q4_1 Q8_0 Q4_K Q6_K F16 BF16");
}

#[test]
fn llama_gguf_converts_back_to_the_hf_checkpoint_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let from_gguf = dir.path().join("g.preheat");
    let from_hf = dir.path().join("h.preheat");
    convert(
        &common::test_fixture("llama_tiny.gguf"),
        &from_gguf,
        TargetDtype::Keep,
        &NoProgress,
    )
    .unwrap();
    convert(
        &preheat_testkit::model_fixture("llama-tiny"),
        &from_hf,
        TargetDtype::Keep,
        &NoProgress,
    )
    .unwrap();
    let (g, h) = (
        Snapshot::open(&from_gguf).unwrap(),
        Snapshot::open(&from_hf).unwrap(),
    );
    let (gc, hc) = (&g.manifest().model, &h.manifest().model);
    assert_eq!(
        (
            gc.hidden_size,
            gc.num_hidden_layers,
            gc.num_attention_heads,
            gc.num_key_value_heads,
            gc.head_dim
        ),
        (
            hc.hidden_size,
            hc.num_hidden_layers,
            hc.num_attention_heads,
            hc.num_key_value_heads,
            hc.head_dim
        )
    );
    assert_eq!(
        (gc.rope_theta, gc.vocab_size, gc.tie_word_embeddings),
        (hc.rope_theta, hc.vocab_size, false)
    );
    let names = |s: &Snapshot| s.tensors().map(|t| t.name().to_owned()).collect::<Vec<_>>();
    assert_eq!(names(&g), names(&h));
    for (a, b) in g.tensors().zip(h.tensors()) {
        assert_eq!(a.shape(), b.shape(), "{}", a.name());
        assert_eq!(a.dtype(), DType::F32);
        // Q/K must have been un-permuted: identical bytes, not just identical sets.
        assert!(a.bytes == b.bytes, "{} differs", a.name());
    }
    assert_eq!(g.manifest().chat_template, h.manifest().chat_template);
}

#[test]
fn rebuilt_tokenizer_encodes_like_the_original() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("g.preheat");
    convert(
        &common::test_fixture("llama_tiny.gguf"),
        &out,
        TargetDtype::Keep,
        &NoProgress,
    )
    .unwrap();
    let snap = Snapshot::open(&out).unwrap();
    let rebuilt =
        tokenizers::Tokenizer::from_bytes(snap.tokenizer_json().unwrap().unwrap()).unwrap();
    let original = tokenizers::Tokenizer::from_file(
        preheat_testkit::model_fixture("llama-tiny").join("tokenizer.json"),
    )
    .unwrap();
    let reference: serde_json::Value = serde_json::from_slice(
        &std::fs::read(preheat_testkit::model_fixture("llama-tiny").join("reference.json"))
            .unwrap(),
    )
    .unwrap();
    let mut texts: Vec<String> = reference["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["prompt"].as_str().unwrap().to_owned())
        .collect();
    texts.push("<|im_start|>user\nHello, wörld! 12345 ünïcödé 🚀<|im_end|>".into());
    for text in &texts {
        let a = rebuilt.encode(text.as_str(), false).unwrap();
        let b = original.encode(text.as_str(), false).unwrap();
        assert_eq!(a.get_ids(), b.get_ids(), "{text:?}");
        assert_eq!(rebuilt.decode(a.get_ids(), false).unwrap(), *text);
    }
    for case in reference["cases"].as_array().unwrap() {
        let ids: Vec<u32> = case["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let enc = rebuilt
            .encode(case["prompt"].as_str().unwrap(), false)
            .unwrap();
        assert_eq!(enc.get_ids(), ids.as_slice());
    }
}

#[test]
fn real_smollm2_gguf_converts_with_a_working_tokenizer() {
    let Some(path) = preheat_testkit::smollm2_gguf() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("smol.preheat");
    let s = convert(&path, &out, TargetDtype::To(DType::BF16), &NoProgress).unwrap();
    assert_eq!(s.tensors, 272);
    let snap = Snapshot::open(&out).unwrap();
    assert!(snap.verify(2).unwrap().mismatches.is_empty());
    let c = &snap.manifest().model;
    assert_eq!(
        (
            c.num_hidden_layers,
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads
        ),
        (30, 576, 9, 3)
    );
    assert!(c.tie_word_embeddings);
    assert_eq!(
        snap.require("model.layers.29.mlp.down_proj.weight")
            .unwrap()
            .shape(),
        &[576, 1536]
    );
    let tok = tokenizers::Tokenizer::from_bytes(snap.tokenizer_json().unwrap().unwrap()).unwrap();
    let enc = tok
        .encode(
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>",
            false,
        )
        .unwrap();
    let toks = enc.get_tokens();
    assert_eq!(toks[0], "<|im_start|>");
    assert_eq!(enc.get_ids()[0], 1);
    for t in ["ĠFrance", "Ġcapital", "?", "<|im_end|>"] {
        assert!(toks.iter().any(|x| x == t), "{t} not in {toks:?}");
    }
    // SmolLM's pre-tokenizer splits digits one by one.
    assert_eq!(tok.encode("2024", false).unwrap().get_ids().len(), 4);
    let template = snap.manifest().chat_template.as_deref().unwrap();
    assert!(template.contains("<|im_start|>"));
}
