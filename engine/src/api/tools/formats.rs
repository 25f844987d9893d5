//! The call formats chat templates teach models, and how each is recognised from a
//! template's text.

/// How the model writes a call, as its chat template teaches it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ToolFormat {
    /// `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, one block per call
    /// (NousResearch Hermes, Qwen 2/2.5/3).
    Hermes,
    /// A bare JSON object `{"name": …, "parameters": {…}}`, calls separated by `;`,
    /// optionally after `<|python_tag|>` (Llama 3.1–3.3).
    Llama3Json,
    /// `[TOOL_CALLS] [{"name": …, "arguments": {…}}, …]` (Mistral).
    Mistral,
}

impl ToolFormat {
    /// The format a chat template renders tool calls in; `None` when it renders none
    /// of these.
    #[must_use]
    pub(super) fn of_template(template: &str) -> Option<Self> {
        if !template.contains("tools") {
            return None;
        }
        if template.contains("<tool_call>") {
            Some(ToolFormat::Hermes)
        } else if template.contains("[TOOL_CALLS]") {
            Some(ToolFormat::Mistral)
        } else if template.contains("<|python_tag|>") || template.contains("ipython") {
            Some(ToolFormat::Llama3Json)
        } else {
            None
        }
    }
}

/// Hermes: around each call.
pub(super) const HERMES_OPEN: &str = "<tool_call>";
pub(super) const HERMES_CLOSE: &str = "</tool_call>";
/// Mistral: before the list of calls (a special token, dropped when decoding skips those).
pub(super) const MISTRAL_TAG: &str = "[TOOL_CALLS]";
/// Llama 3: optionally before the calls.
pub(super) const PYTHON_TAG: &str = "<|python_tag|>";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_are_recognised_from_templates() {
        assert_eq!(
            ToolFormat::of_template("{% for tool in tools %}<tool_call>"),
            Some(ToolFormat::Hermes)
        );
        assert_eq!(
            ToolFormat::of_template("{% if tools %}[TOOL_CALLS]"),
            Some(ToolFormat::Mistral)
        );
        assert_eq!(
            ToolFormat::of_template("tools ... <|python_tag|>"),
            Some(ToolFormat::Llama3Json)
        );
        assert_eq!(ToolFormat::of_template("<|im_start|>{{ m.content }}"), None);
    }
}
