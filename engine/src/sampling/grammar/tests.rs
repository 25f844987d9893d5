//! Grammar tests, and the helpers the tool-call grammar's tests run theirs with.

use super::*;

/// Whether `g` compiles and takes exactly `text` (in llama-tiny's tokens) to an
/// end where generation may stop.
pub(crate) fn accepts(g: &Grammar, text: &str) -> bool {
    let (c, tok) = compiler();
    let mut m = c
        .compile(g, "test")
        .unwrap_or_else(|e| panic!("{e}: {g:?}"));
    for id in tok.encode(text, false).unwrap().get_ids() {
        if !m.allowed().unwrap().contains(*id) {
            return false;
        }
        m.accept(*id).unwrap();
    }
    m.allowed().unwrap().contains(2)
}

/// llama-tiny's tokenizer: byte-level BPE, 512 tokens; `<|im_end|>` (2) and
/// `<|endoftext|>` (0) end generation.
fn compiler() -> (GrammarCompiler, tokenizers::Tokenizer) {
    let dir = preheat_testkit::model_fixture("llama-tiny");
    let json = std::fs::read_to_string(dir.join("tokenizer.json")).unwrap();
    let tok = tokenizers::Tokenizer::from_bytes(json.as_bytes()).unwrap();
    (GrammarCompiler::new(&tok, &json, &[2, 0]).unwrap(), tok)
}

fn allowed_ids(c: &mut Constraint) -> Vec<u32> {
    let a = c.allowed().unwrap();
    (0..512).filter(|&i| a.contains(i)).collect()
}

#[test]
fn a_choice_masks_all_but_its_prefixes_then_only_the_end() {
    let (g, tok) = compiler();
    let id = |s: &str| tok.token_to_id(s).unwrap();
    let mut c = g
        .compile(
            &Grammar::Choice(vec!["yes".into(), "no".into()]),
            "guided_choice",
        )
        .unwrap();
    let mut first = allowed_ids(&mut c);
    first.sort_unstable();
    let mut want = vec![id("y"), id("n"), id("no")];
    want.sort_unstable();
    assert_eq!(first, want);
    let mut logits = vec![1.0f32; 512];
    c.allowed().unwrap().apply(&mut logits);
    assert_eq!(logits.iter().filter(|l| l.is_finite()).count(), 3);
    for t in ["y", "e", "s"] {
        assert!(!c.is_done());
        c.accept(id(t)).unwrap();
    }
    // Complete, and nothing can follow: done (the engine ends the sequence here);
    // asked again, every EOS of the model and nothing else.
    assert!(c.is_done());
    assert_eq!(allowed_ids(&mut c), vec![0, 2]);
    c.accept(2).unwrap();
    assert!(c.is_done());
    // A grammar that may end or go on allows both.
    let mut c = g
        .compile(&Grammar::Regex("a+".into()), "guided_regex")
        .unwrap();
    c.accept(id("a")).unwrap();
    let next = allowed_ids(&mut c);
    assert!(
        next.contains(&0) && next.contains(&2) && next.contains(&id("a")),
        "{next:?}"
    );
    assert!(!c.is_done());
}

#[test]
fn a_cached_grammar_starts_fresh_for_each_sequence() {
    let (g, tok) = compiler();
    let id = |s: &str| tok.token_to_id(s).unwrap();
    let choice = Grammar::Choice(vec!["yes".into(), "no".into()]);
    let mut a = g.compile(&choice, "guided_choice").unwrap();
    for t in ["y", "e", "s"] {
        a.accept(id(t)).unwrap();
    }
    assert!(a.is_done());
    // From the cache: at the start, untouched by the first sequence's tokens.
    let mut b = g.compile(&choice, "guided_choice").unwrap();
    assert!(!b.is_done());
    assert!(allowed_ids(&mut b).contains(&id("n")));
    assert_eq!(g.cache.lock().unwrap().len(), 1);
}

#[test]
fn a_token_the_grammar_does_not_allow_is_an_error_not_a_panic() {
    let (g, tok) = compiler();
    let mut c = g
        .compile(&Grammar::Regex("[0-9]+".into()), "guided_regex")
        .unwrap();
    assert!(c.accept(tok.token_to_id("y").unwrap()).is_err());
}

