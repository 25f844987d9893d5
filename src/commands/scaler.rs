//! `preheat scaler …`

use std::process::ExitCode;

use preheat_scaler::{Config, Profile};

use crate::cli::ScalerCmd;

pub fn run(cmd: ScalerCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        ScalerCmd::Run {
            config,
            overrides,
            profile,
            token,
        } => {
            let mut cfg = Config::load(config.as_deref(), &overrides)?;
            if token.cluster_token_file.is_some() {
                cfg.cluster_token_file = token.cluster_token_file;
            }
            if profile.is_some() {
                cfg.profile = profile;
            }
            if cfg.cluster_token_file.is_none() {
                // KEDA's gRPC has its own TLS; what the token guards here is `/status`
                // (endpoint names) and the calls to agents.
                tracing::warn!(
                    "no cluster token: the scaler's /status answers anyone who reaches its HTTP port (give --cluster-token-file or cluster_token_file)"
                );
            }
            let profile = match &cfg.profile {
                Some(p) => Profile::from_file(p)?,
                None => Profile::default(),
            };
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            let served = rt.block_on(preheat_scaler::server::run(
                cfg,
                profile,
                crate::signals::shutdown_signal(),
            ));
            // A state file save stuck on a hung disk must not hold the exit forever.
            rt.shutdown_timeout(std::time::Duration::from_secs(5));
            served?;
            Ok(ExitCode::SUCCESS)
        }
    }
}
