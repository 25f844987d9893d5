//! The Prometheus text exposition format (0.0.4), plus what OpenMetrics and Prometheus 3
//! add to its lines (exemplars, `# EOF`, quoted UTF-8 names), read without copying.
//!
//! Written here rather than taken from `prometheus-parse`, which the scaler used first:
//! its `\w+` name pattern skipped every `vllm:` / `sglang:` line, it split label sets on
//! `,` and `=` (a value holding either lost its label), dropped `name{} 1` and never
//! unescaped `\"`. Those lines were lost without a word; here every line is either a
//! sample, a comment, or an error naming its line, as Prometheus itself treats them: one
//! malformed line fails the scrape.

use std::borrow::Cow;
use std::fmt;

/// One sample line: `name{labels} value [timestamp] [# exemplar]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample<'a> {
    pub name: Cow<'a, str>,
    pub labels: Vec<(Cow<'a, str>, Cow<'a, str>)>,
    pub value: f64,
    /// 1-based, for error messages about the sample's meaning.
    pub line: usize,
}

impl Sample<'_> {
    /// The value of label `name`, if the sample has it.
    #[must_use]
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_ref())
    }
}

/// A line that is neither a comment nor a well-formed sample.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FormatError {
    pub line: usize,
    pub reason: &'static str,
    /// The start of the offending line, for the log.
    pub text: String,
}

impl fmt::Display for FormatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}: {:?}", self.line, self.reason, self.text)
    }
}

impl std::error::Error for FormatError {}

/// Every sample of `text` in order; comments and blank lines are skipped.
pub fn samples(text: &str) -> impl Iterator<Item = Result<Sample<'_>, FormatError>> {
    text.lines().enumerate().filter_map(|(i, line)| {
        parse_line(line, i + 1)
            .map_err(|reason| FormatError {
                line: i + 1,
                reason,
                text: line.chars().take(120).collect(),
            })
            .transpose()
    })
}

fn is_blank(c: u8) -> bool {
    c == b' ' || c == b'\t'
}

/// A cursor over one line's bytes. Every token boundary the grammar has is ASCII, so
/// slicing at those positions always lands on a `char` boundary.
struct Cursor<'a> {
    s: &'a str,
    at: usize,
}

impl<'a> Cursor<'a> {
    fn peek(&self) -> Option<u8> {
        self.s.as_bytes().get(self.at).copied()
    }

    fn skip_blanks(&mut self) -> bool {
        let start = self.at;
        while self.peek().is_some_and(is_blank) {
            self.at += 1;
        }
        self.at > start
    }

    fn eat(&mut self, c: u8) -> bool {
        let hit = self.peek() == Some(c);
        self.at += usize::from(hit);
        hit
    }

    /// `[a-zA-Z_:][a-zA-Z0-9_:]*` for metric names; without `:` for label names.
    fn ident(&mut self, colons: bool) -> Option<&'a str> {
        let start = self.at;
        while let Some(c) = self.peek() {
            let ok = c.is_ascii_alphabetic()
                || c == b'_'
                || (colons && c == b':')
                || (self.at > start && c.is_ascii_digit());
            if !ok {
                break;
            }
            self.at += 1;
        }
        (self.at > start).then(|| &self.s[start..self.at])
    }

    /// A double-quoted string with the format's three escapes (`\\`, `\"`, `\n`); the
    /// cursor sits on the opening quote.
    fn quoted(&mut self) -> Result<Cow<'a, str>, &'static str> {
        if !self.eat(b'"') {
            return Err("expected '\"'");
        }
        let start = self.at;
        let bytes = self.s.as_bytes();
        let mut owned: Option<String> = None;
        let mut run = start;
        while let Some(&c) = bytes.get(self.at) {
            match c {
                b'"' => {
                    let tail = &self.s[run..self.at];
                    self.at += 1;
                    return Ok(match owned {
                        None => Cow::Borrowed(&self.s[start..self.at - 1]),
                        Some(mut o) => {
                            o.push_str(tail);
                            Cow::Owned(o)
                        }
                    });
                }
                b'\\' => {
                    let o = owned.get_or_insert_with(String::new);
                    o.push_str(&self.s[run..self.at]);
                    match bytes.get(self.at + 1) {
                        Some(b'n') => o.push('\n'),
                        Some(b'\\') => o.push('\\'),
                        Some(b'"') => o.push('"'),
                        // Not an escape the format defines: kept as written, as
                        // Prometheus' own parser does.
                        Some(_) => {
                            run = self.at;
                            self.at += 1;
                            continue;
                        }
                        None => return Err("unterminated quoted string"),
                    }
                    self.at += 2;
                    run = self.at;
                }
                _ => self.at += 1,
            }
        }
        Err("unterminated quoted string")
    }

    /// A token up to the next blank or the end of the line.
    fn word(&mut self) -> &'a str {
        let start = self.at;
        while self.peek().is_some_and(|c| !is_blank(c)) {
            self.at += 1;
        }
        &self.s[start..self.at]
    }
}

