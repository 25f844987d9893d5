//! Request traces: the Azure LLM inference CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`)
//! and Mooncake JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids` of
//! 512-token prefix blocks). Both become one list of [`TraceRequest`]s, arrival times in
//! seconds from the first request, sorted.

use std::path::Path;

use serde::Deserialize;

/// Tokens per Mooncake `hash_ids` block.
pub const MOONCAKE_BLOCK_TOKENS: u32 = 512;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRequest {
    /// Arrival, seconds after the trace's first request.
    pub t: f64,
    pub input_tokens: u32,
    pub output_tokens: u32,
    /// Prefix blocks of [`MOONCAKE_BLOCK_TOKENS`] tokens (equal ids = equal prefix);
    /// empty when the trace has none.
    pub blocks: Vec<u64>,
}

/// A problem with a trace file, with the line it is on.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}:{line}: {msg}")]
    Parse {
        path: String,
        line: usize,
        msg: String,
    },
    #[error("{0}: the trace holds no requests")]
    Empty(String),
}

/// Reads a trace, telling the format from its first non-empty line (`{` → JSONL).
pub fn load(path: &Path) -> Result<Vec<TraceRequest>, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io {
        path: path.display().to_string(),
        source,
    })?;
    parse(&text, &path.display().to_string())
}

/// Parses trace text; `name` labels errors.
pub fn parse(text: &str, name: &str) -> Result<Vec<TraceRequest>, TraceError> {
    let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    let mut reqs = if first.trim_start().starts_with('{') {
        parse_jsonl(text, name)?
    } else {
        parse_azure_csv(text, name)?
    };
    if reqs.is_empty() {
        return Err(TraceError::Empty(name.to_owned()));
    }
    // Stable: requests with equal times keep file order.
    reqs.sort_by(|a, b| a.t.total_cmp(&b.t));
    let t0 = reqs[0].t;
    for r in &mut reqs {
        r.t -= t0;
    }
    Ok(reqs)
}

#[derive(Deserialize)]
struct MooncakeLine {
    timestamp: f64,
    input_length: u32,
    output_length: u32,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

fn parse_jsonl(text: &str, name: &str) -> Result<Vec<TraceRequest>, TraceError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let err = |msg: String| TraceError::Parse {
            path: name.to_owned(),
            line: i + 1,
            msg,
        };
        let m: MooncakeLine = serde_json::from_str(line).map_err(|e| err(e.to_string()))?;
        out.push(
            mooncake_request(m.timestamp, m.input_length, m.output_length, m.hash_ids)
                .map_err(err)?,
        );
    }
    Ok(out)
}

/// A Mooncake line's request (`timestamp` in ms), checked as every trace's is.
pub(crate) fn mooncake_request(
    timestamp: f64,
    input: u32,
    output: u32,
    blocks: Vec<u64>,
) -> Result<TraceRequest, String> {
    if !timestamp.is_finite() || timestamp < 0.0 {
        return Err(format!("timestamp {timestamp} is not a time"));
    }
    check_lengths(input, output)?;
    Ok(TraceRequest {
        t: timestamp / 1000.0,
        input_tokens: input,
        output_tokens: output,
        blocks,
    })
}

fn check_lengths(input: u32, output: u32) -> Result<(), String> {
    if input == 0 {
        return Err("input length 0".into());
    }
    if output == 0 {
        return Err("output length 0".into());
    }
    Ok(())
}

fn parse_azure_csv(text: &str, name: &str) -> Result<Vec<TraceRequest>, TraceError> {
    let mut lines = text.lines().enumerate();
    let err = |line: usize, msg: String| TraceError::Parse {
        path: name.to_owned(),
        line,
        msg,
    };
    let (_, header) = lines
        .next()
        .ok_or_else(|| TraceError::Empty(name.to_owned()))?;
    let cols: Vec<&str> = header.split(',').map(str::trim).collect();
    let col = |want: &str| {
        cols.iter()
            .position(|c| c.eq_ignore_ascii_case(want))
            .ok_or_else(|| err(1, format!("no {want} column (header {header:?})")))
    };
    let (ti, ci, gi) = (
        col("TIMESTAMP")?,
        col("ContextTokens")?,
        col("GeneratedTokens")?,
    );
    let mut out = Vec::new();
    for (i, line) in lines {
        if line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(',').map(str::trim).collect();
        let get = |k: usize| {
            f.get(k).copied().ok_or_else(|| {
                err(
                    i + 1,
                    format!("{} fields, expected {}", f.len(), cols.len()),
                )
            })
        };
        let t = parse_timestamp(get(ti)?).map_err(|m| err(i + 1, m))?;
        let num = |k: usize| -> Result<u32, TraceError> {
            let s = get(k)?;
            s.parse()
                .map_err(|_| err(i + 1, format!("{s:?} is not a token count")))
        };
        let (input, output) = (num(ci)?, num(gi)?);
        check_lengths(input, output).map_err(|m| err(i + 1, m))?;
        out.push(TraceRequest {
            t,
            input_tokens: input,
            output_tokens: output,
            blocks: Vec::new(),
        });
    }
    Ok(out)
}

