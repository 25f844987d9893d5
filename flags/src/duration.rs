//! One duration syntax for every flag: `90` (seconds), `90s`, `500ms`, `2m`, `1h`.

use std::time::Duration;

/// `60`, `60s`, `500ms`, `2m`, `1h` → seconds.
pub fn parse_duration(s: &str) -> Option<f64> {
    let s = s.trim();
    if let Some(ms) = s.strip_suffix("ms") {
        return parse_duration(ms)
            .filter(|_| !ms.ends_with(|c: char| c.is_ascii_alphabetic()))
            .map(|v| v / 1000.0);
    }
    let (num, mul) = match s.chars().last()? {
        's' => (&s[..s.len() - 1], 1.0),
        'm' => (&s[..s.len() - 1], 60.0),
        'h' => (&s[..s.len() - 1], 3600.0),
        _ => (s, 1.0),
    };
    num.parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v >= 0.0)
        .map(|v| v * mul)
}

/// [`parse_duration`] as clap's value parser.
pub fn duration_arg(s: &str) -> Result<Duration, String> {
    parse_duration(s)
        .and_then(|v| Duration::try_from_secs_f64(v).ok())
        .ok_or_else(|| format!("{s:?} is not a duration (e.g. 30s, 500ms, 2m, 90)"))
}

/// A latency target in seconds, in the same syntax (`2`, `2s`, `50ms`); a plain number
/// is taken as is, negative included, so the policy's own check names a bad target.
pub fn seconds_arg(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) => Ok(v),
        Err(_) => duration_arg(s).map(|d| d.as_secs_f64()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("90"), Some(90.0));
        assert_eq!(parse_duration("90s"), Some(90.0));
        assert_eq!(parse_duration("2m"), Some(120.0));
        assert_eq!(parse_duration("1h"), Some(3600.0));
        assert_eq!(parse_duration("0.5s"), Some(0.5));
        assert_eq!(parse_duration("500ms"), Some(0.5));
        for bad in ["", "s", "-1s", "abc", "1d", "ms", "5sms", "-5ms"] {
            assert_eq!(parse_duration(bad), None, "{bad}");
        }
    }

    #[test]
    fn latency_targets_take_the_duration_syntax_and_plain_numbers() {
        assert_eq!(seconds_arg("2"), Ok(2.0));
        assert_eq!(seconds_arg("50ms"), Ok(0.05));
        assert_eq!(seconds_arg("1.5s"), Ok(1.5));
        // A negative number reaches the policy's check, which names the target.
        assert_eq!(seconds_arg("-1"), Ok(-1.0));
        assert!(seconds_arg("fast").unwrap_err().contains("not a duration"));
    }
}
