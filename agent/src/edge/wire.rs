//! The edge between generated proto types and the node's own: every command
//! field is checked here, and a malformed one is reported naming the field,
//! before anything is queued or done. Messages are destructured field by
//! field so that a new proto field is a compile error here until handled.

use billet_proto::v1 as pb;

use crate::cache::{Policy, StickyDisk};

use crate::model::{
    ByteSize, CommandId, DestroyOrder, Epoch, InstanceName, InvalidField, Job, Lease, LeaseId,
    NodeCommand, RequestId, RunnerVersion, TierSpec, Trust, UpgradeSpec, WarmTarget, parse_phase,
};

/// Largest memory a lease may ask for (16 TiB): anything above is a typo.
const MAX_MEMORY_BYTES: u64 = 16 << 40;
/// Most vCPUs a lease may ask for.
const MAX_VCPU: u32 = 1024;

/// A command off the wire: its id, its deadline, and the checked command or
/// the reason it is malformed.
#[derive(Debug, Clone)]
pub(crate) struct Incoming {
    /// The command id, as sent (echoed in the result even when invalid).
    pub id: String,
    /// When the command expires, in unix milliseconds on the plane's clock.
    pub deadline_unix_ms: i64,
    /// How long it had left when the plane sent it, in milliseconds;
    /// `None` when the plane did not say (then `deadline_unix_ms` is
    /// judged, corrected by the measured clock offset).
    pub deadline_remaining_ms: Option<u64>,
    /// The checked command.
    pub command: Result<(CommandId, NodeCommand), InvalidField>,
}

/// Checks a command from the wire.
pub(crate) fn command(cmd: pb::Command) -> Incoming {
    let pb::Command {
        id,
        deadline_unix_ms,
        deadline_remaining_ms,
        kind,
    } = cmd;
    let checked = (|| {
        let command_id = CommandId::parse("command.id", &id)?;
        if deadline_remaining_ms.is_none() && deadline_unix_ms <= 0 {
            return Err(InvalidField::new(
                "command.deadline_unix_ms",
                "must be a positive unix time in milliseconds",
            ));
        }
        let kind = kind.ok_or_else(|| {
            InvalidField::new(
                "command.kind",
                format!(
                    "is missing or a kind this node does not know (it speaks wire protocol {})",
                    billet_proto::PROTOCOL_VERSION
                ),
            )
        })?;
        Ok((command_id, node_command(kind)?))
    })();
    Incoming {
        id,
        deadline_unix_ms,
        deadline_remaining_ms,
        command: checked,
    }
}

/// A degraded reason as the wire spells it.
pub(crate) fn degraded_reason(reason: crate::node::health::Reason) -> pb::DegradedReason {
    use crate::node::health::Reason;
    match reason {
        Reason::ProviderUnreachable => pb::DegradedReason::ProviderUnreachable,
        Reason::ProviderStuck => pb::DegradedReason::ProviderStuck,
        Reason::DiskLow => pb::DegradedReason::DiskLow,
        Reason::JournalUnwritable => pb::DegradedReason::JournalUnwritable,
        Reason::IdentityExpiring => pb::DegradedReason::IdentityExpiring,
        Reason::IdentityExpired => pb::DegradedReason::IdentityExpired,
        Reason::ClockOffset => pb::DegradedReason::ClockOffset,
        Reason::SpotInterruption => pb::DegradedReason::SpotInterruption,
        Reason::SlotStuck => pb::DegradedReason::SlotStuck,
    }
}

/// The reasons of a health snapshot, as wire enum values.
pub(crate) fn degraded_reasons(snapshot: &crate::node::health::Snapshot) -> Vec<i32> {
    snapshot
        .reasons
        .iter()
        .map(|r| degraded_reason(*r) as i32)
        .collect()
}

/// A health snapshot as the session's `NodeStatus`.
pub(crate) fn node_status(snapshot: &crate::node::health::Snapshot) -> pb::NodeStatus {
    pb::NodeStatus {
        degraded: snapshot.degraded(),
        reasons: degraded_reasons(snapshot),
        clock_offset_ms: snapshot.clock_offset_ms.unwrap_or(0),
        certificate_not_after_unix_ms: snapshot.certificate_not_after_unix_ms(),
        reattach: false,
    }
}

/// A registration the plane minted for `lease` (`Launch.registration`): a
/// positive runner id, the runner name `billet-<lease id>` (the name the
/// node's instance and every removal use) and a config that is not empty.
fn registration(
    r: pb::JitConfig,
    lease: &LeaseId,
) -> Result<crate::model::Registration, InvalidField> {
    if r.runner_id <= 0 {
        return Err(InvalidField::new(
            "launch.registration.runner_id",
            "must be the positive id GitHub gave the registration",
        ));
    }
    let expected = crate::model::InstanceName::for_lease(lease);
    if r.runner_name != expected.as_str() {
        return Err(InvalidField::new(
            "launch.registration.runner_name",
            format!("must be {expected}, the runner name of the lease"),
        ));
    }
    if r.encoded_jit_config.is_empty() {
        return Err(InvalidField::new(
            "launch.registration.encoded_jit_config",
            "must not be empty",
        ));
    }
    Ok(crate::model::Registration {
        config: crate::model::JitConfig::new(r.encoded_jit_config),
        runner_id: r.runner_id,
        runner_name: r.runner_name,
    })
}