/// `YYYY-MM-DD HH:MM:SS[.fraction]` → seconds since 1970 (UTC, proleptic Gregorian).
fn parse_timestamp(s: &str) -> Result<f64, String> {
    let bad = || format!("{s:?} is not a YYYY-MM-DD HH:MM:SS timestamp");
    let (date, time) = s.split_once([' ', 'T']).ok_or_else(bad)?;
    let d: Vec<i64> = date
        .split('-')
        .map(|p| p.parse().map_err(|_| bad()))
        .collect::<Result<_, _>>()?;
    let [y, m, day] = d[..] else {
        return Err(bad());
    };
    let mut hms = time.splitn(3, ':');
    let h: i64 = hms.next().ok_or_else(bad)?.parse().map_err(|_| bad())?;
    let mi: i64 = hms.next().ok_or_else(bad)?.parse().map_err(|_| bad())?;
    let sec: f64 = hms.next().ok_or_else(bad)?.parse().map_err(|_| bad())?;
    if !(1..=12).contains(&m)
        || !(1..=31).contains(&day)
        || h > 23
        || mi > 59
        || !(0.0..61.0).contains(&sec)
    {
        return Err(bad());
    }
    Ok(days_from_civil(y, m, day) as f64 * 86_400.0 + (h * 3600 + mi * 60) as f64 + sec)
}

/// Days since 1970-01-01 (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Largest `--rate-scale`: a trace replayed more often than this is a different trace.
pub const MAX_RATE_SCALE: u32 = 1000;

/// The trace with each request replayed `k` times, so its shape loads a `k`-times
/// larger fleet: copy 0 at the original time, copies 1.. within the following second at
/// a deterministic jitter (the same for the same trace and `k`). Each copy's prefix
/// blocks are renamed, so copies share prefixes among themselves as the original's
/// requests do, not with the original (a copy is another user, not a retry).
#[must_use]
pub fn scale_rate(trace: &[TraceRequest], k: u32) -> Vec<TraceRequest> {
    if k <= 1 {
        return trace.to_vec();
    }
    let mut out = Vec::with_capacity(trace.len() * k as usize);
    for (i, r) in trace.iter().enumerate() {
        for c in 0..u64::from(k) {
            let mut copy = r.clone();
            if c > 0 {
                copy.t += unit_jitter(i as u64, c);
                let salt = c.wrapping_mul(0x9E37_79B9_7F4A_7C15);
                for b in &mut copy.blocks {
                    *b ^= salt;
                }
            }
            out.push(copy);
        }
    }
    out.sort_by(|a, b| a.t.total_cmp(&b.t));
    out
}

/// Renumbers the trace's prefix blocks 0, 1, 2… in order of first appearance; returns
/// how many distinct blocks it holds. Only equality of ids means anything (equal ids,
/// equal prefix), so a replay is the same before and after, and small ids let the
/// simulator's prefix caches index arrays instead of hashing (see `block_map`). Run it
/// once per trace, after [`scale_rate`].
pub fn intern_blocks(trace: &mut [TraceRequest]) -> usize {
    let mut ids: std::collections::HashMap<u64, u64, crate::block_id_hash::BlockIdHasher> =
        std::collections::HashMap::default();
    for r in trace.iter_mut() {
        for b in &mut r.blocks {
            let next = ids.len() as u64;
            *b = *ids.entry(*b).or_insert(next);
        }
    }
    ids.len()
}

