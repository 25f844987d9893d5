//! The flags as clap parses them.
use super::*;

/// `bench serve --slo-ttft 2s` was refused ("invalid float literal") where `up`
/// and `bench simreal` take the same target written that way.
#[test]
fn regression_bench_serve_refused_the_slo_as_up_writes_it() {
    let slo = |args: &[&str]| {
        let cli = Cli::try_parse_from(["preheat", "bench", "serve"].iter().chain(args))
            .unwrap_or_else(|e| panic!("{args:?}: {e}"));
        match cli.command {
            Command::Bench(BenchCmd::Serve(s)) => (s.slo_ttft, s.slo_itl),
            _ => unreachable!("parsed as bench serve"),
        }
    };
    assert_eq!(slo(&[]), (2.0, 0.05), "the defaults are unchanged");
    assert_eq!(
        slo(&["--slo-ttft", "2s", "--slo-itl", "150ms"]),
        (2.0, 0.15)
    );
    assert_eq!(
        slo(&["--slo-ttft", "1.5", "--slo-itl", "0.15"]),
        (1.5, 0.15)
    );
    assert!(Cli::try_parse_from(["preheat", "bench", "serve", "--slo-ttft", "soon"]).is_err());
}

/// `engine profile` run by hand times the batch sizes `up`'s profile does.
#[test]
fn engine_profile_times_the_batches_up_does() {
    let cli = Cli::try_parse_from([
        "preheat", "engine", "profile", "--model", "m", "-o", "p.json",
    ])
    .unwrap();
    let Command::Engine(EngineCmd::Profile { batches, .. }) = cli.command else {
        panic!("not engine profile")
    };
    assert_eq!(batches, preheat_local::profile::PROFILE_BATCHES);
}

#[test]
fn every_policy_flag_is_a_simulator_policy_and_back() {
    let flags: Vec<&str> = PolicyFlag::value_variants()
        .iter()
        .map(|p| p.as_str())
        .filter(|p| *p != "all")
        .collect();
    let mut known = preheat_sim::autoscalers::POLICIES.to_vec();
    known.extend(preheat_sim::fleet::FLEET_POLICIES);
    known.sort_unstable();
    known.dedup();
    let mut flags_sorted = flags.clone();
    flags_sorted.sort_unstable();
    assert_eq!(flags_sorted, known);
}
