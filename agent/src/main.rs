//! `billet`: parse, set up tracing, load and check configuration, bind, run,
//! and map the error to an exit code (README "Exit codes"). Also
//! `billet host-upgrade`, the updater `billet node` execs on `StartUpgrade`.
//! The command line itself lives in the library (`billet_agent::cli`).

use std::process::ExitCode;

use billet_agent::cli::{self, Cli, Command, NodeArgs, exit, host_upgrade};
use billet_agent::edge::server;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// Says why the node stops, as an error event; on stderr instead when the
/// log filter drops errors (`BILLET_LOG=off`), so the node never exits
/// non-zero without a word.
macro_rules! fatal {
    ($($arg:tt)*) => {
        if tracing::enabled!(tracing::Level::ERROR) {
            error!($($arg)*);
        } else {
            eprintln!("billet: {}", format_args!($($arg)*));
        }
    };
}

fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    match cli::parse(&args) {
        Err(code) => code,
        Ok(Cli {
            command: Command::Node(args),
        }) => match cli::init_tracing(args.log_format) {
            Ok(()) => {
                cli::stop_on_panic();
                node(args)
            }
            Err(code) => code,
        },
        Ok(Cli {
            command: Command::Completions { shell },
        }) => cli::docs::completions(shell),
        Ok(Cli {
            command: Command::Man { dir },
        }) => cli::docs::man(dir.as_deref()),
        Ok(Cli {
            command: Command::NodeStatus(args),
        }) => cli::status::status(args),
        Ok(Cli {
            command: Command::NodeEnroll(args),
        }) => cli::enroll::enroll(args),
        Ok(Cli {
            command: Command::Check(args),
        }) => match cli::init_tracing(args.log_format) {
            Ok(()) => cli::check::check(args),
            Err(code) => code,
        },
        Ok(Cli {
            command: Command::HostUpgrade(args),
        }) => host_upgrade::host_upgrade(args),
    }
}

fn node(args: NodeArgs) -> ExitCode {
    let file = args.config.clone();
    let (config, listen) = match args.into_config() {
        Ok(c) => c,
        Err(e) => {
            cli::report_config_error(&e, file.as_deref());
            return ExitCode::from(exit::CONFIG);
        }
    };
    // A state directory that is not one is refused below, naming it.
    if config.state_dir.is_dir()
        && let Some(code) = host_upgrade::settle_upgrade(&config.state_dir)
    {
        return code;
    }
    // Before anything opens a file or a socket; logged once.
    match server::raise_open_files_limit() {
        Ok(files) => {
            // Numbers, so a collector reads them as such; an unlimited
            // limit is an absent field and `unlimited = true`.
            info!(
                soft = files.soft,
                hard = files.hard,
                was = files.was,
                unlimited = files.hard.is_none(),
                "open files limit (RLIMIT_NOFILE): the soft limit is raised to the hard one"
            );
            if files.soft.is_some_and(|n| n < server::OPEN_FILES_WANTED) {
                warn!(
                    soft = files.soft,
                    wanted = server::OPEN_FILES_WANTED,
                    "the node may open few files; raise its hard limit (the unit's LimitNOFILE=)"
                );
            }
        }
        Err(e) => {
            warn!(error = %e, "cannot raise the open files limit (RLIMIT_NOFILE); running with the one inherited")
        }
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            fatal!("cannot start the async runtime: {e}");
            return ExitCode::from(exit::SERVE);
        }
    };
    // A start that fails before it serves removes what it made.
    let footprint = server::Footprint::before(&config);
    runtime.block_on(async move {
        let mut prepared = match server::prepare(&config).await {
            Ok(p) => p,
            Err(e) => {
                fatal!("{e}");
                footprint.undo();
                return ExitCode::from(exit::for_node_error(&e));
            }
        };
        let listener = match tokio::net::TcpListener::bind(listen).await {
            Ok(l) => l,
            Err(e) => {
                fatal!("cannot listen on {listen} (--listen): {e}");
                drop(prepared);
                footprint.undo();
                return ExitCode::from(exit::BIND);
            }
        };
        if let Some(addr) = config.metrics_listen {
            match tokio::net::TcpListener::bind(addr).await {
                Ok(l) => prepared.metrics = Some(l),
                Err(e) => {
                    fatal!("cannot listen for metrics (--metrics-listen) on {addr}: {e}");
                    drop(prepared);
                    footprint.undo();
                    return ExitCode::from(exit::BIND);
                }
            }
        }
        let (drain, shutdown) = (CancellationToken::new(), CancellationToken::new());
        if let Err(e) = server::stop_on_signals(drain.clone(), shutdown.clone()) {
            fatal!("cannot handle SIGTERM: {e}");
            drop(prepared);
            footprint.undo();
            return ExitCode::from(exit::SERVE);
        }
        match server::run(config, prepared, listener, drain, shutdown).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                fatal!("{e}");
                ExitCode::from(exit::for_node_error(&e))
            }
        }
    })
}
