//! Progress bars on stderr for long operations (hidden when stderr is not a terminal).

use indicatif::{ProgressBar, ProgressStyle};
use preheat_snapshot::Progress;

#[derive(Debug)]
pub struct Bar(ProgressBar);

impl Bar {
    pub fn new() -> Self {
        Bar(ProgressBar::hidden())
    }
}

impl Default for Bar {
    fn default() -> Self {
        Bar::new()
    }
}

impl Progress for Bar {
    fn start(&self, what: &str, total: u64) {
        self.0
            .set_draw_target(indicatif::ProgressDrawTarget::stderr());
        self.0.set_length(total);
        self.0.set_position(0);
        self.0.set_style(
            ProgressStyle::with_template(
                "{msg:>10} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            )
            .expect("static template")
            .progress_chars("=> "),
        );
        self.0.set_message(what.to_owned());
        self.0.reset_elapsed();
    }
    fn advance(&self, n: u64) {
        self.0.inc(n);
    }
    fn finish(&self) {
        self.0.finish_and_clear();
    }
}
