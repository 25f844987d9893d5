//! `preheat bench scaler` end to end at a small scale: KEDA callers in the scaler's
//! process and in their own (the benchmark re-runs itself), and the scrape tick over a
//! vLLM-sized exposition.

mod harness;

use harness::ok_json;

#[test]
fn bench_scaler_measures_both_caller_placements_and_the_scrape_tick() {
    let r = ok_json([
        "bench",
        "scaler",
        "--objects",
        "20",
        "--polls",
        "2",
        "--interval-ms",
        "50",
        "--pods",
        "10",
        "--ticks",
        "2",
        "--json",
    ]);
    for callers in ["same_process", "own_process"] {
        let g = &r["get_metrics"][callers];
        assert_eq!(g["calls"], 40, "{callers}: {g}");
        let (p50, p99) = (g["p50_ms"].as_f64().unwrap(), g["p99_ms"].as_f64().unwrap());
        assert!(p50 > 0.0 && p50 <= p99, "{callers}: {g}");
    }
    assert!(r["page_bytes"].as_f64().unwrap() > 20_000.0, "{r}");
    assert!(r["parse_us_per_page"].as_f64().unwrap() > 0.0, "{r}");
    assert!(r["tick_worst_s"].as_f64().unwrap() >= r["tick_best_s"].as_f64().unwrap());
}
