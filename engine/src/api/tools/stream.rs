//! One choice's text deltas turned into content and tool calls as they arrive: text
//! that might begin a call is held back until it is known not to.

use super::calls::{CallIds, Calls, Piece};
use super::formats::{HERMES_CLOSE, HERMES_OPEN, MISTRAL_TAG, PYTHON_TAG, ToolFormat};
use super::{ToolChoice, Tools};

impl Tools {
    /// Parses tool calls from the model's text (`None` choice: none are looked for).
    #[must_use]
    pub(crate) fn stream(&self, call_ids: CallIds) -> ToolStream {
        ToolStream {
            format: (self.choice != ToolChoice::None).then_some(self.format),
            buf: String::new(),
            mode: Mode::Undecided,
            calls: Calls::new(call_ids, !self.parallel),
        }
    }

    /// Stop strings that end the answer after its one call when
    /// `parallel_tool_calls` is false (Hermes: the call's closing tag; the parser
    /// takes the unclosed block).
    #[must_use]
    pub(crate) fn stops(&self) -> Vec<String> {
        match (self.parallel, &self.choice, self.format) {
            (false, ToolChoice::Auto, ToolFormat::Hermes) => vec![HERMES_CLOSE.to_owned()],
            _ => Vec::new(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Nothing but whitespace seen yet (Llama 3 / Mistral: a call starts the answer).
    Undecided,
    /// Plain text; Hermes still watches for `<tool_call>`.
    Content,
    /// Inside calls: held until they parse.
    Calls,
}

/// Turns one choice's text deltas into content deltas and whole tool calls. Content
/// that might begin a call is held back until it is known not to; calls are sent once
/// complete (each as one delta with its full arguments). Text that looked like a call
/// but does not parse is returned as content: nothing the model wrote is dropped.
#[derive(Debug)]
pub(crate) struct ToolStream {
    /// `None`: `tool_choice: none`, the text passes through.
    format: Option<ToolFormat>,
    buf: String,
    mode: Mode,
    calls: Calls,
}

impl ToolStream {
    /// Calls parsed so far.
    #[must_use]
    pub(crate) fn calls(&self) -> usize {
        self.calls.count
    }

    /// Takes the next text delta.
    pub(crate) fn push(&mut self, text: &str) -> Vec<Piece> {
        let Some(format) = self.format else {
            return content(text.to_owned());
        };
        self.buf.push_str(text);
        let mut out = Vec::new();
        loop {
            match (format, self.mode) {
                (_, Mode::Undecided) => {
                    let t = self.buf.trim_start();
                    if t.is_empty() {
                        return out;
                    }
                    let start = match format {
                        ToolFormat::Hermes => Start::No,
                        ToolFormat::Llama3Json => call_start(t, PYTHON_TAG, "{"),
                        ToolFormat::Mistral => call_start(t, MISTRAL_TAG, "[{"),
                    };
                    self.mode = match start {
                        // Not known yet: wait for more text.
                        Start::Maybe => return out,
                        Start::Yes => Mode::Calls,
                        Start::No => Mode::Content,
                    };
                }
                (ToolFormat::Hermes, Mode::Content) => {
                    match self.buf.find(HERMES_OPEN) {
                        Some(at) => {
                            let before = self.buf[..at].trim_end().to_owned();
                            self.buf.drain(..at);
                            out.extend(content(before));
                            self.mode = Mode::Calls;
                        }
                        None => {
                            // Hold back trailing whitespace and a partial marker.
                            let keep = held_back(&self.buf, HERMES_OPEN);
                            let send: String = self.buf.drain(..keep).collect();
                            out.extend(content(send));
                            return out;
                        }
                    }
                }
                (ToolFormat::Hermes, Mode::Calls) => {
                    let t = self.buf.trim_start();
                    if t.is_empty() {
                        return out;
                    }
                    if !t.starts_with(HERMES_OPEN) {
                        if HERMES_OPEN.starts_with(t) {
                            return out;
                        }
                        // Text after the calls: content again.
                        self.mode = Mode::Content;
                        continue;
                    }
                    let Some(end) = t.find(HERMES_CLOSE) else {
                        return out;
                    };
                    let block = t[HERMES_OPEN.len()..end].to_owned();
                    let whole = t[..end + HERMES_CLOSE.len()].to_owned();
                    let skip = self.buf.len() - t.len() + end + HERMES_CLOSE.len();
                    self.buf.drain(..skip);
                    match self.calls.one_call(&block, "arguments") {
                        Some(call) => out.extend(call),
                        None => out.push(Piece::Content(whole)),
                    }
                }
                // Llama 3 and Mistral: the whole answer is calls or it is not.
                (_, Mode::Calls) => return out,
                (_, Mode::Content) => {
                    let send = std::mem::take(&mut self.buf);
                    out.extend(content(send));
                    return out;
                }
            }
        }
    }

    /// The end of the text: whatever was held back, as calls or as content.
    pub(crate) fn finish(&mut self) -> Vec<Piece> {
        let Some(format) = self.format else {
            return Vec::new();
        };
        let rest = std::mem::take(&mut self.buf);
        match (format, self.mode) {
            (ToolFormat::Hermes, Mode::Calls) => {
                // Whitespace after the last call is no content.
                let t = rest.trim();
                if t.is_empty() {
                    return Vec::new();
                }
                // A last block the model did not close (it stopped at EOS, or a stop
                // string or `max_tokens` cut the closing tag).
                if let Some(block) = t.strip_prefix(HERMES_OPEN) {
                    let block = strip_partial_suffix(block.trim_end(), HERMES_CLOSE);
                    if let Some(call) = self.calls.one_call(block, "arguments") {
                        return call.into_iter().collect();
                    }
                }
                content(rest)
            }
            (ToolFormat::Llama3Json, Mode::Calls) => {
                let t = rest.trim();
                let t = t.strip_prefix(PYTHON_TAG).unwrap_or(t);
                self.calls
                    .many(t, ToolFormat::Llama3Json)
                    .unwrap_or_else(|| content(rest))
            }
            (ToolFormat::Mistral, Mode::Calls) => {
                let t = rest.trim();
                let t = t.strip_prefix(MISTRAL_TAG).unwrap_or(t);
                self.calls
                    .many(t, ToolFormat::Mistral)
                    .unwrap_or_else(|| content(rest))
            }
            (_, _) => content(rest),
        }
    }
}

fn content(s: String) -> Vec<Piece> {
    if s.is_empty() {
        Vec::new()
    } else {
        vec![Piece::Content(s)]
    }
}

/// Whether an answer (`t`, leading whitespace trimmed) is calls.
enum Start {
    Yes,
    No,
    Maybe,
}

/// `t` begins with `tag`, or with `open` (`{` or `[{`, whitespace between allowed)
/// followed by `"name"`; `Maybe` while it is a strict prefix of either.
fn call_start(t: &str, tag: &str, open: &str) -> Start {
    if t.starts_with(tag) {
        return Start::Yes;
    }
    let tag_prefix = tag.starts_with(t);
    // Walk `open` then `"name"`, skipping whitespace between them.
    let want: Vec<char> = open.chars().chain("\"name\"".chars()).collect();
    let open_len = open.chars().count();
    let mut i = 0;
    for c in t.chars() {
        if i == want.len() {
            return Start::Yes;
        }
        if c.is_whitespace() && i > 0 && i <= open_len {
            continue;
        }
        if c != want[i] {
            return if tag_prefix { Start::Maybe } else { Start::No };
        }
        i += 1;
    }
    if i == want.len() {
        Start::Yes
    } else {
        Start::Maybe
    }
}

/// `s` without a trailing partial `tag` (a cut closing tag).
fn strip_partial_suffix<'a>(s: &'a str, tag: &str) -> &'a str {
    for k in (1..=tag.len()).rev() {
        if s.len() >= k && s.is_char_boundary(s.len() - k) && tag.starts_with(&s[s.len() - k..]) {
            return s[..s.len() - k].trim_end();
        }
    }
    s
}

/// How much of `buf` can be sent as content: all but trailing whitespace and a
/// trailing partial `tag` (which might become a call).
fn held_back(buf: &str, tag: &str) -> usize {
    let mut end = buf.len();
    for k in (1..tag.len()).rev() {
        if buf.len() >= k
            && buf.is_char_boundary(buf.len() - k)
            && tag.starts_with(&buf[buf.len() - k..])
        {
            end = buf.len() - k;
            break;
        }
    }
    buf[..end].trim_end().len()
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;
    use crate::api::tools::ToolCall;
    use crate::api::tools::fixtures::tools;

    fn run(t: &Tools, pieces: &[&str]) -> Vec<Piece> {
        let mut s = t.stream(CallIds::new("test", 0));
        let mut out: Vec<Piece> = pieces.iter().flat_map(|p| s.push(p)).collect();
        out.extend(s.finish());
        // Adjacent content pieces joined: what a client assembles.
        let mut joined: Vec<Piece> = Vec::new();
        for p in out {
            match (joined.last_mut(), p) {
                (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
                (_, p) => joined.push(p),
            }
        }
        joined
    }

    fn call(p: &Piece) -> (&str, Value) {
        match p {
            Piece::Call(c) => (c.name.as_str(), serde_json::from_str(&c.arguments).unwrap()),
            Piece::Content(t) => panic!("content {t:?}, not a call"),
        }
    }

    /// Every way of cutting the text into deltas gives the same pieces.
    fn all_splits(t: &Tools, text: &str) -> Vec<Piece> {
        let whole = run(t, &[text]);
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        for &(i, _) in &chars {
            let split = run(t, &[&text[..i], &text[i..]]);
            assert_eq!(split, strip_ids(&whole, &split), "split at {i} of {text:?}");
        }
        let by_char: Vec<String> = text.chars().map(String::from).collect();
        let refs: Vec<&str> = by_char.iter().map(String::as_str).collect();
        let chars_run = run(t, &refs);
        assert_eq!(chars_run, strip_ids(&whole, &chars_run));
        whole
    }

    /// `whole` with the call ids of `like` (ids carry a timestamp).
    fn strip_ids(whole: &[Piece], like: &[Piece]) -> Vec<Piece> {
        whole
            .iter()
            .zip(
                like.iter()
                    .chain(std::iter::repeat(&Piece::Content(String::new()))),
            )
            .map(|(w, l)| match (w, l) {
                (Piece::Call(a), Piece::Call(b)) => Piece::Call(ToolCall {
                    id: b.id.clone(),
                    ..a.clone()
                }),
                (w, _) => w.clone(),
            })
            .collect()
    }

    #[test]
    fn hermes_calls_are_parsed_whole_and_streamed() {
        let t = tools(ToolFormat::Hermes, ToolChoice::Auto);
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        let p = all_splits(&t, text);
        assert_eq!(p.len(), 3, "{p:?}");
        assert_eq!(p[0], Piece::Content("Let me check.".into()));
        assert_eq!(call(&p[1]), ("get_weather", json!({"city": "Paris"})));
        assert_eq!(call(&p[2]), ("get_time", json!({})));
        let (Piece::Call(a), Piece::Call(b)) = (&p[1], &p[2]) else {
            unreachable!()
        };
        assert_eq!((a.index, b.index), (0, 1));
        assert_ne!(a.id, b.id);
    }

    #[test]
    fn hermes_text_without_calls_passes_through_unchanged() {
        let t = tools(ToolFormat::Hermes, ToolChoice::Auto);
        for text in [
            "The weather is <b>fine</b> today.",
            "a < b and <tool",
            "  spaced  ",
        ] {
            let p = all_splits(&t, text);
            assert_eq!(p, vec![Piece::Content(text.into())], "{text:?}");
        }
    }

    #[test]
    fn hermes_block_that_does_not_parse_is_content() {
        let t = tools(ToolFormat::Hermes, ToolChoice::Auto);
        let text =
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": </tool_call>";
        assert_eq!(all_splits(&t, text), vec![Piece::Content(text.into())]);
        // Unclosed at the end: parsed if it is complete JSON, else content.
        let open = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}";
        assert_eq!(call(&all_splits(&t, open)[0]).0, "get_time");
        let cut = "<tool_call>\n{\"name\": \"get_ti";
        assert_eq!(all_splits(&t, cut), vec![Piece::Content(cut.into())]);
    }

    #[test]
    fn llama3_json_calls_and_plain_answers() {
        let t = tools(ToolFormat::Llama3Json, ToolChoice::Auto);
        let text = "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo; Norway\"}}; {\"name\": \"get_time\", \"parameters\": {}}";
        let p = all_splits(&t, text);
        assert_eq!(
            call(&p[0]),
            ("get_weather", json!({"city": "Oslo; Norway"}))
        );
        assert_eq!(call(&p[1]), ("get_time", json!({})));
        let plain = "It is sunny {probably}.";
        assert_eq!(all_splits(&t, plain), vec![Piece::Content(plain.into())]);
        let brace = "{not json";
        assert_eq!(all_splits(&t, brace), vec![Piece::Content(brace.into())]);
    }

    #[test]
    fn mistral_calls_with_and_without_the_tag() {
        let t = tools(ToolFormat::Mistral, ToolChoice::Auto);
        for text in [
            "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}]",
            // The tag is a special token: decoding without special tokens drops it.
            " [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}]",
        ] {
            let p = all_splits(&t, text);
            assert_eq!(p.len(), 1, "{p:?}");
            assert_eq!(call(&p[0]), ("get_weather", json!({"city": "Rome"})));
        }
        let plain = "[1, 2] are numbers";
        assert_eq!(all_splits(&t, plain), vec![Piece::Content(plain.into())]);
    }

    /// A stream that begins like a call but is not one is sent as it comes, not held
    /// to the end.
    #[test]
    fn answers_that_only_begin_like_calls_stream_at_once() {
        for (format, text) in [
            (ToolFormat::Llama3Json, "<b>bold</b> text"),
            (ToolFormat::Llama3Json, "{x} is a set"),
            (ToolFormat::Mistral, "[a link](http://x) here"),
            (ToolFormat::Mistral, "[ {not a call"),
        ] {
            let t = tools(format, ToolChoice::Auto);
            let mut s = t.stream(CallIds::new("t", 0));
            let mut sent = String::new();
            for c in text.chars() {
                for p in s.push(&c.to_string()) {
                    let Piece::Content(c) = p else {
                        panic!("{p:?}")
                    };
                    sent.push_str(&c);
                }
            }
            assert!(
                sent.len() + 4 >= text.len(),
                "{format:?} held {text:?} back: sent {sent:?}"
            );
            assert_eq!(all_splits(&t, text), vec![Piece::Content(text.into())]);
        }
    }

    #[test]
    fn leftovers_after_calls_and_cut_tags() {
        let t = tools(ToolFormat::Hermes, ToolChoice::Auto);
        // Whitespace after the calls is no content.
        let p = all_splits(
            &t,
            "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\n\n",
        );
        assert_eq!(p.len(), 1, "{p:?}");
        // A closing tag cut short, arguments left out: still the call.
        let p = all_splits(&t, "<tool_call>\n{\"name\": \"get_time\"}\n</tool_ca");
        assert_eq!(call(&p[0]), ("get_time", json!({})));
        // One call allowed: a later block that is no call stays content.
        let mut single = tools(ToolFormat::Hermes, ToolChoice::Auto);
        single.parallel = false;
        let p = all_splits(
            &single,
            "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call><tool_call>[1]</tool_call>",
        );
        assert!(
            matches!(p.as_slice(), [Piece::Call(_), Piece::Content(_)]),
            "{p:?}"
        );
    }

    #[test]
    fn tool_choice_none_returns_the_text_as_is() {
        let t = tools(ToolFormat::Hermes, ToolChoice::None);
        let text = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        assert_eq!(all_splits(&t, text), vec![Piece::Content(text.into())]);
    }
}
