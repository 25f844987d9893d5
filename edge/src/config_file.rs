//! How the scaler and the warm-pool agent read their YAML config files: one set of YAML
//! rules for both, written out rather than left to a parser's defaults, because config
//! values are typed by the program, not guessed from their spelling.

use serde::de::DeserializeOwned;

/// Parses `text` as `T`. A file with nothing but blank lines, comments or a document
/// marker is an empty mapping. Scalars keep YAML 1.2's core schema where it matters for
/// config: only `true`/`false` are booleans (`yes`, `no`, `on`, `off`, `y`, `n` stay
/// text, as in YAML 1.2), and `0755` or `1_000` stay text rather than becoming numbers.
/// Errors are one line (no source snippet), so they join a list of config problems.
pub fn parse_yaml<T: DeserializeOwned>(text: &str) -> Result<T, String> {
    let blank = text.lines().all(|l| {
        let l = l.trim();
        l.is_empty() || l.starts_with('#') || l == "---"
    });
    let text = if blank { "{}" } else { text };
    let mut o = serde_saphyr::Options::default();
    o.strict_booleans = true;
    o.leading_zero_numbers_as_strings = true;
    o.underscored_numbers_as_strings = true;
    o.with_snippet = false;
    serde_saphyr::from_str_with_options(text, o).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    #[test]
    fn config_scalars_keep_their_spelling() {
        let v: Value = parse_yaml(
            "a: n\nb: on\nc: yes\nd: 0755\ne: 1_000\nf: true\ng: 8\nh: 1.5\ni: ~\nj: 'x'\n",
        )
        .unwrap();
        assert_eq!(
            v,
            json!({"a": "n", "b": "on", "c": "yes", "d": "0755", "e": "1_000", "f": true,
                   "g": 8, "h": 1.5, "i": null, "j": "x"})
        );
    }

    #[test]
    fn an_empty_or_comment_only_file_is_an_empty_mapping() {
        for text in ["", "\n\n", "# nothing here\n", "---\n# c\n"] {
            let v: Value = parse_yaml(text).unwrap();
            assert_eq!(v, json!({}), "{text:?}");
        }
    }

    #[test]
    fn anchors_and_merge_keys_expand() {
        let v: Value =
            parse_yaml("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  y: 3\nlist: [*b]\n").unwrap();
        assert_eq!(v["other"], json!({"x": 1, "y": 3}));
        assert_eq!(v["list"][0], json!({"x": 1, "y": 2}));
    }

    #[test]
    fn errors_are_one_line() {
        let e = parse_yaml::<Value>("a: [1, 2\nb: 3\n").unwrap_err();
        assert!(!e.trim().is_empty() && !e.trim().contains('\n'), "{e}");
    }
}
