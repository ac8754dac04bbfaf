//! `billet node`'s flags checked and turned into the node's configuration,
//! before anything is bound: each error names the flag to fix.

use std::net::SocketAddr;
use std::time::Duration;

use super::NodeArgs;
use crate::edge::server::NodeConfig;
use crate::tls::TlsPaths;
use crate::upgrade::dispatch::{self, ExecUpgrader};

/// The host's memory from `/proc/meminfo`, 0 when it cannot be read.
fn host_memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

impl NodeArgs {
    /// The node's configuration and listen address, checked without binding
    /// or opening anything but the upgrade configuration file.
    ///
    /// # Errors
    ///
    /// A sentence naming the flag (and its environment variable) to fix.
    pub fn into_config(self) -> Result<(NodeConfig, SocketAddr), String> {
        let args = self;
        if args.deployment.is_empty() {
            return Err("--deployment (BILLET_DEPLOYMENT) must not be empty".into());
        }
        let vcpu = args.vcpu.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, |n| u32::try_from(n.get()).unwrap_or(1))
        });
        if vcpu == 0 {
            return Err("--vcpu (BILLET_VCPU) must be at least 1".into());
        }
        let memory_bytes = args.memory_bytes.unwrap_or_else(host_memory_bytes);
        if memory_bytes == 0 {
            return Err("--memory-bytes (BILLET_MEMORY_BYTES) must be positive".into());
        }
        if args.cache_max_bytes == Some(0) {
            return Err("--cache-max-bytes (BILLET_CACHE_MAX_BYTES) must be positive; leave it unset for no bound".into());
        }
        let upgrader = match args.upgrader_binary {
            None => {
                if args.upgrade_config.is_some() {
                    return Err("--upgrade-config (BILLET_UPGRADE_CONFIG) is set without --upgrader-binary (BILLET_UPGRADER_BINARY); set both or neither".into());
                }
                None
            }
            Some(_) if args.upgrade_config.is_none() => {
                return Err("--upgrader-binary (BILLET_UPGRADER_BINARY) is set without --upgrade-config (BILLET_UPGRADE_CONFIG): the updater needs its configuration (deploy/upgrade.toml.example); set both or neither".into());
            }
            Some(binary) => {
                if !binary.is_absolute() {
                    return Err(format!(
                        "--upgrader-binary (BILLET_UPGRADER_BINARY) {}: must be an absolute path; the node execs it long after start-up",
                        binary.display()
                    ));
                }
                if !binary.is_file() {
                    return Err(format!(
                        "--upgrader-binary (BILLET_UPGRADER_BINARY) {}: no such file",
                        binary.display()
                    ));
                }
                if args
                    .upgrade_config
                    .as_ref()
                    .is_some_and(|c| !c.is_absolute())
                {
                    return Err(
                        "--upgrade-config (BILLET_UPGRADE_CONFIG) must be an absolute path".into(),
                    );
                }
                if let Some(path) = &args.upgrade_config {
                    // Checked now, not at the first rollout.
                    crate::upgrade::updater::UpgradeConfig::load(path)
                        .and_then(|c| c.check_for_node(&args.state_dir))
                        .map_err(|e| format!("--upgrade-config (BILLET_UPGRADE_CONFIG): {e}"))?;
                }
                Some(ExecUpgrader {
                    binary,
                    config: args.upgrade_config,
                    ack_wait: Duration::from_secs(args.upgrade_ack_wait_secs.max(1)),
                    dispatch: dispatch::Dispatch::from_environment(args.state_dir.clone()),
                })
            }
        };
        Ok((
            NodeConfig {
                tls: TlsPaths {
                    cert: args.cert,
                    key: args.key,
                    ca: args.ca,
                },
                allow_readable_key: args.allow_readable_key,
                plane_name: args.plane_name,
                deployment: args.deployment,
                cache_dir: args
                    .cache_dir
                    .unwrap_or_else(|| args.state_dir.join("cache")),
                cache_eviction: crate::cache::Eviction {
                    retention: Duration::from_secs(args.cache_retention_hours * 3600),
                    image_store_retention: Duration::from_secs(
                        args.cache_image_store_retention_hours * 3600,
                    ),
                    budget_bytes: args.cache_max_bytes,
                },
                cache_evict_interval: Duration::from_secs(args.cache_evict_interval_secs),
                state_dir: args.state_dir,
                docker_socket: args.docker_socket,
                vcpu,
                memory_bytes,
                max_custody: args.max_custody_secs.map(Duration::from_secs),
                stray_grace: Duration::from_secs(args.stray_grace_secs),
                start_deadline: (args.start_deadline_secs > 0)
                    .then(|| Duration::from_secs(args.start_deadline_secs)),
                max_lease_life: args
                    .max_lease_life_secs
                    .filter(|s| *s > 0)
                    .map(Duration::from_secs),
                post_job_grace: Duration::from_secs(args.post_job_grace_secs),
                isolated_containers: args.isolated_containers,
                tier_failures_before_unhealthy: args.tier_failures_before_unhealthy,
                guest_pids_limit: args.guest_pids_limit,
                ack_timeout: Duration::from_secs(args.ack_timeout_secs.max(1)),
                drain_timeout: Duration::from_secs(args.drain_timeout_secs),
                tls_reload: crate::tls::ReloadPolicy {
                    interval: Duration::from_secs(args.tls_reload_secs.max(1)),
                    expiry_warning: Duration::from_secs(args.cert_expiry_warning_days * 86_400),
                },
                upgrader,
                metrics_listen: args.metrics_listen,
                min_free_disk_bytes: args.min_free_disk_bytes,
                spot_imds: args.spot_imds,
                registry_mirrors: args.registry_mirror,
                actions_proxy: crate::edge::server::ActionsProxyConfig {
                    listen: match args.cache_proxy_listen.as_deref() {
                        None => crate::edge::server::ProxyListen::BridgeGateway,
                        Some("off") => crate::edge::server::ProxyListen::Off,
                        Some(a) => crate::edge::server::ProxyListen::At(a.parse().map_err(|_| {
                            format!("--cache-proxy-listen {a:?} is neither ADDRESS:PORT (172.17.0.1:7718) nor off")
                        })?),
                    },
                    upstream: args.actions_results_upstream,
                    extra_ca: args.actions_results_ca,
                },
            },
            args.listen,
        ))
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::super::{Cli, Command};

    /// `billet node`'s configuration from `extra` flags beside the
    /// required ones.
    fn config(extra: &[&str]) -> Result<crate::edge::server::NodeConfig, String> {
        let args = [
            "billet",
            "node",
            "--listen",
            "127.0.0.1:7443",
            "--cert",
            "/c",
            "--key",
            "/k",
            "--ca",
            "/a",
            "--vcpu",
            "2",
            "--memory-bytes",
            "1073741824",
        ]
        .iter()
        .chain(extra);
        let Command::Node(node) = Cli::try_parse_from(args)
            .map_err(|e| e.to_string())?
            .command
        else {
            panic!("not node");
        };
        node.into_config().map(|(c, _)| c)
    }

    /// The cache's eviction flags, checked, each error naming its flag.
    #[test]
    fn the_cache_eviction_flags_are_checked_and_each_error_names_its_flag() {
        let c = config(&[]).unwrap();
        assert_eq!(c.cache_eviction, crate::cache::Eviction::default());
        assert_eq!(
            c.cache_evict_interval,
            crate::cache::lifecycle::DEFAULT_EVICT_INTERVAL
        );
        let c = config(&[
            "--cache-max-bytes",
            "1000",
            "--cache-retention-hours",
            "2",
            "--cache-evict-interval-secs",
            "30",
            "--cache-image-store-retention-hours",
            "3",
        ])
        .unwrap();
        assert_eq!(c.cache_eviction.budget_bytes, Some(1000));
        assert_eq!(c.cache_eviction.retention.as_secs(), 7200);
        assert_eq!(c.cache_eviction.image_store_retention.as_secs(), 3 * 3600);
        assert_eq!(c.cache_evict_interval.as_secs(), 30);
        // The image store's retention does not follow the general one.
        let c = config(&["--cache-retention-hours", "2"]).unwrap();
        assert_eq!(c.cache_eviction.image_store_retention.as_secs(), 192 * 3600);
        for (flag, value) in [
            ("--cache-max-bytes", "0"),
            ("--cache-retention-hours", "0"),
            ("--cache-retention-hours", "87601"),
            ("--cache-image-store-retention-hours", "0"),
            ("--cache-image-store-retention-hours", "87601"),
            ("--cache-evict-interval-secs", "0"),
            ("--cache-evict-interval-secs", "86401"),
        ] {
            let e = config(&[flag, value]).unwrap_err();
            assert!(e.contains(flag), "{flag} {value}: {e}");
        }
    }
}