#[test]
fn json_is_compact_unless_the_schema_says_otherwise() {
    let s = compact(&serde_json::json!({"type": "object"}));
    assert_eq!(s["x-guidance"]["whitespace_flexible"], false);
    let own = serde_json::json!({"type": "object", "x-guidance": {"whitespace_flexible": true}});
    assert_eq!(compact(&own), own);
    // A boolean schema has nowhere to say it: left as it is.
    assert_eq!(compact(&serde_json::json!(true)), serde_json::json!(true));
}

/// Plays a sequence with `remaining` tokens of budget after `prefix`: the "model"
/// keeps writing `x` (or the first token allowed) wherever it is free; returns
/// the text and whether the closer ended it.
pub(crate) fn run_to_budget(g: &Grammar, prefix: &str, remaining: usize) -> (String, bool) {
    run_preferring(g, prefix, remaining, "x")
}

/// [`run_to_budget`] with a "model" that writes `prefer` wherever it may.
fn run_preferring(g: &Grammar, prefix: &str, mut remaining: usize, prefer: &str) -> (String, bool) {
    let (c, tok) = compiler();
    let mut m = c.compile(g, "t").unwrap();
    let mut out: Vec<u32> = tok.encode(prefix, false).unwrap().get_ids().to_vec();
    for id in &out {
        m.accept(*id).unwrap();
    }
    let x = tok.token_to_id(prefer).unwrap();
    while remaining > 0 && !m.is_done() {
        // The "model" writes `prefer` wherever it may, else the first token allowed.
        let a = m.allowed().unwrap();
        let want = if a.contains(x) {
            x
        } else {
            (3..512).find(|&i| a.contains(i)).unwrap()
        };
        let t = m.budget_check(want, remaining).unwrap_or(want);
        m.accept(t).unwrap();
        out.push(t);
        remaining -= 1;
        if t == 2 {
            break;
        }
    }
    (tok.decode(&out, true).unwrap(), m.closed_for_budget())
}

#[test]
fn near_max_tokens_the_closing_path_completes_the_output() {
    let schema = serde_json::json!({"type": "object", "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        "n": {"type": "integer", "minimum": 5},
        "ok": {"type": "boolean"}},
        "required": ["name", "tags", "n", "ok"], "additionalProperties": false});
    let g = Grammar::JsonSchema(schema);
    for budget in [30, 45, 60, 100] {
        let (text, closed) = run_to_budget(&g, r#"{"name":"hel"#, budget);
        let v: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("budget {budget}: {e}: {text}"));
        assert!(
            v["tags"].as_array().is_some_and(|t| !t.is_empty()),
            "{text}"
        );
        assert!(v["n"].as_i64().is_some_and(|n| n >= 5), "{text}");
        assert!(v["ok"].is_boolean() && v["name"].is_string(), "{text}");
        assert!(closed, "budget {budget}: {text}");
    }
    // Any JSON, cut inside nested arrays.
    let (text, _) = run_to_budget(&Grammar::JsonObject, r#"{"a":[[{"b":"x"#, 12);
    serde_json::from_str::<serde_json::Value>(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    // A regex: ends where it may (EOS), not mid-number.
    let (text, closed) = run_to_budget(&Grammar::Regex("[0-9]+\\.[0-9]+ (kg|lb)".into()), "12", 6);
    assert!(closed, "{text}");
    assert!(text.ends_with(" kg") || text.ends_with(" lb"), "{text}");
    // Where the model's own choice still ends in time, it stands: the closer does
    // not pick for it.
    let choice = Grammar::Choice(vec!["positive".into(), "negative".into()]);
    let (text, closed) = run_preferring(&choice, "", 9, "p");
    assert_eq!((text.as_str(), closed), ("positive", false));
    // A budget that cannot hold the shortest end: cut as before, nothing forced.
    let (_, closed) = run_to_budget(&g, r#"{"name":"hel"#, 3);
    assert!(!closed);
}

#[test]
fn a_vocabulary_llguidance_cannot_read_is_an_error() {
    let (_, tok) = compiler();
    let json = r#"{"decoder": {"type": "WordPiece"}, "added_tokens": [], "model": {"vocab": {}}}"#;
    let e = GrammarCompiler::new(&tok, json, &[2]).unwrap_err();
    assert!(e.to_string().contains("structured outputs"), "{e}");
}