type Labels<'a> = Vec<(Cow<'a, str>, Cow<'a, str>)>;

/// `{a="x", b="y"}`, where a quoted string standing alone is the metric name
/// (Prometheus 3's UTF-8 form: `{"my.metric", a="x"}`).
fn label_set<'a>(cur: &mut Cursor<'a>) -> Result<(Option<Cow<'a, str>>, Labels<'a>), &'static str> {
    let mut name = None;
    let mut labels = Vec::new();
    loop {
        cur.skip_blanks();
        if cur.eat(b'}') {
            return Ok((name, labels));
        }
        let quoted = cur.peek() == Some(b'"');
        let key: Cow<'a, str> = if quoted {
            cur.quoted()?
        } else {
            Cow::Borrowed(cur.ident(false).ok_or("expected a label name")?)
        };
        cur.skip_blanks();
        if cur.eat(b'=') {
            cur.skip_blanks();
            let value = cur.quoted()?;
            labels.push((key, value));
        } else if quoted {
            if name.is_some() || !labels.is_empty() {
                return Err("a quoted metric name must come first in the braces");
            }
            name = Some(key);
        } else {
            return Err("expected '=' after a label name");
        }
        cur.skip_blanks();
        if cur.eat(b',') {
            continue;
        }
        if cur.eat(b'}') {
            return Ok((name, labels));
        }
        return Err("expected ',' or '}' in the label set");
    }
}

/// Go's float syntax as Prometheus writes it (`NaN`, `+Inf`, `-Inf`, decimals,
/// exponents). Rust's parser accepts the same spellings.
fn number(s: &str) -> Option<f64> {
    s.parse().ok()
}

