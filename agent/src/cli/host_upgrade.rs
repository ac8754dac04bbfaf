//! `billet host-upgrade`'s driver: take the answer channel first, then run
//! or settle the updater ([`crate::upgrade::updater`]) and map its outcome to
//! an exit code; and the settle a starting `billet node` does first.

use std::os::unix::process::CommandExt;
use std::process::ExitCode;

use tracing::{error, info, warn};

use super::{HostUpgradeArgs, exit};
use crate::upgrade::dispatch::{self, AckWriter};
use crate::upgrade::updater;

/// `billet host-upgrade`: answers on the ack channel at most once, then
/// drives the upgrade (`hostupgrade.rs`). Exit status: 0 done (or nothing
/// to do), 8 refused, 9 accepted and failed (the journal in the state
/// directory says what was restored).
pub fn host_upgrade(args: HostUpgradeArgs) -> ExitCode {
    // First, before anything opens a file: take the answer channel.
    let taken = match (args.ack_fd, &args.ack_path) {
        (Some(fd), _) => Some(AckWriter::take_fd(fd).map_err(|e| format!("--ack-fd {fd}: {e}"))),
        (None, Some(path)) => Some(
            AckWriter::connect(path).map_err(|e| format!("--ack-path {}: {e}", path.display())),
        ),
        (None, None) => None,
    };
    super::init_tracing_lenient();
    let mut ack = match taken {
        None => AckWriter::none(),
        Some(Ok(ack)) => ack,
        Some(Err(e)) => {
            warn!("cannot answer: {e}; answering nothing");
            AckWriter::none()
        }
    };
    let HostUpgradeArgs {
        version,
        settle,
        manifest_sha256,
        rollout,
        generation,
        config,
        ack_fd: _,
        ack_path: _,
    } = args;
    if settle {
        return settle_by_hand(config.as_deref());
    }
    let request = updater::Request {
        version: version.unwrap_or_default(),
        manifest_sha256,
        rollout,
        generation,
    };
    info!(?request, ?config, "asked to install a release");
    let loaded = match &config {
        None => Err(dispatch::NO_RELEASE_SOURCE.to_owned()),
        Some(path) => updater::UpgradeConfig::load(path),
    };
    let config = match loaded {
        Ok(c) => c,
        Err(reason) => {
            error!("refusing: {reason}");
            ack.refuse(&reason);
            return ExitCode::from(exit::UPGRADE_REFUSED);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            let reason = format!("cannot start the async runtime: {e}");
            ack.refuse(&reason);
            return ExitCode::from(exit::UPGRADE_REFUSED);
        }
    };
    match runtime.block_on(updater::run(&config, &request, &mut ack)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(updater::UpgradeFailure::Refused(_)) => ExitCode::from(exit::UPGRADE_REFUSED),
        Err(e @ updater::UpgradeFailure::Failed(_)) => {
            error!("upgrade {e}");
            ExitCode::from(exit::UPGRADE_FAILED)
        }
    }
}

/// `billet host-upgrade --settle --config PATH`: 0 when nothing was left
/// unfinished or the settle left one release installed and serving, 2 for
/// a configuration it cannot use, 9 when an operator must look.
fn settle_by_hand(config: Option<&std::path::Path>) -> ExitCode {
    let loaded = config
        .ok_or_else(|| "--settle needs --config".to_owned())
        .and_then(updater::UpgradeConfig::load);
    let loaded = match loaded {
        Ok(config) => config,
        Err(e) => {
            error!("{e}");
            return ExitCode::from(exit::CONFIG);
        }
    };
    let settled = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))
        .and_then(|runtime| runtime.block_on(updater::settle_interrupted(&loaded)));
    match settled {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e}");
            ExitCode::from(exit::UPGRADE_FAILED)
        }
    }
}

/// Settles an upgrade whose updater died (`hostupgrade.rs`); when that puts
/// the previous binary back, runs it in this process's place.
pub fn settle_upgrade(state_dir: &std::path::Path) -> Option<ExitCode> {
    match updater::settle_at_node_start(state_dir) {
        Ok(updater::Settled::RolledBack(binary)) => {
            warn!(binary = %binary.display(), "an interrupted upgrade was rolled back; starting the restored binary");
            let e = std::process::Command::new(&binary)
                .args(std::env::args_os().skip(1))
                .exec();
            error!("cannot exec {}: {e}", binary.display());
            Some(ExitCode::from(exit::STATE))
        }
        Ok(updater::Settled::Recorded) => {
            warn!("an interrupted upgrade had left the previous binary installed; recorded");
            None
        }
        Ok(updater::Settled::Nothing) => None,
        Err(e) => {
            warn!("the upgrade journal: {e}; starting anyway");
            None
        }
    }
}
