//! Cron expressions for scheduled floors: the five POSIX fields (minute, hour, day of
//! month, month, day of week), each `*`, a number, a range `a-b`, a list `a,b` and a
//! step `/n`; UTC. When both day fields are restricted (anything but a bare `*`) a
//! day matching either counts, as robfig/cron (Kubernetes CronJobs) reads them.

/// A parsed expression.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cron {
    minutes: u64,
    hours: u32,
    days: u32,
    months: u16,
    weekdays: u8,
    /// Day of month restricted (not `*`).
    days_restricted: bool,
    /// Day of week restricted (not `*`).
    weekdays_restricted: bool,
}

/// Parses one field into a bit set over `lo..=hi`.
fn field(text: &str, lo: u32, hi: u32, name: &str) -> Result<(u64, bool), String> {
    let mut bits = 0u64;
    let restricted = text != "*";
    for part in text.split(',') {
        let (range, step) = match part.split_once('/') {
            Some((r, s)) => {
                let step: u32 = s
                    .parse()
                    .ok()
                    .filter(|s| (1..=hi).contains(s))
                    .ok_or_else(|| format!("{name}: step {s:?} is not a number in 1-{hi}"))?;
                (r, step)
            }
            None => (part, 1),
        };
        let num = |s: &str| -> Result<u32, String> {
            s.parse::<u32>()
                .ok()
                .filter(|v| (lo..=hi).contains(v))
                .ok_or_else(|| format!("{name}: {s:?} is not a number in {lo}-{hi}"))
        };
        let (a, b) = match range {
            "*" => (lo, hi),
            r => match r.split_once('-') {
                Some((a, b)) => (num(a)?, num(b)?),
                // `5/15`: from 5 on, as cron reads it.
                None if step > 1 => (num(r)?, hi),
                None => {
                    let v = num(r)?;
                    (v, v)
                }
            },
        };
        if a > b {
            return Err(format!("{name}: range {a}-{b} runs backwards"));
        }
        let mut v = a;
        while v <= b {
            bits |= 1 << v;
            v += step;
        }
    }
    Ok((bits, restricted))
}

impl Cron {
    /// Parses `m h dom mon dow`; the error names the field.
    pub fn parse(expr: &str) -> Result<Self, String> {
        let f: Vec<&str> = expr.split_whitespace().collect();
        let [m, h, dom, mon, dow] = f.as_slice() else {
            return Err(format!(
                "{expr:?}: needs five fields (minute hour day-of-month month day-of-week), got {}",
                f.len()
            ));
        };
        let (minutes, _) = field(m, 0, 59, "minute")?;
        let (hours, _) = field(h, 0, 23, "hour")?;
        let (days, days_restricted) = field(dom, 1, 31, "day of month")?;
        let (months, _) = field(mon, 1, 12, "month")?;
        let (mut weekdays, weekdays_restricted) = field(dow, 0, 7, "day of week")?;
        // 7 is Sunday too.
        if weekdays & (1 << 7) != 0 {
            weekdays |= 1;
        }
        Ok(Cron {
            minutes,
            hours: hours as u32,
            days: days as u32,
            months: months as u16,
            weekdays: (weekdays & 0x7f) as u8,
            days_restricted,
            weekdays_restricted,
        })
    }

    /// Whether it fires in the minute starting at `minute` (Unix time / 60, UTC).
    #[must_use]
    pub fn fires(&self, minute: i64) -> bool {
        let m = minute.rem_euclid(60) as u32;
        let h = (minute.div_euclid(60)).rem_euclid(24) as u32;
        let day = minute.div_euclid(1440);
        if self.minutes & (1 << m) == 0 || self.hours & (1 << h) == 0 {
            return false;
        }
        let (_, month, dom) = civil(day);
        if self.months & (1 << month) == 0 {
            return false;
        }
        // 1970-01-01 was a Thursday (4).
        let dow = (day + 4).rem_euclid(7) as u32;
        let by_dom = self.days & (1 << dom) != 0;
        let by_dow = self.weekdays & (1 << dow) != 0;
        match (self.days_restricted, self.weekdays_restricted) {
            (true, true) => by_dom || by_dow,
            _ => by_dom && by_dow,
        }
    }
}

/// (year, month 1-12, day 1-31) of `days` since 1970-01-01 (Howard Hinnant's
/// `civil_from_days`).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Minutes since the epoch of a UTC date and time.
    fn at(y: i64, mo: u32, d: u32, h: i64, mi: i64) -> i64 {
        // Inverse of `civil`, by search (tests only).
        let mut day = (y - 1970) * 365 + (y - 1969) / 4 - 40;
        while civil(day) != (y, mo, d) {
            day += 1;
        }
        day * 1440 + h * 60 + mi
    }

    #[test]
    fn civil_dates_and_weekdays() {
        assert_eq!(civil(0), (1970, 1, 1));
        assert_eq!(civil(20_454), (2026, 1, 1));
        assert_eq!(civil(11_016), (2000, 2, 29));
        // 2026-12-03 is a Thursday.
        let d = at(2026, 12, 3, 0, 0) / 1440;
        assert_eq!((d + 4).rem_euclid(7), 4);
    }

    #[test]
    fn weekday_mornings() {
        let c = Cron::parse("0 8 * * 1-5").unwrap();
        assert!(c.fires(at(2026, 12, 3, 8, 0)), "Thursday 08:00");
        assert!(!c.fires(at(2026, 12, 3, 8, 1)));
        assert!(!c.fires(at(2026, 12, 5, 8, 0)), "Saturday");
        assert!(!c.fires(at(2026, 12, 6, 8, 0)), "Sunday");
        assert!(c.fires(at(2026, 12, 7, 8, 0)), "Monday");
    }

    #[test]
    fn lists_steps_and_either_day_field() {
        let c = Cron::parse("*/15 9,17 1 * 0").unwrap();
        assert!(c.fires(at(2026, 12, 1, 9, 45)), "the 1st, a Tuesday");
        assert!(c.fires(at(2026, 12, 6, 17, 30)), "a Sunday");
        assert!(!c.fires(at(2026, 12, 2, 9, 0)), "neither day");
        assert!(!c.fires(at(2026, 12, 1, 9, 10)));
        let sunday7 = Cron::parse("0 0 * * 7").unwrap();
        assert!(sunday7.fires(at(2026, 12, 6, 0, 0)));
        let from5 = Cron::parse("5/20 * * * *").unwrap();
        assert!(from5.fires(at(2026, 1, 1, 0, 45)) && !from5.fires(at(2026, 1, 1, 0, 0)));
    }

    #[test]
    fn bad_expressions_name_their_field() {
        for (e, want) in [
            ("0 8 * *", "five fields"),
            ("60 8 * * *", "minute"),
            ("0 24 * * *", "hour"),
            ("0 8 0 * *", "day of month"),
            ("0 8 * 13 *", "month"),
            ("0 8 * * 8", "day of week"),
            ("0 8 * * 5-1", "backwards"),
            ("*/0 8 * * *", "step"),
            ("1/4294967295 8 * * *", "step"),
        ] {
            let err = Cron::parse(e).unwrap_err();
            assert!(err.contains(want), "{e}: {err}");
        }
    }
}