fn parse_line(line: &str, line_no: usize) -> Result<Option<Sample<'_>>, &'static str> {
    let mut cur = Cursor { s: line, at: 0 };
    cur.skip_blanks();
    match cur.peek() {
        None | Some(b'#') => return Ok(None),
        _ => {}
    }
    let bare = cur.ident(true);
    let mut gap = cur.skip_blanks();
    let (quoted_name, labels) = if cur.eat(b'{') {
        let set = label_set(&mut cur)?;
        gap = cur.skip_blanks();
        set
    } else {
        (None, Vec::new())
    };
    let name = match (bare, quoted_name) {
        (Some(n), None) => Cow::Borrowed(n),
        (None, Some(n)) => n,
        (Some(_), Some(_)) => return Err("a metric name both before and inside the braces"),
        (None, None) => return Err("expected a metric name"),
    };
    if !gap {
        return Err(if cur.peek().is_some() {
            "unexpected character after the metric name or labels"
        } else {
            "missing value"
        });
    }
    let value = number(cur.word()).ok_or("the value is not a number")?;
    cur.skip_blanks();
    if cur.peek().is_some_and(|c| c != b'#') {
        number(cur.word()).ok_or("the timestamp is not a number")?;
        cur.skip_blanks();
    }
    // What follows ` # ` is an OpenMetrics exemplar, which the scaler does not read.
    if cur.peek().is_some_and(|c| c != b'#') {
        return Err("unexpected text after the value");
    }
    Ok(Some(Sample {
        name,
        labels,
        value,
        line: line_no,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(line: &str) -> Sample<'_> {
        let mut it = samples(line);
        let s = it.next().expect("a sample").expect("well formed");
        assert!(it.next().is_none());
        s
    }

    fn err(line: &str) -> FormatError {
        samples(line)
            .find_map(Result::err)
            .unwrap_or_else(|| panic!("{line:?} should be rejected"))
    }

    #[test]
    fn plain_labelled_and_spaced_samples() {
        let s = one("http_requests_total{method=\"post\",code=\"200\"} 1027 1395066363000");
        assert_eq!(s.name, "http_requests_total");
        assert_eq!(s.label("code"), Some("200"));
        assert_eq!(s.label("method"), Some("post"));
        assert_eq!(s.label("x"), None);
        assert_eq!(s.value, 1027.0);
        let s = one("  vllm:num_requests_waiting { model_name = \"m\" , } \t 3.5e2  ");
        assert_eq!(s.name, "vllm:num_requests_waiting");
        assert_eq!(s.label("model_name"), Some("m"));
        assert_eq!(s.value, 350.0);
        assert_eq!(one("a 1").labels, vec![]);
    }

    #[test]
    fn special_values() {
        assert!(one("a NaN").value.is_nan());
        assert_eq!(one("a +Inf").value, f64::INFINITY);
        assert_eq!(one("a -Inf").value, f64::NEG_INFINITY);
        assert_eq!(one("a -0.5e-3").value, -0.0005);
        assert_eq!(one("a{le=\"+Inf\"} 2").label("le"), Some("+Inf"));
    }

    #[test]
    fn escapes_in_label_values() {
        let s = one(r#"a{path="C:\\dir\\f",q="say \"hi\"",nl="x\ny",odd="\d"} 1"#);
        assert_eq!(s.label("path"), Some(r"C:\dir\f"));
        assert_eq!(s.label("q"), Some("say \"hi\""));
        assert_eq!(s.label("nl"), Some("x\ny"));
        assert_eq!(
            s.label("odd"),
            Some(r"\d"),
            "unknown escapes kept as written"
        );
        assert!(matches!(
            one(r#"a{v="plain"} 1"#).labels[0].1,
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn openmetrics_and_prometheus_3_lines() {
        let text = "# TYPE foo counter\n# UNIT foo seconds\nfoo_total{a=\"b\"} 17 1520879607.789 # {trace_id=\"KOO5S4vxi0o\"} 0.67\n# EOF\n";
        let all: Vec<_> = samples(text).collect::<Result<_, _>>().unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!((all[0].value, all[0].line), (17.0, 3));
        let s = one(r#"{"my.dotted metric", "a.b"="c", d="e"} 2"#);
        assert_eq!(s.name, "my.dotted metric");
        assert_eq!(s.label("a.b"), Some("c"));
        assert_eq!(s.label("d"), Some("e"));
    }

    #[test]
    fn comments_blank_lines_and_crlf() {
        let text = "# HELP a Some: text, with = signs {}\r\n\r\n   \n# TYPE a gauge\r\na 1\r\n";
        let all: Vec<_> = samples(text).collect::<Result<_, _>>().unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!((all[0].value, all[0].line), (1.0, 5));
    }

    #[test]
    fn regression_prometheus_parse_lost_labels_with_commas_or_equals() {
        // prometheus-parse split label sets on ',' and '=': the label vanished.
        let s = one(r#"vllm:num_requests_running{model_name="org/m,v2=x",le="1"} 4"#);
        assert_eq!(s.label("model_name"), Some("org/m,v2=x"));
        assert_eq!(s.label("le"), Some("1"));
        let s = one(r#"a{v="}{"} 4"#);
        assert_eq!(s.label("v"), Some("}{"));
    }

    #[test]
    fn regression_prometheus_parse_dropped_empty_braces() {
        let s = one("vllm:num_requests_waiting{} 5");
        assert_eq!(
            (s.name.as_ref(), s.value),
            ("vllm:num_requests_waiting", 5.0)
        );
    }

    #[test]
    fn malformed_lines_name_their_line_and_reason() {
        let e = err("ok 1\nbad{a=\"b\" 2\n");
        assert_eq!(e.line, 2);
        assert_eq!(e.reason, "expected ',' or '}' in the label set");
        assert!(e.to_string().starts_with("line 2: "), "{e}");
        for (line, reason) in [
            ("a", "missing value"),
            ("a{} ", "the value is not a number"),
            ("a x", "the value is not a number"),
            ("a 1 later", "the timestamp is not a number"),
            ("a 1 2 3", "unexpected text after the value"),
            (
                "a{b=\"c\"}1",
                "unexpected character after the metric name or labels",
            ),
            ("a{b=\"c} 1", "unterminated quoted string"),
            ("a{b} 1", "expected '=' after a label name"),
            ("a{=\"c\"} 1", "expected a label name"),
            ("a{b=c} 1", "expected '\"'"),
            ("{a=\"b\"} 1", "expected a metric name"),
            ("9a 1", "expected a metric name"),
            (
                "a{\"x\"} 1",
                "a metric name both before and inside the braces",
            ),
            (
                "{b=\"c\", \"x\"} 1",
                "a quoted metric name must come first in the braces",
            ),
            (
                "a-b 1",
                "unexpected character after the metric name or labels",
            ),
            ("a{b=\"c\\", "unterminated quoted string"),
        ] {
            assert_eq!(err(line).reason, reason, "{line:?}");
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // Mutations of a realistic exposition (xorshift, fixed seed): every line either
        // parses or is an error; none panics, even when a mutation splits a UTF-8 char.
        let base = "# TYPE vllm:x histogram\nvllm:x_bucket{model_name=\"m\",le=\"0.5\"} 3 17 # {t=\"1\"} 2\n{\"q.n\",a=\"\\\"\\\\\"} -Inf\n";
        let alphabet = b"{}\",=\\ #\t\n:_aZ09.+-e\xc3\xa9";
        let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..20_000 {
            let mut bytes = base.as_bytes().to_vec();
            for _ in 0..1 + next() % 4 {
                let at = (next() % bytes.len() as u64) as usize;
                let c = alphabet[(next() % alphabet.len() as u64) as usize];
                match next() % 3 {
                    0 => bytes[at] = c,
                    1 => bytes.insert(at, c),
                    _ => {
                        bytes.remove(at);
                    }
                }
            }
            let text = String::from_utf8_lossy(&bytes);
            for r in samples(&text) {
                let _ = r.map(|s| s.label("le").map(str::len));
            }
        }
    }
}