fn node_command(kind: pb::command::Kind) -> Result<NodeCommand, InvalidField> {
    use pb::command::Kind;
    Ok(match kind {
        Kind::Launch(pb::Launch {
            lease,
            tier,
            job,
            registration,
            warm_instance,
        }) => {
            let lease = lease.ok_or_else(|| InvalidField::new("launch.lease", "is missing"))?;
            let lease = self::lease(lease, "launch.lease")?;
            let tier =
                tier_spec(tier.ok_or_else(|| InvalidField::new("launch.tier", "is missing"))?)?;
            let job = job.map(self::job).unwrap_or_default();
            if job.request_id != lease.request_id && job.request_id.0 != 0 {
                return Err(InvalidField::new(
                    "launch.job.request_id",
                    format!(
                        "is {} but the lease was reserved for request {}",
                        job.request_id, lease.request_id
                    ),
                ));
            }
            let registration = registration
                .map(|r| self::registration(r, &lease.id))
                .transpose()?;
            let warm = if warm_instance.is_empty() {
                None
            } else {
                Some(InstanceName::warm(&warm_instance).ok_or_else(|| {
                    InvalidField::new(
                        "launch.warm_instance",
                        format!(
                            "{warm_instance:?} is not a warm runner's name (billet_warm-<16 hex>)"
                        ),
                    )
                })?)
            };
            NodeCommand::Launch {
                lease,
                tier,
                job,
                registration,
                warm,
            }
        }
        Kind::Destroy(pb::Destroy {
            request_id,
            job_result,
            force,
            reason,
        }) => {
            if request_id <= 0 {
                return Err(InvalidField::new(
                    "destroy.request_id",
                    "must be a positive request id",
                ));
            }
            if let Some(r) = &job_result
                && (r.is_empty() || r.len() > 64)
            {
                return Err(InvalidField::new(
                    "destroy.job_result",
                    "must be a GitHub result word such as \"succeeded\"",
                ));
            }
            if reason.len() > 64 || reason.chars().any(char::is_control) {
                return Err(InvalidField::new(
                    "destroy.reason",
                    "must be at most 64 bytes of printable text, such as \"registration_lost\"",
                ));
            }
            NodeCommand::Destroy {
                request_id: RequestId(request_id),
                order: DestroyOrder {
                    job_result,
                    force,
                    reason: (!reason.is_empty()).then_some(reason),
                },
            }
        }
        Kind::AssumeCustody(pb::AssumeCustody { lease, request_id }) => {
            let lease =
                lease.ok_or_else(|| InvalidField::new("assume_custody.lease", "is missing"))?;
            let lease = self::lease(lease, "assume_custody.lease")?;
            let request_id = if request_id > 0 {
                RequestId(request_id)
            } else {
                lease.request_id
            };
            NodeCommand::AssumeCustody { lease, request_id }
        }
        Kind::StartUpgrade(pb::StartUpgrade {
            version,
            manifest_sha256,
            rollout_id,
            generation,
        }) => {
            if version.is_empty() {
                return Err(InvalidField::new(
                    "start_upgrade.version",
                    "must name an exact release",
                ));
            }
            crate::model::check_id("start_upgrade.version", &version)?;
            let manifest_sha256 = (!manifest_sha256.is_empty()).then_some(manifest_sha256);
            if let Some(d) = &manifest_sha256
                && (d.len() != 64 || !d.chars().all(|c| c.is_ascii_hexdigit()))
            {
                return Err(InvalidField::new(
                    "start_upgrade.manifest_sha256",
                    "must be 64 hex digits",
                ));
            }
            let rollout_id = (!rollout_id.is_empty()).then_some(rollout_id);
            if let Some(r) = &rollout_id {
                crate::model::check_id("start_upgrade.rollout_id", r)?;
            }
            NodeCommand::StartUpgrade(UpgradeSpec {
                version,
                manifest_sha256,
                rollout_id,
                generation,
            })
        }
        Kind::Instances(pb::Instances {}) => NodeCommand::Instances,
        Kind::Sweep(pb::Sweep {}) => NodeCommand::Sweep,
        Kind::Tend(pb::Tend {}) => NodeCommand::Tend,
        Kind::Superseded(pb::Superseded {}) => NodeCommand::Superseded,
        Kind::WarmPool(pb::WarmPool { tiers }) => NodeCommand::WarmPool(
            tiers
                .into_iter()
                .enumerate()
                .map(|(i, t)| warm_tier(t, &format!("warm_pool.tiers[{i}]")))
                .collect::<Result<_, _>>()?,
        ),
    })
}

/// Checks one tier of a `WarmPool`; `field` prefixes the names in errors.
fn warm_tier(tier: pb::WarmTier, field: &str) -> Result<WarmTarget, InvalidField> {
    let pb::WarmTier {
        tier,
        count,
        vcpu,
        memory_bytes,
        idle_retire_secs,
        max_age_secs,
    } = tier;
    let tier = tier
        .ok_or_else(|| InvalidField::new(format!("{field}.tier"), "is missing"))
        .and_then(tier_spec)
        .map_err(|mut e| {
            if let Some(rest) = e.field.strip_prefix("launch.tier") {
                e.field = format!("{field}.tier{rest}");
            }
            e
        })?;
    let secs = |s: u64| (s > 0).then(|| std::time::Duration::from_secs(s.min(MAX_WARM_SECS)));
    Ok(WarmTarget {
        tier,
        count,
        vcpu,
        memory: ByteSize(memory_bytes),
        idle_retire: secs(idle_retire_secs),
        max_age: secs(max_age_secs),
    })
}

/// The longest idle or age bound a warm pool takes: a year.
const MAX_WARM_SECS: u64 = 365 * 24 * 3600;

/// Checks a lease; `field` prefixes the names in errors.
///
/// # Errors
///
/// [`InvalidField`] naming the field at fault.
pub(crate) fn lease(lease: pb::Lease, field: &str) -> Result<Lease, InvalidField> {
    let pb::Lease {
        id,
        epoch,
        tier,
        phase,
        vcpu,
        memory_bytes,
        node: _,
        request_id,
        providers,
        failure_reason,
        // How a lease ended is the plane's record; the node names it when
        // it ends one, and reads no lease it has ended.
        end_reason: _,
        end_detail: _,
    } = lease;
    let f = |name: &str| format!("{field}.{name}");
    let id = LeaseId::parse(&f("id"), &id)?;
    if epoch == 0 {
        return Err(InvalidField::new(f("epoch"), "must be at least 1"));
    }
    if tier.is_empty() || tier.len() > 128 {
        return Err(InvalidField::new(
            f("tier"),
            "must be a tier label of 1 to 128 bytes",
        ));
    }
    let phase = parse_phase(&f("phase"), &phase)?;
    if vcpu > MAX_VCPU {
        return Err(InvalidField::new(
            f("vcpu"),
            format!("{vcpu} is more than {MAX_VCPU}"),
        ));
    }
    if memory_bytes > MAX_MEMORY_BYTES {
        return Err(InvalidField::new(
            f("memory_bytes"),
            format!("{memory_bytes} bytes is more than 16 TiB"),
        ));
    }
    if request_id < 0 {
        return Err(InvalidField::new(f("request_id"), "must not be negative"));
    }
    for p in &providers {
        crate::model::check_id(&f("providers"), p)?;
    }
    Ok(Lease {
        id,
        epoch: Epoch(epoch),
        tier,
        phase,
        vcpu,
        memory: ByteSize(memory_bytes),
        request_id: RequestId(request_id),
        providers,
        failure_reason: (!failure_reason.is_empty()).then_some(failure_reason),
    })
}

