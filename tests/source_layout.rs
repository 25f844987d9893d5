//! The source tree's own rules, checked on every test run: a module past 600 lines
//! says at its top why it is one file (a reader should find one thing per module).

use std::path::{Path, PathBuf};

/// Longest module that needs no reason.
const MAX_LINES: usize = 600;
/// What a longer module's top must say, within its first lines.
const WHY: &str = "Why one file over 600 lines:";
const TOP_LINES: usize = 30;

/// Every `.rs` file of the workspace's crates and tests (build output and fetched
/// tools left out).
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name();
        let name = name.to_string_lossy();
        if path.is_dir() {
            if !(name.starts_with('.') || name == "target" || name == "fuzz") {
                rust_files(&path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_module_is_over_600_lines_without_saying_why_at_its_top() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    rust_files(root, &mut files);
    assert!(
        files.len() > 100,
        "found only {} Rust files under {}",
        files.len(),
        root.display()
    );
    let mut unexplained = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let lines = text.lines().count();
        if lines > MAX_LINES && !text.lines().take(TOP_LINES).any(|l| l.contains(WHY)) {
            unexplained.push(format!(
                "{} ({lines} lines)",
                f.strip_prefix(root).unwrap_or(f).display()
            ));
        }
    }
    unexplained.sort();
    assert!(
        unexplained.is_empty(),
        "modules over {MAX_LINES} lines whose first {TOP_LINES} lines do not say {WHY:?}; \
         split them at their seams or say why they are one file:\n  {}",
        unexplained.join("\n  ")
    );
}
