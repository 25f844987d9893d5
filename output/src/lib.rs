//! What preheat's commands put out: human text and JSON on stdout, where a reader that
//! went away ends output quietly; progress bars on stderr ([`progress_bar`]); SVG
//! plots of reports ([`plot`]).

pub mod plot;
pub mod progress_bar;

pub use plot::{Panel, Series, stack, svg};
pub use progress_bar::Bar;

/// `println!` through [`emit`]: a closed pipe ends output instead of panicking.
#[macro_export]
macro_rules! outln {
    ($($a:tt)*) => {
        $crate::emit(&format!("{}\n", format_args!($($a)*)))?
    };
}

/// Prints `value` as pretty JSON on stdout.
pub fn print_json(value: &serde_json::Value) -> anyhow::Result<()> {
    emit(&format!("{}\n", serde_json::to_string_pretty(value)?))
}

/// Writes `text` to stdout. A reader that went away (`preheat … | head`) is not an
/// error worth reporting, so a broken pipe ends output quietly.
pub fn emit(text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => Ok(r?),
    }
}

/// Bytes as a short human string.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}