fn tier_spec(tier: pb::TierSpec) -> Result<TierSpec, InvalidField> {
    let pb::TierSpec {
        label,
        image,
        command,
        trust,
        shm_bytes,
        network,
        env,
        sticky_disks,
        actions_cache,
        cache_scope,
        docker_image_store,
        min_runner_version,
        host,
        pids_limit,
    } = tier;
    if label.is_empty() {
        return Err(InvalidField::new("launch.tier.label", "must not be empty"));
    }
    check_image(&image)?;
    if command.is_empty() || command.iter().any(String::is_empty) {
        return Err(InvalidField::new(
            "launch.tier.command",
            "must be a non-empty argv with no empty element",
        ));
    }
    let trust = match trust.as_str() {
        "trusted" => Trust::Trusted,
        "" | "untrusted" => Trust::Untrusted,
        other => {
            return Err(InvalidField::new(
                "launch.tier.trust",
                format!("{other:?} is neither \"trusted\" nor \"untrusted\""),
            ));
        }
    };
    if shm_bytes > MAX_MEMORY_BYTES {
        return Err(InvalidField::new(
            "launch.tier.shm_bytes",
            "is more than 16 TiB",
        ));
    }
    let network = (!network.is_empty()).then_some(network);
    if let Some(n) = &network {
        crate::model::check_id("launch.tier.network", n)?;
    }
    let env = env
        .into_iter()
        .map(|kv| {
            let (k, v) = kv.split_once('=').ok_or_else(|| {
                InvalidField::new("launch.tier.env", format!("{kv:?} is not KEY=value"))
            })?;
            if k.is_empty()
                || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                || k == "ACTIONS_RUNNER_INPUT_JITCONFIG"
            {
                return Err(InvalidField::new(
                    "launch.tier.env",
                    format!("{k:?} is not an environment variable name the tier may set"),
                ));
            }
            Ok((k.to_owned(), v.to_owned()))
        })
        .collect::<Result<_, _>>()?;
    let min_runner_version = match min_runner_version.trim() {
        "" => None,
        v => Some(
            RunnerVersion::parse(v)
                .map_err(|e| InvalidField::new("launch.tier.min_runner_version", e))?,
        ),
    };
    let host = host_access(host)?;
    host.check_trust(trust, network.as_deref(), "launch.tier")?;
    Ok(TierSpec {
        host,
        pids_limit: (pids_limit > 0).then_some(pids_limit),
        min_runner_version,
        label,
        image,
        command,
        trust,
        shm: ByteSize(shm_bytes),
        network,
        env,
        sticky_disks: sticky(sticky_disks, docker_image_store)?,
        docker_image_store,
        actions_cache: if actions_cache {
            Some(scope(cache_scope)?)
        } else {
            None
        },
    })
}

/// Converts and checks what a tier asks of the host, naming the part at
/// fault (`launch.tier.host.devices`). Whether the tier may ask is checked
/// apart ([`crate::model::HostAccess::check_trust`]).
fn host_access(host: Option<pb::HostAccess>) -> Result<crate::model::HostAccess, InvalidField> {
    use crate::model::host::{absolute_path, capability};
    let Some(pb::HostAccess {
        pid,
        ipc,
        uts,
        privileged,
        devices,
        capabilities,
        mounts,
        new_privileges,
    }) = host
    else {
        return Ok(crate::model::HostAccess::default());
    };
    for device in &devices {
        absolute_path("launch.tier.host.devices", device)?;
    }
    let capabilities = capabilities
        .iter()
        .map(|c| capability("launch.tier.host.capabilities", c))
        .collect::<Result<_, _>>()?;
    let mounts = mounts
        .into_iter()
        .map(|m| {
            let pb::HostMount {
                source,
                target,
                read_only,
            } = m;
            absolute_path("launch.tier.host.mounts.source", &source)?;
            absolute_path("launch.tier.host.mounts.target", &target)?;
            Ok(crate::model::HostMount {
                source,
                target,
                read_only,
            })
        })
        .collect::<Result<_, InvalidField>>()?;
    Ok(crate::model::HostAccess {
        pid,
        ipc,
        uts,
        privileged,
        devices,
        capabilities,
        mounts,
        new_privileges,
    })
}

/// Converts and checks a tier's Actions cache scope, naming the part at
/// fault (`launch.tier.cache_scope.workflow_ref`).
fn scope(scope: Option<pb::CacheScope>) -> Result<crate::cache::actions::CacheScope, InvalidField> {
    const FIELD: &str = "launch.tier.cache_scope";
    let Some(pb::CacheScope {
        owner,
        repository,
        workflow_ref,
    }) = scope
    else {
        return Err(InvalidField::new(
            FIELD,
            "is missing; a tier with actions_cache names the owner, repository and workflow_ref whose cache it uses",
        ));
    };
    crate::cache::actions::CacheScope::new(&owner, &repository, &workflow_ref).map_err(|e| {
        InvalidField::new(
            format!(
                "{FIELD}.{}",
                crate::cache::actions::CacheScope::field_of(&e)
            ),
            e.to_string(),
        )
    })
}