/// A number in [0, 1) from (`i`, `c`): splitmix64's finaliser, so neighbours differ.
fn unit_jitter(i: u64, c: u64) -> f64 {
    let mut z = i
        .wrapping_mul(0xD1B5_4A32_D192_ED03)
        .wrapping_add(c.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn azure_csv_across_midnight() {
        let t = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                 2023-11-16 23:59:59.5000000,100,5\n\
                 2023-11-17 00:00:01.0000000,200,6\n";
        let r = parse(t, "x").unwrap();
        assert_eq!(r.len(), 2);
        assert!((r[1].t - 1.5).abs() < 1e-9, "{}", r[1].t);
        assert_eq!((r[1].input_tokens, r[1].output_tokens), (200, 6));
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
    }

    #[test]
    fn mooncake_jsonl_sorted_from_zero() {
        let t = "{\"timestamp\": 2000, \"input_length\": 1024, \"output_length\": 3, \"hash_ids\": [0, 1]}\n\
                 {\"timestamp\": 1000, \"input_length\": 10, \"output_length\": 1}\n";
        let r = parse(t, "x").unwrap();
        assert_eq!(r[0].t, 0.0);
        assert_eq!(r[1].t, 1.0);
        assert_eq!(r[1].blocks, vec![0, 1]);
    }

    #[test]
    fn bad_lines_name_the_line() {
        for (text, want) in [
            (
                "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,abc,4\n",
                ":2:",
            ),
            (
                "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-13-16 18:17:03,1,4\n",
                ":2:",
            ),
            (
                "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,1\n",
                ":2:",
            ),
            ("TIMESTAMP,Foo\n", "no ContextTokens"),
            ("{\"timestamp\": 1}\n", ":1:"),
            (
                "{\"timestamp\": 1, \"input_length\": 0, \"output_length\": 1}\n",
                "input length 0",
            ),
            ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
            ("", "no"),
        ] {
            let e = parse(text, "trace").unwrap_err().to_string();
            assert!(e.contains(want), "{text:?}: {e}");
        }
    }

    #[test]
    fn rate_scale_replays_each_request_k_times_within_a_second_deterministically() {
        let trace: Vec<TraceRequest> = (0..50)
            .map(|i| TraceRequest {
                t: f64::from(i) * 2.0,
                input_tokens: 100 + i as u32,
                output_tokens: 10,
                blocks: vec![1, 2, u64::from(i as u32)],
            })
            .collect();
        let k = 4;
        let scaled = scale_rate(&trace, k);
        assert_eq!(scaled.len(), trace.len() * k as usize);
        assert!(scaled.windows(2).all(|w| w[0].t <= w[1].t), "sorted");
        assert_eq!(scaled, scale_rate(&trace, k), "deterministic");
        for r in &trace {
            let copies: Vec<&TraceRequest> = scaled
                .iter()
                .filter(|s| s.input_tokens == r.input_tokens)
                .collect();
            assert_eq!(copies.len(), k as usize);
            assert!(copies.iter().all(|c| c.t >= r.t && c.t < r.t + 1.0));
            // Copy 0 keeps the original prefix; the others share one renamed prefix.
            let originals = copies.iter().filter(|c| c.blocks == r.blocks).count();
            assert_eq!(originals, 1, "only copy 0 keeps the original blocks");
        }
        // Copies of different requests still share the common prefix among themselves.
        let firsts: std::collections::HashSet<u64> = scaled.iter().map(|r| r.blocks[0]).collect();
        assert_eq!(
            firsts.len(),
            k as usize,
            "one shared first block per copy world"
        );
        assert_eq!(scale_rate(&trace, 1), trace);
    }

    #[test]
    fn interned_blocks_keep_which_requests_share_a_prefix() {
        let req = |blocks: &[u64]| TraceRequest {
            t: 0.0,
            input_tokens: 1,
            output_tokens: 1,
            blocks: blocks.to_vec(),
        };
        let mut t = vec![
            req(&[u64::MAX, 7, 9]),
            req(&[u64::MAX, 7, 3]),
            req(&[]),
            req(&[3, 42]),
        ];
        assert_eq!(intern_blocks(&mut t), 5);
        let blocks: Vec<&[u64]> = t.iter().map(|r| r.blocks.as_slice()).collect();
        assert_eq!(blocks, [&[0, 1, 2][..], &[0, 1, 3], &[], &[3, 4]]);
    }
}