/// Converts and checks a tier's sticky disks, naming the one at fault
/// (`launch.tier.sticky_disks[2].path`).
fn sticky(
    disks: Vec<pb::StickyDisk>,
    docker_image_store: bool,
) -> Result<Vec<StickyDisk>, InvalidField> {
    const FIELD: &str = "launch.tier.sticky_disks";
    if disks.len() > crate::cache::MAX_STICKY_DISKS {
        return Err(InvalidField::new(
            FIELD,
            crate::cache::DiskError::TooMany(disks.len()).to_string(),
        ));
    }
    let count = disks.len();
    let disks = disks
        .into_iter()
        .enumerate()
        .map(|(i, disk)| {
            let pb::StickyDisk {
                key,
                path,
                publication,
            } = disk;
            let policy = match pb::StickyPublication::try_from(publication) {
                Ok(pb::StickyPublication::Cas) => Policy::Cas,
                Ok(pb::StickyPublication::LastWriterWins) => Policy::LastWriterWins,
                Err(_) => {
                    return Err(InvalidField::new(
                        format!("{FIELD}[{i}].publication"),
                        format!("{publication} is neither CAS (0) nor LAST_WRITER_WINS (1)"),
                    ));
                }
            };
            StickyDisk::new(&key, &path, policy).map_err(|e| {
                let part = match e {
                    crate::cache::DiskError::RelativePath(_)
                    | crate::cache::DiskError::BadPath(_)
                    | crate::cache::DiskError::ReservedPath(..) => "path",
                    _ => "key",
                };
                InvalidField::new(format!("{FIELD}[{i}].{part}"), e.to_string())
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    // On the paths in their one spelling (`StickyDisk::new`).
    if docker_image_store {
        crate::cache::check_beside_docker_store(count, disks.iter().map(|d| d.path.as_str()))
            .map_err(|e| InvalidField::new(FIELD, e.to_string()))?;
    }
    crate::cache::check_disks(&disks).map_err(|e| InvalidField::new(FIELD, e.to_string()))?;
    Ok(disks)
}

/// Checks an image reference: `[registry/]name[:tag][@sha256:digest]`, ASCII
/// without spaces or control characters, at most 255 bytes.
fn check_image(image: &str) -> Result<(), InvalidField> {
    let field = "launch.tier.image";
    if image.is_empty() || image.len() > 255 {
        return Err(InvalidField::new(
            field,
            "must be an image reference of 1 to 255 bytes",
        ));
    }
    if let Some(c) = image.chars().find(|c| {
        !(c.is_ascii_lowercase()
            || c.is_ascii_digit()
            || matches!(c, '.' | '_' | '-' | '/' | ':' | '@')
            || c.is_ascii_uppercase())
    }) {
        return Err(InvalidField::new(
            field,
            format!("contains {c:?}, which no image reference may"),
        ));
    }
    if image.starts_with(['-', '/', ':', '@']) {
        return Err(InvalidField::new(
            field,
            "must start with a letter or digit",
        ));
    }
    Ok(())
}

fn job(job: pb::Job) -> Job {
    let pb::Job {
        request_id,
        run_id,
        event,
        owner,
        repository,
        workflow_ref,
    } = job;
    Job {
        request_id: RequestId(request_id),
        run_id,
        event,
        owner,
        repository,
        workflow_ref,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::Phase;

    /// A well-formed launch command (lease `l1`, request 7), for tests here
    /// and in the session.
    pub(crate) fn launch() -> pb::Command {
        pb::Command {
            id: "c1".into(),
            deadline_unix_ms: 1,
            deadline_remaining_ms: None,
            kind: Some(pb::command::Kind::Launch(pb::Launch {
                registration: None,
                lease: Some(pb::Lease {
                    id: "l1".into(),
                    epoch: 1,
                    tier: "linux".into(),
                    phase: "assigned".into(),
                    vcpu: 1,
                    memory_bytes: 1 << 30,
                    request_id: 7,
                    ..Default::default()
                }),
                tier: Some(pb::TierSpec {
                    label: "linux".into(),
                    image: "billet-standin-runner:dev".into(),
                    command: vec!["/run".into()],
                    trust: "trusted".into(),
                    ..Default::default()
                }),
                job: Some(pb::Job {
                    request_id: 7,
                    ..Default::default()
                }),
                warm_instance: String::new(),
            })),
        }
    }

    fn field_of(cmd: pb::Command) -> String {
        command(cmd).command.unwrap_err().field
    }

    /// A launch with every field of every message set to a distinct value,
    /// written out in full (no `..Default::default()`), so a field added to
    /// the proto is a compile error here until the fixture sets it.
    pub(crate) fn full_launch() -> pb::Command {
        pb::Command {
            id: "cmd-42".into(),
            deadline_unix_ms: 1_767_225_600_000,
            deadline_remaining_ms: Some(45_000),
            kind: Some(pb::command::Kind::Launch(pb::Launch {
                registration: None,
                lease: Some(pb::Lease {
                    id: "lease-7f3a".into(),
                    epoch: 4,
                    tier: "linux-xl".into(),
                    phase: "assigned".into(),
                    vcpu: 8,
                    memory_bytes: 16 << 30,
                    node: "node-3".into(),
                    request_id: 4242,
                    providers: vec!["docker".into(), "firecracker".into()],
                    failure_reason: "image pull failed".into(),
                    end_reason: 0,
                    end_detail: String::new(),
                }),
                tier: Some(pb::TierSpec {
                    label: "linux-xl".into(),
                    image: "ghcr.io/acme/runner:2.320".into(),
                    command: vec!["/home/runner/run.sh".into(), "--once".into()],
                    trust: "trusted".into(),
                    shm_bytes: 2 << 30,
                    network: "billet-net".into(),
                    env: vec!["RUNNER_LABELS=xl".into(), "TZ=UTC".into()],
                    sticky_disks: vec![
                        pb::StickyDisk {
                            key: "widgets-npm".into(),
                            path: "/home/runner/.npm".into(),
                            publication: pb::StickyPublication::Cas.into(),
                        },
                        pb::StickyDisk {
                            key: "widgets-buildkit".into(),
                            path: "/var/lib/buildkit".into(),
                            publication: pb::StickyPublication::LastWriterWins.into(),
                        },
                    ],
                    actions_cache: true,
                    cache_scope: Some(pb::CacheScope {
                        owner: "acme".into(),
                        repository: "widgets".into(),
                        workflow_ref: "acme/widgets/.github/workflows/ci.yml@refs/heads/main"
                            .into(),
                    }),
                    docker_image_store: true,
                    min_runner_version: "v2.331.0".into(),
                    host: None,
                    pids_limit: 0,
                }),
                job: Some(pb::Job {
                    request_id: 4242,
                    run_id: 987_654,
                    event: "push".into(),
                    owner: "acme".into(),
                    repository: "widgets".into(),
                    workflow_ref: "acme/widgets/.github/workflows/ci.yml@refs/heads/main".into(),
                }),
                warm_instance: String::new(),
            })),
        }
    }

    /// What [`full_launch`] must convert to, written out independently of
    /// the conversion.
    fn full_launch_expected() -> NodeCommand {
        NodeCommand::Launch {
            registration: None,
            lease: Lease {
                id: LeaseId::parse("test", "lease-7f3a").unwrap(),
                epoch: Epoch(4),
                tier: "linux-xl".into(),
                phase: Phase::Assigned,
                vcpu: 8,
                memory: ByteSize(16 << 30),
                request_id: RequestId(4242),
                providers: vec!["docker".into(), "firecracker".into()],
                failure_reason: Some("image pull failed".into()),
            },
            tier: TierSpec {
                label: "linux-xl".into(),
                image: "ghcr.io/acme/runner:2.320".into(),
                command: vec!["/home/runner/run.sh".into(), "--once".into()],
                trust: Trust::Trusted,
                shm: ByteSize(2 << 30),
                network: Some("billet-net".into()),
                env: vec![
                    ("RUNNER_LABELS".into(), "xl".into()),
                    ("TZ".into(), "UTC".into()),
                ],
                sticky_disks: vec![
                    StickyDisk::new("widgets-npm", "/home/runner/.npm", Policy::Cas).unwrap(),
                    StickyDisk::new(
                        "widgets-buildkit",
                        "/var/lib/buildkit",
                        Policy::LastWriterWins,
                    )
                    .unwrap(),
                ],
                actions_cache: Some(
                    crate::cache::actions::CacheScope::new(
                        "acme",
                        "widgets",
                        "acme/widgets/.github/workflows/ci.yml@refs/heads/main",
                    )
                    .unwrap(),
                ),
                docker_image_store: true,
                min_runner_version: Some(RunnerVersion::parse("2.331.0").unwrap()),
                host: Default::default(),
                pids_limit: None,
            },
            job: Job {
                request_id: RequestId(4242),
                run_id: 987_654,
                event: "push".into(),
                owner: "acme".into(),
                repository: "widgets".into(),
                workflow_ref: "acme/widgets/.github/workflows/ci.yml@refs/heads/main".into(),
            },
            warm: None,
        }
    }

    #[test]
    fn a_well_formed_launch_is_accepted_with_every_field_converted() {
        let incoming = command(full_launch());
        assert_eq!(incoming.id, "cmd-42");
        assert_eq!(incoming.deadline_unix_ms, 1_767_225_600_000);
        assert_eq!(incoming.deadline_remaining_ms, Some(45_000));
        let (id, cmd) = incoming.command.unwrap();
        assert_eq!(id.as_str(), "cmd-42");
        assert_eq!(cmd, full_launch_expected());
    }

    /// A registration the plane minted arrives as the node's own, and one
    /// that cannot be the lease's runner is refused by field, so nothing
    /// is created from it.
    #[test]
    fn a_launchs_registration_must_name_the_leases_runner_with_an_id_and_a_config() {
        let with = |registration: pb::JitConfig| {
            let mut c = launch();
            if let Some(pb::command::Kind::Launch(l)) = c.kind.as_mut() {
                l.registration = Some(registration);
            }
            command(c).command
        };
        let good = pb::JitConfig {
            encoded_jit_config: "cfg".into(),
            runner_id: 9,
            runner_name: "billet-l1".into(),
        };
        let Ok((_, NodeCommand::Launch { registration, .. })) = with(good.clone()) else {
            panic!("a well-formed registration was refused");
        };
        let registration = registration.expect("carried");
        assert_eq!(
            (registration.runner_id, registration.runner_name.as_str()),
            (9, "billet-l1")
        );
        assert_eq!(registration.config.expose(), "cfg");
        for (bad, field) in [
            (
                pb::JitConfig {
                    runner_id: 0,
                    ..good.clone()
                },
                "launch.registration.runner_id",
            ),
            (
                pb::JitConfig {
                    runner_name: "billet-other".into(),
                    ..good.clone()
                },
                "launch.registration.runner_name",
            ),
            (
                pb::JitConfig {
                    encoded_jit_config: String::new(),
                    ..good.clone()
                },
                "launch.registration.encoded_jit_config",
            ),
        ] {
            let refused = with(bad).expect_err("refused");
            assert_eq!(refused.field, field, "{refused:?}");
        }
    }

    #[test]
    fn a_launch_sent_over_the_wire_arrives_with_every_field_it_was_sent_with() {
        use prost::Message as _;
        let sent = pb::PlaneMessage {
            body: Some(pb::plane_message::Body::Command(full_launch())),
        };
        let bytes = sent.encode_to_vec();
        let received = pb::PlaneMessage::decode(bytes.as_slice()).expect("decodes");
        assert_eq!(received, sent, "the bytes lost or changed a field");
        let Some(pb::plane_message::Body::Command(cmd)) = received.body else {
            panic!("not a command: {received:?}");
        };
        let (_, cmd) = command(cmd).command.unwrap();
        assert_eq!(cmd, full_launch_expected());
    }

    #[test]
    fn each_malformed_launch_field_is_named() {
        let mut c = launch();
        c.id = String::new();
        assert_eq!(field_of(c), "command.id");

        let mut c = launch();
        c.deadline_unix_ms = 0;
        assert_eq!(field_of(c), "command.deadline_unix_ms");

        let edit = |f: &dyn Fn(&mut pb::Launch)| {
            let mut c = launch();
            if let Some(pb::command::Kind::Launch(l)) = c.kind.as_mut() {
                f(l);
            }
            field_of(c)
        };
        assert_eq!(
            edit(&|l| l.lease.as_mut().unwrap().id = "a/b".into()),
            "launch.lease.id"
        );
        assert_eq!(
            edit(&|l| l.lease.as_mut().unwrap().epoch = 0),
            "launch.lease.epoch"
        );
        assert_eq!(
            edit(&|l| l.lease.as_mut().unwrap().phase = "Up".into()),
            "launch.lease.phase"
        );
        assert_eq!(
            edit(&|l| l.lease.as_mut().unwrap().memory_bytes = u64::MAX),
            "launch.lease.memory_bytes"
        );
        assert_eq!(
            edit(&|l| l.tier.as_mut().unwrap().image = "bad image".into()),
            "launch.tier.image"
        );
        assert_eq!(
            edit(&|l| l.tier.as_mut().unwrap().command.clear()),
            "launch.tier.command"
        );
        assert_eq!(
            edit(&|l| l.tier.as_mut().unwrap().trust = "maybe".into()),
            "launch.tier.trust"
        );
        assert_eq!(
            edit(&|l| l.tier.as_mut().unwrap().min_runner_version = "latest".into()),
            "launch.tier.min_runner_version"
        );
        assert_eq!(
            edit(
                &|l| l.tier.as_mut().unwrap().env = vec!["ACTIONS_RUNNER_INPUT_JITCONFIG=x".into()]
            ),
            "launch.tier.env"
        );
        assert_eq!(
            edit(&|l| l.job.as_mut().unwrap().request_id = 8),
            "launch.job.request_id"
        );
        assert_eq!(edit(&|l| l.tier = None), "launch.tier");
    }

    #[test]
    fn an_actions_cache_tier_without_a_valid_scope_is_refused_naming_the_part() {
        let with = |actions_cache: bool, scope: Option<pb::CacheScope>| {
            let mut c = full_launch();
            if let Some(pb::command::Kind::Launch(l)) = c.kind.as_mut() {
                let tier = l.tier.as_mut().unwrap();
                tier.actions_cache = actions_cache;
                tier.cache_scope = scope;
            }
            command(c).command
        };
        let scope = |owner: &str, repository: &str, workflow_ref: &str| {
            Some(pb::CacheScope {
                owner: owner.into(),
                repository: repository.into(),
                workflow_ref: workflow_ref.into(),
            })
        };
        let e = with(true, None).unwrap_err();
        assert_eq!(e.field, "launch.tier.cache_scope");
        assert!(e.problem.contains("is missing"), "{}", e.problem);
        let e = with(true, scope("", "app", "a/ci.yml@main")).unwrap_err();
        assert_eq!(e.field, "launch.tier.cache_scope.owner");
        let e = with(true, scope("acme", "a/b", "a/ci.yml@main")).unwrap_err();
        assert_eq!(e.field, "launch.tier.cache_scope.repository");
        let e = with(true, scope("acme", "app", "a/ci.yml")).unwrap_err();
        assert_eq!(e.field, "launch.tier.cache_scope.workflow_ref");
        assert!(e.problem.contains("<workflow path>@<ref>"), "{}", e.problem);
        // Without the opt-in the scope is not read: no proxy, nothing to check.
        let Ok((_, NodeCommand::Launch { tier, .. })) = with(false, scope("", "", "")) else {
            panic!("a tier without actions_cache is accepted");
        };
        assert_eq!(tier.actions_cache, None);
    }

    #[test]
    fn a_bad_sticky_disk_is_refused_naming_the_disk_and_saying_what_to_fix() {
        let with = |disks: Vec<pb::StickyDisk>| {
            let mut c = full_launch();
            if let Some(pb::command::Kind::Launch(l)) = c.kind.as_mut() {
                l.tier.as_mut().unwrap().sticky_disks = disks;
            }
            command(c).command.unwrap_err()
        };
        let disk = |key: &str, path: &str| pb::StickyDisk {
            key: key.into(),
            path: path.into(),
            publication: pb::StickyPublication::Cas.into(),
        };
        let six = (0..6)
            .map(|i| disk(&format!("k{i}"), &format!("/c/{i}")))
            .collect();
        let e = with(six);
        assert_eq!(e.field, "launch.tier.sticky_disks");
        assert!(e.problem.contains("at most 5"), "{}", e.problem);
        let e = with(vec![disk("npm", "/c/npm"), disk("go", "cache/go")]);
        assert_eq!(e.field, "launch.tier.sticky_disks[1].path");
        assert!(e.problem.contains("not absolute"), "{}", e.problem);
        let e = with(vec![disk("", "/c/npm")]);
        assert_eq!(e.field, "launch.tier.sticky_disks[0].key");
        assert!(e.problem.contains("empty"), "{}", e.problem);
        let e = with(vec![disk("npm", "/c/../etc")]);
        assert_eq!(e.field, "launch.tier.sticky_disks[0].path");
        let e = with(vec![disk("npm", "/c/npm"), disk("go", "/c/npm/")]);
        assert_eq!(e.field, "launch.tier.sticky_disks");
        assert!(e.problem.contains("its own path"), "{}", e.problem);
        let e = with(vec![disk("docker-images/amd64", "/c")]);
        assert_eq!(e.field, "launch.tier.sticky_disks[0].key");
        let mut odd = disk("npm", "/c/npm");
        odd.publication = 9;
        let e = with(vec![odd]);
        assert_eq!(e.field, "launch.tier.sticky_disks[0].publication");
    }

    /// The Docker image store takes slot 0, so a tier with it names at
    /// most 4 sticky disks, none hiding /var/lib/docker.
    #[test]
    fn beside_the_docker_image_store_a_tier_names_four_disks_none_at_var_lib_docker() {
        let with = |store: bool, disks: Vec<pb::StickyDisk>| {
            let mut c = full_launch();
            if let Some(pb::command::Kind::Launch(l)) = c.kind.as_mut() {
                let tier = l.tier.as_mut().unwrap();
                tier.sticky_disks = disks;
                tier.docker_image_store = store;
            }
            command(c).command
        };
        let disks = |n: usize| -> Vec<pb::StickyDisk> {
            (0..n)
                .map(|i| pb::StickyDisk {
                    key: format!("k{i}"),
                    path: format!("/c/{i}"),
                    publication: pb::StickyPublication::Cas.into(),
                })
                .collect()
        };
        assert!(with(true, disks(4)).is_ok());
        assert!(with(false, disks(5)).is_ok());
        let e = with(true, disks(5)).unwrap_err();
        assert_eq!(e.field, "launch.tier.sticky_disks");
        assert!(e.problem.contains("at most 4"), "{}", e.problem);
        let mut at = disks(1);
        at[0].path = "/var/lib/docker".into();
        let e = with(true, at.clone()).unwrap_err();
        assert_eq!(e.field, "launch.tier.sticky_disks");
        assert!(e.problem.contains("/var/lib/docker"), "{}", e.problem);
        assert!(
            with(false, at).is_ok(),
            "without the store the path is free"
        );
    }

    /// A disk path the engine refuses is refused at the edge, naming the
    /// disk, not by `docker create`/`start` at every launch of the tier.
    /// Past the edge, the engine would refuse each of these containers
    /// (checked by hand against Docker 20.10: "Duplicate mount point:
    /// /c//npm" for the first three; runc's "error mounting ... to rootfs
    /// at /proc" and the like at start for the rest), so every launch of
    /// the tier would fail at the create or the start and its job be
    /// retried for ever.
    #[test]
    fn a_disk_path_the_engine_would_refuse_is_refused_at_the_edge() {
        let with = |store: bool, disks: Vec<pb::StickyDisk>| {
            let mut c = full_launch();
            if let Some(pb::command::Kind::Launch(l)) = c.kind.as_mut() {
                let tier = l.tier.as_mut().unwrap();
                tier.sticky_disks = disks;
                tier.docker_image_store = store;
            }
            command(c).command
        };
        let disk = |key: &str, path: &str| pb::StickyDisk {
            key: key.into(),
            path: path.into(),
            publication: pb::StickyPublication::Cas.into(),
        };
        let mut accepted = Vec::new();
        // One path in two spellings: two mounts at one destination.
        if with(false, vec![disk("npm", "/c/npm"), disk("go", "/c//npm")]).is_ok() {
            accepted.push("/c/npm beside /c//npm");
        }
        // The image store's path in another spelling.
        if with(true, vec![disk("npm", "/var/lib//docker")]).is_ok() {
            accepted.push("/var/lib//docker beside the Docker image store");
        }
        // The cache session's own bind (GUEST_DIR).
        if with(false, vec![disk("npm", crate::cache::session::GUEST_DIR)]).is_ok() {
            accepted.push("/run/billet-cache, where the cache socket is bound");
        }
        // Kernel file systems the runtime will not mount over.
        for path in ["/proc", "/dev", "/sys/fs/x"] {
            if with(false, vec![disk("npm", path)]).is_ok() {
                accepted.push(path);
            }
        }
        assert!(
            accepted.is_empty(),
            "the edge accepted disk paths the engine refuses: {accepted:?}"
        );
        // Named by the disk's field, saying what to do.
        let refused = with(false, vec![disk("npm", "/dev/shm/x")]).unwrap_err();
        let text = format!("{refused}");
        assert!(
            text.contains("sticky_disks[0].path") && text.contains("another path"),
            "{text}"
        );
        // One spelling: a trailing or doubled `/` is the same directory.
        assert!(with(false, vec![disk("npm", "/c/npm/"), disk("go", "/c/go")]).is_ok());
        assert!(with(false, vec![disk("npm", "/c/npm/"), disk("go", "/c/npm")]).is_err());
        assert!(
            with(false, vec![disk("npm", "/devices")]).is_ok(),
            "a sibling of /dev is fine"
        );
    }

    #[test]
    fn a_destroy_needs_a_positive_request_id() {
        let c = pb::Command {
            id: "c".into(),
            deadline_unix_ms: 1,
            deadline_remaining_ms: None,
            kind: Some(pb::command::Kind::Destroy(pb::Destroy {
                request_id: 0,
                job_result: None,
                force: false,
                reason: String::new(),
            })),
        };
        assert_eq!(field_of(c), "destroy.request_id");
    }

    #[test]
    fn a_destroy_carries_its_force_and_reason_and_refuses_a_reason_that_is_not_a_word() {
        let destroy = |reason: &str| pb::Command {
            id: "c".into(),
            deadline_unix_ms: 1,
            deadline_remaining_ms: None,
            kind: Some(pb::command::Kind::Destroy(pb::Destroy {
                request_id: 7,
                job_result: None,
                force: true,
                reason: reason.into(),
            })),
        };
        let (_, checked) = command(destroy("registration_lost"))
            .command
            .expect("valid");
        assert_eq!(
            checked,
            NodeCommand::Destroy {
                request_id: RequestId(7),
                order: DestroyOrder::forced("registration_lost"),
            }
        );
        let (_, checked) = command(destroy("")).command.expect("valid");
        assert_eq!(
            checked,
            NodeCommand::Destroy {
                request_id: RequestId(7),
                order: DestroyOrder {
                    force: true,
                    ..DestroyOrder::default()
                },
            }
        );
        assert_eq!(field_of(destroy("a\nb")), "destroy.reason");
        assert_eq!(field_of(destroy(&"x".repeat(65))), "destroy.reason");
    }

    #[test]
    fn a_command_without_a_kind_is_refused() {
        let c = pb::Command {
            id: "c".into(),
            deadline_unix_ms: 1,
            deadline_remaining_ms: None,
            kind: None,
        };
        assert_eq!(field_of(c), "command.kind");
    }
}

/// Property tests over decoding and checking: any bytes, and any command
/// built from arbitrary field values, are either refused naming a field or
/// accepted, and never panic. Checking is pure, so a refusal has no effect.
/// Failing cases are kept in `proptest-regressions/` and replayed first.
#[cfg(test)]
pub(crate) mod properties {
    use super::*;
    use proptest::prelude::*;
    use prost::Message;

    fn text() -> impl Strategy<Value = String> {
        prop_oneof![
            Just(String::new()),
            "[a-z0-9.-]{1,12}",
            ".{0,40}",
            "[ -~]{120,140}",
            Just("billet-standin-runner:dev".to_owned()),
            Just("trusted".to_owned()),
            Just("launching".to_owned()),
        ]
    }

    fn lease() -> impl Strategy<Value = pb::Lease> {
        (
            text(),
            any::<u64>(),
            text(),
            text(),
            any::<u32>(),
            any::<u64>(),
            any::<i64>(),
            proptest::collection::vec(text(), 0..3),
        )
            .prop_map(
                |(id, epoch, tier, phase, vcpu, memory_bytes, request_id, providers)| pb::Lease {
                    id,
                    epoch,
                    tier,
                    phase,
                    vcpu,
                    memory_bytes,
                    node: String::new(),
                    request_id,
                    providers,
                    failure_reason: String::new(),
                    end_reason: 0,
                    end_detail: String::new(),
                },
            )
    }

    fn tier() -> impl Strategy<Value = pb::TierSpec> {
        (
            text(),
            text(),
            proptest::collection::vec(text(), 0..3),
            text(),
            any::<u64>(),
            text(),
            proptest::collection::vec(text(), 0..3),
        )
            .prop_map(|(label, image, command, trust, shm_bytes, network, env)| {
                pb::TierSpec {
                    label,
                    image,
                    command,
                    trust,
                    shm_bytes,
                    network,
                    env,
                    sticky_disks: Vec::new(),
                    actions_cache: false,
                    cache_scope: None,
                    docker_image_store: false,
                    min_runner_version: String::new(),
                    host: None,
                    pids_limit: 0,
                }
            })
    }

    fn kind() -> impl Strategy<Value = Option<pb::command::Kind>> {
        use pb::command::Kind;
        prop_oneof![
            Just(None),
            (
                proptest::option::of(lease()),
                proptest::option::of(tier()),
                any::<i64>()
            )
                .prop_map(|(lease, tier, r)| Some(Kind::Launch(pb::Launch {
                    registration: None,
                    lease,
                    tier,
                    job: Some(pb::Job {
                        request_id: r,
                        ..Default::default()
                    }),
                    warm_instance: String::new(),
                }))),
            (
                any::<i64>(),
                proptest::option::of(text()),
                any::<bool>(),
                text()
            )
                .prop_map(|(request_id, job_result, force, reason)| Some(
                    Kind::Destroy(pb::Destroy {
                        request_id,
                        job_result,
                        force,
                        reason,
                    })
                )),
            (proptest::option::of(lease()), any::<i64>()).prop_map(|(lease, request_id)| Some(
                Kind::AssumeCustody(pb::AssumeCustody { lease, request_id })
            )),
            (text(), text(), text(), any::<u64>()).prop_map(
                |(version, manifest_sha256, rollout_id, generation)| Some(Kind::StartUpgrade(
                    pb::StartUpgrade {
                        version,
                        manifest_sha256,
                        rollout_id,
                        generation
                    }
                ))
            ),
            Just(Some(Kind::Sweep(pb::Sweep {}))),
            Just(Some(Kind::Tend(pb::Tend {}))),
        ]
    }

    /// The seed every run starts from, kept here so a CI run is
    /// reproducible; `PROPTEST_RNG_SEED=<n>` explores from another.
    pub(crate) const SEED: u64 = 0x00b1_11e7;

    /// `cases` cases from [`SEED`], or from `PROPTEST_RNG_SEED` when set.
    pub(crate) fn config(cases: u32) -> ProptestConfig {
        let mut config = ProptestConfig::with_cases(cases);
        if std::env::var_os("PROPTEST_RNG_SEED").is_none() {
            config.rng_seed = proptest::test_runner::RngSeed::Fixed(SEED);
        }
        config
    }

    pub(crate) fn command_strategy() -> impl Strategy<Value = pb::Command> {
        (
            text(),
            any::<i64>(),
            proptest::option::of(any::<u64>()),
            kind(),
        )
            .prop_map(
                |(id, deadline_unix_ms, deadline_remaining_ms, kind)| pb::Command {
                    id,
                    deadline_unix_ms,
                    deadline_remaining_ms,
                    kind,
                },
            )
    }

    proptest! {
        #![proptest_config(config(512))]

        #[test]
        fn any_bytes_decode_or_fail_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            if let Ok(pb::PlaneMessage { body: Some(pb::plane_message::Body::Command(c)) }) = pb::PlaneMessage::decode(bytes.as_slice()) {
                let _ = command(c);
            }
        }

        #[test]
        fn any_command_is_accepted_or_refused_naming_a_field(cmd in command_strategy()) {
            let incoming = command(cmd.clone());
            match incoming.command {
                Err(invalid) => {
                    prop_assert!(!invalid.field.is_empty());
                    prop_assert!(invalid.field.starts_with("command.")
                        || invalid.field.starts_with("launch.")
                        || invalid.field.starts_with("destroy.")
                        || invalid.field.starts_with("assume_custody.")
                        || invalid.field.starts_with("start_upgrade."), "field {}", invalid.field);
                }
                Ok((id, checked)) => {
                    prop_assert_eq!(id.as_str(), cmd.id.as_str());
                    prop_assert!(cmd.deadline_unix_ms > 0 || cmd.deadline_remaining_ms.is_some());
                    if let NodeCommand::Launch { lease, tier, .. } = checked {
                        prop_assert!(lease.epoch.0 > 0);
                        prop_assert!(!tier.command.is_empty());
                        prop_assert!(tier.env.iter().all(|(k, _)| k != "ACTIONS_RUNNER_INPUT_JITCONFIG"));
                    }
                }
            }
        }

        #[test]
        fn an_encoded_command_decodes_to_the_same_verdict(cmd in command_strategy()) {
            let bytes = pb::PlaneMessage { body: Some(pb::plane_message::Body::Command(cmd.clone())) }.encode_to_vec();
            let decoded = pb::PlaneMessage::decode(bytes.as_slice()).expect("round trip");
            let Some(pb::plane_message::Body::Command(again)) = decoded.body.clone() else { panic!("not a command") };
            // The bytes carry every field as sent: the decoded message is
            // the one encoded, not merely one that converts alike.
            prop_assert_eq!(&again, &cmd);
            prop_assert_eq!(command(cmd).command.map(|(_, c)| c), command(again).command.map(|(_, c)| c));
        }
    }
}
