//! `billet node status`: asks a running node on its local socket
//! (`<state_dir>/node.sock`, [`crate::local`]) what it is doing, and
//! prints it as a table, or as JSON with `--json`. It reads; it changes
//! nothing, and needs no certificate: whoever can enter the 0700 state
//! directory may ask.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use billet_proto::v1 as pb;

use super::exit;

/// `billet node status`'s flags.
#[derive(Debug, clap::Parser)]
#[command(
    name = "status",
    bin_name = "billet node status",
    about = "Show what the node on this host is doing: its release, recovery, plane contact, certificate and the leases it holds"
)]
pub struct StatusArgs {
    /// The node's configuration file; its `state_dir` is used (relative to
    /// the file's directory) unless --state-dir is given.
    #[arg(long, env = "BILLET_CONFIG")]
    pub config: Option<PathBuf>,
    /// The node's state directory, where its local socket is.
    #[arg(long, env = "BILLET_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Seconds to wait for the node's answer.
    #[arg(long, default_value_t = 5, value_parser = super::within::<0, { super::MAX_FLAG_SECS }>)]
    pub timeout_secs: u64,
}

/// The state directory when neither the flag, the environment nor a file
/// names one: `billet node`'s default.
const DEFAULT_STATE_DIR: &str = "/var/lib/billet";

impl StatusArgs {
    /// Where to look: `--state-dir`, else the file's `state_dir`, else the
    /// default.
    ///
    /// # Errors
    ///
    /// The file cannot be read or is not TOML, naming it.
    fn state_dir(&self) -> Result<PathBuf, String> {
        resolve_state_dir(self.state_dir.as_ref(), self.config.as_ref())
    }
}

/// Where a node's local socket is: `state_dir`, else the `state_dir` of the
/// configuration file `config` (relative to the file's directory), else
/// the default.
///
/// # Errors
///
/// The file cannot be read or is not TOML, naming it.
pub(crate) fn resolve_state_dir(
    state_dir: Option<&PathBuf>,
    config: Option<&PathBuf>,
) -> Result<PathBuf, String> {
    if let Some(dir) = state_dir {
        return Ok(dir.clone());
    }
    let Some(file) = config else {
        return Ok(PathBuf::from(DEFAULT_STATE_DIR));
    };
    let text = std::fs::read_to_string(file)
        .map_err(|e| format!("configuration file {}: cannot read: {e}", file.display()))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e| format!("configuration file {}: not valid TOML: {e}", file.display()))?;
    Ok(match table.get("state_dir").and_then(|v| v.as_str()) {
        Some(dir) => std::path::absolute(file)
            .ok()
            .and_then(|f| f.parent().map(|p| p.join(dir)))
            .unwrap_or_else(|| PathBuf::from(dir)),
        None => PathBuf::from(DEFAULT_STATE_DIR),
    })
}

/// Runs `billet node status`: 0 when the node answered, [`exit::CONFIG`]
/// for a configuration file it cannot read, [`exit::STATE`] when this user
/// may not use the socket, [`exit::NOT_RUNNING`] when no node answers on
/// it.
pub fn status(args: StatusArgs) -> ExitCode {
    let state_dir = match args.state_dir() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(exit::CONFIG);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(exit::SERVE);
        }
    };
    let observed = runtime.block_on(crate::local::check(
        &state_dir,
        Duration::from_secs(args.timeout_secs.max(1)),
    ));
    match observed {
        Ok(o) => {
            let now = SystemTime::now();
            if args.json {
                println!("{}", json(o.serving, &o.status, now));
            } else {
                print!("{}", table(o.serving, &o.status, now));
            }
            ExitCode::SUCCESS
        }
        // Not "not running": this user cannot tell.
        Err(_) if let Some(why) = crate::local::refusal(&state_dir) => {
            eprintln!("error: {why}");
            ExitCode::from(exit::STATE)
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(exit::NOT_RUNNING)
        }
    }
}

fn at(unix_ms: i64) -> Option<SystemTime> {
    u64::try_from(unix_ms)
        .ok()
        .filter(|ms| *ms > 0)
        .map(|ms| UNIX_EPOCH + Duration::from_millis(ms))
}

/// Whole seconds from `now` to `t` (negative in the past; toward zero).
fn seconds_from(now: SystemTime, t: SystemTime) -> i64 {
    millis_from(now, t) / 1000
}

/// Milliseconds from `now` to `t` (negative in the past).
fn millis_from(now: SystemTime, t: SystemTime) -> i64 {
    match t.duration_since(now) {
        Ok(d) => i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_millis()).unwrap_or(i64::MAX),
    }
}

/// A duration for people, to the nearest unit, the unit chosen after
/// rounding: `45s`, `12m`, `3h`, `9d` (1,199 s is `20m`, 7,170 s `2h`,
/// 172,000 s `2d`).
fn human(secs: u64) -> String {
    let nearest = |unit: u64| secs.saturating_add(unit / 2) / unit;
    if secs < 120 {
        return format!("{secs}s");
    }
    if nearest(60) < 120 {
        return format!("{}m", nearest(60));
    }
    if nearest(3600) < 48 {
        return format!("{}h", nearest(3600));
    }
    format!("{}d", nearest(86_400))
}

/// [`human`] of milliseconds, to the nearest second first (89.9 s is
/// `90s`); a time under half a second but not none is `under 1s` (a
/// certificate 400 ms from its end does not "expire in 0s").
fn human_ms(ms: u64) -> String {
    if (1..500).contains(&ms) {
        return "under 1s".into();
    }
    human(ms.saturating_add(500) / 1000)
}

/// The JSON form: the status's own field names, ages and times in
/// milliseconds and seconds as named.
pub(crate) fn json(serving: bool, s: &pb::LocalStatus, now: SystemTime) -> serde_json::Value {
    let pb::LocalStatus {
        version,
        pid,
        incarnation,
        recovered,
        draining,
        leases,
        plane_contact_unix_ms,
        certificate_not_after_unix_ms,
        certificate_remaining_ms,
        certificate_renew_at_unix_ms,
        identity_expired,
        degraded_reasons,
        clock_offset_ms,
        slot_busy_ms,
        cache_filesystem,
        cache_clone,
        warm,
        outdated_images,
        unhealthy_tiers,
        // The other health fields are shown once they exist.
        ..
    } = s;
    serde_json::json!({
        "version": version,
        "pid": pid,
        "incarnation": incarnation,
        "serving": serving,
        "recovered": recovered,
        "draining": draining,
        "plane_contact_unix_ms": plane_contact_unix_ms,
        "plane_contact_age_secs": at(*plane_contact_unix_ms).map(|t| -seconds_from(now, t)),
        "certificate_not_after_unix_ms": certificate_not_after_unix_ms,
        "certificate_expires_in_secs": at(*certificate_not_after_unix_ms).map(|t| seconds_from(now, t)),
        "certificate_remaining_ms": certificate_remaining_ms,
        "certificate_renew_at_unix_ms": certificate_renew_at_unix_ms,
        "identity": identity(s, now),
        "identity_expired": identity_expired,
        "degraded_reasons": degraded_reasons.iter().map(|r| reason_name(*r)).collect::<Vec<_>>(),
        "clock_offset_ms": clock_offset_ms,
        "slot_busy_ms": slot_busy_ms,
        "cache_filesystem": cache_filesystem,
        "cache_clone": cache_clone,
        "warm": warm.as_ref().map(|w| serde_json::json!({
            "ready": w.ready,
            "starting": w.starting,
            "wanted": w.wanted,
        })),
        "outdated_images": outdated_images.iter().map(|o| serde_json::json!({
            "image": o.image,
            "id": o.id,
            "version": o.version,
            "minimum": o.minimum,
            "reason": o.reason,
        })).collect::<Vec<_>>(),
        "unhealthy_tiers": unhealthy_tiers.iter().map(|t| serde_json::json!({
            "tier": t.tier,
            "failures": t.failures,
            "last_error": t.last_error,
            "retry_in_ms": t.retry_in_ms,
        })).collect::<Vec<_>>(),
        "leases": leases.iter().map(|l| {
            let pb::LeaseStatus { lease_id, epoch, state, instance, runner_name, age_ms, custody } = l;
            serde_json::json!({
                "lease_id": lease_id,
                "epoch": epoch,
                "state": state,
                "instance": instance,
                "runner_name": runner_name,
                "age_ms": age_ms,
                "custody": custody,
            })
        }).collect::<Vec<_>>(),
    })
}

/// A degraded reason as `billet_degraded`'s label spells it
/// (`provider_stuck`, `slot_stuck`, ...).
fn reason_name(reason: i32) -> String {
    pb::DegradedReason::try_from(reason).map_or_else(
        |_| format!("reason_{reason}"),
        |r| {
            r.as_str_name()
                .trim_start_matches("DEGRADED_REASON_")
                .to_ascii_lowercase()
        },
    )
}

/// The degraded line: `no`, or the reasons.
fn degraded(s: &pb::LocalStatus) -> String {
    if s.degraded_reasons.is_empty() {
        return "no".into();
    }
    let reasons: Vec<String> = s.degraded_reasons.iter().map(|r| reason_name(*r)).collect();
    format!("yes: {} (taking no launches)", reasons.join(", "))
}

/// The slot line: idle, or how long its command has run.
fn slot(s: &pb::LocalStatus) -> String {
    match u64::try_from(s.slot_busy_ms) {
        Ok(ms) if ms > 0 => format!("busy for {}", human_ms(ms)),
        _ => "idle".into(),
    }
}

/// The cache line: the file system and how a sticky disk is mounted on
/// it, with a word on what a copy costs.
fn cache(s: &pb::LocalStatus) -> String {
    match s.cache_clone.as_str() {
        "" => "none".into(),
        "copy" => format!(
            "{}, copy (each mount copies its generation: O(bytes))",
            s.cache_filesystem
        ),
        clone => format!("{}, {clone}", s.cache_filesystem),
    }
}

/// The warm pool line: how many runners wait, start, and are wanted.
fn warm(s: &pb::LocalStatus) -> String {
    match &s.warm {
        None => "none".into(),
        Some(w) if w.wanted == 0 && w.ready == 0 && w.starting == 0 => "none wanted".into(),
        Some(w) => format!(
            "{} ready, {} starting, {} wanted",
            w.ready, w.starting, w.wanted
        ),
    }
}

/// The identity line: `expired` with what to do, or when the certificate
/// in force is renewed.
fn identity(s: &pb::LocalStatus, now: SystemTime) -> String {
    if s.identity_expired {
        return "identity expired: the plane cannot attach; re-enrol with a join token (billet node enroll)".into();
    }
    match at(s.certificate_renew_at_unix_ms) {
        Some(t) if millis_from(now, t) > 0 => {
            format!(
                "renewed by the plane in {}",
                human_ms(millis_from(now, t).unsigned_abs())
            )
        }
        Some(_) => "renewal due: asking the plane".into(),
        None => "renewal time unknown".into(),
    }
}

/// The table form: the node, then one row per lease.
pub(crate) fn table(serving: bool, s: &pb::LocalStatus, now: SystemTime) -> String {
    use std::fmt::Write;
    let yes = |b: bool| if b { "yes" } else { "no" };
    let mut out = String::new();
    let mut plane = at(s.plane_contact_unix_ms).map_or_else(
        || "never heard from".to_owned(),
        |t| match millis_from(now, t) {
            // A contact dated ahead of this clock (the clock stepped back
            // since): heard, and lately.
            ms if ms > 0 => "last heard just now".into(),
            ms => format!("last heard {} ago", human_ms(ms.unsigned_abs())),
        },
    );
    if s.clock_offset_ms.unsigned_abs() >= 1000 {
        let off = human_ms(s.clock_offset_ms.unsigned_abs());
        let side = if s.clock_offset_ms > 0 {
            "ahead of"
        } else {
            "behind"
        };
        let _ = write!(plane, "; this node's clock is {off} {side} the plane's");
    }
    let cert = at(s.certificate_not_after_unix_ms).map_or_else(
        || "unreadable".to_owned(),
        |t| match millis_from(now, t) {
            ms if ms >= 0 => format!("expires in {}", human_ms(ms.unsigned_abs())),
            ms => format!("EXPIRED {} ago", human_ms(ms.unsigned_abs())),
        },
    );
    let _ = writeln!(out, "version      {}", s.version);
    let _ = writeln!(out, "incarnation  {}", s.incarnation);
    let _ = writeln!(out, "pid          {}", s.pid);
    let _ = writeln!(out, "serving      {}", yes(serving));
    let _ = writeln!(out, "recovered    {}", yes(s.recovered));
    let _ = writeln!(out, "draining     {}", yes(s.draining));
    let _ = writeln!(out, "degraded     {}", degraded(s));
    let _ = writeln!(out, "slot         {}", slot(s));
    let _ = writeln!(out, "plane        {plane}");
    let _ = writeln!(out, "certificate  {cert}");
    let _ = writeln!(out, "identity     {}", identity(s, now));
    let _ = writeln!(out, "cache        {}", cache(s));
    let _ = writeln!(out, "warm         {}", warm(s));
    for o in &s.outdated_images {
        let _ = writeln!(out, "refused      {}", o.reason);
    }
    for t in &s.unhealthy_tiers {
        let again = if t.retry_in_ms == 0 {
            "launches let through again".to_owned()
        } else {
            format!("refused for {}", human_ms(t.retry_in_ms))
        };
        let _ = writeln!(
            out,
            "unhealthy    tier {}: {} start failures in a row, {again}; last: {}",
            t.tier, t.failures, t.last_error
        );
    }
    let _ = writeln!(out, "leases       {}", s.leases.len());
    if s.leases.is_empty() {
        return out;
    }
    let rows: Vec<[String; 7]> = s
        .leases
        .iter()
        .map(|l| {
            [
                l.lease_id.clone(),
                l.epoch.to_string(),
                l.state.clone(),
                yes(l.custody).to_owned(),
                l.instance.clone(),
                if l.runner_name.is_empty() {
                    "-".to_owned()
                } else {
                    l.runner_name.clone()
                },
                if l.age_ms == 0 {
                    "-".to_owned()
                } else {
                    human_ms(l.age_ms)
                },
            ]
        })
        .collect();
    let header = [
        "LEASE", "EPOCH", "STATE", "CUSTODY", "INSTANCE", "RUNNER", "AGE",
    ];
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let line = |cells: &[&str]| {
        cells
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_owned()
    };
    out.push('\n');
    let _ = writeln!(out, "{}", line(&header));
    for row in &rows {
        let cells: Vec<&str> = row.iter().map(String::as_str).collect();
        let _ = writeln!(out, "{}", line(&cells));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(
        clippy::needless_update,
        reason = "the health fields (6-10) join LocalStatus later"
    )]
    fn status() -> pb::LocalStatus {
        pb::LocalStatus {
            version: "1.2.3".into(),
            pid: 42,
            incarnation: "abc".into(),
            recovered: true,
            draining: false,
            leases: vec![pb::LeaseStatus {
                lease_id: "lease-1".into(),
                epoch: 3,
                state: "custody".into(),
                instance: "billet-lease-1".into(),
                runner_name: "billet-lease-1".into(),
                age_ms: 90_000,
                custody: true,
            }],
            plane_contact_unix_ms: 1_000_000_000_000 - 5_000,
            certificate_not_after_unix_ms: 1_000_000_000_000 + 10 * 86_400_000,
            ..Default::default()
        }
    }

    fn now() -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(1_000_000_000_000)
    }

    /// An expired identity says so, with what to do; a live one says
    /// when it is renewed.
    #[test]
    fn a_duration_is_shown_to_the_nearest_unit() {
        // Rounded, not cut: a clock 1,199.6 s behind is "20m", not "19m".
        assert_eq!(human(1199), "20m");
        assert_eq!(human(1169), "19m");
        assert_eq!(human(119), "119s");
        assert_eq!(human(5399), "90m");
        assert_eq!(human(9000), "3h");
        assert_eq!(human(8999), "2h");
        assert_eq!(human(216_000), "3d");
        // The unit is chosen after rounding.
        assert_eq!(human(7170), "2h", "not 120m");
        assert_eq!(human(172_000), "2d", "not 48h");
        assert_eq!(human(7140), "119m");
        assert_eq!(human_ms(89_900), "90s");
    }

    #[test]
    fn the_identity_line_says_expired_or_when_the_plane_renews_it() {
        let mut s = status();
        s.certificate_renew_at_unix_ms = 1_000_000_000_000 + 3_600_000;
        let text = table(true, &s, now());
        assert!(
            text.contains("identity     renewed by the plane in 60m"),
            "{text}"
        );
        s.identity_expired = true;
        let text = table(false, &s, now());
        assert!(text.contains("identity     identity expired"), "{text}");
        let j = json(false, &s, now());
        assert_eq!(j["identity_expired"], true);
        assert!(
            j["identity"]
                .as_str()
                .is_some_and(|t| t.starts_with("identity expired"))
        );
    }

    #[test]
    fn the_table_shows_the_node_and_one_row_per_lease() {
        let text = table(true, &status(), now());
        assert!(text.contains("plane        last heard 5s ago"), "{text}");
        assert!(text.contains("certificate  expires in 10d"), "{text}");
        assert!(text.contains("identity     renewal time unknown"), "{text}");
        let row = text
            .lines()
            .find(|l| l.starts_with("lease-1"))
            .expect("a row for the lease");
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(
            cells,
            [
                "lease-1",
                "3",
                "custody",
                "yes",
                "billet-lease-1",
                "billet-lease-1",
                "90s"
            ]
        );
    }

    /// The reasons a node is degraded, and how long the slot's command
    /// has run, are on the status.
    #[test]
    fn the_status_says_why_the_node_is_degraded_and_how_long_the_slot_is_busy() {
        let text = table(true, &status(), now());
        assert!(text.contains("degraded     no\n"), "{text}");
        assert!(text.contains("slot         idle\n"), "{text}");
        let s = pb::LocalStatus {
            degraded_reasons: vec![
                pb::DegradedReason::ProviderStuck as i32,
                pb::DegradedReason::SlotStuck as i32,
            ],
            slot_busy_ms: 42_000,
            ..status()
        };
        let text = table(false, &s, now());
        assert!(
            text.contains("degraded     yes: provider_stuck, slot_stuck"),
            "{text}"
        );
        assert!(text.contains("slot         busy for 42s"), "{text}");
        let j = json(false, &s, now());
        assert_eq!(
            j["degraded_reasons"],
            serde_json::json!(["provider_stuck", "slot_stuck"])
        );
        assert_eq!(j["slot_busy_ms"], 42_000);
    }

    /// The status says which file system the sticky disks are on and
    /// whether a mount reflinks or copies.
    #[test]
    fn the_status_says_how_the_cache_mounts_sticky_disks() {
        let text = table(true, &status(), now());
        assert!(text.contains("cache        none\n"), "{text}");
        let s = pb::LocalStatus {
            cache_filesystem: "ext4".into(),
            cache_clone: "copy".into(),
            ..status()
        };
        let text = table(true, &s, now());
        assert!(
            text.contains("cache        ext4, copy (each mount copies its generation: O(bytes))"),
            "{text}"
        );
        let s = pb::LocalStatus {
            cache_filesystem: "xfs".into(),
            cache_clone: "reflink".into(),
            ..status()
        };
        assert!(table(true, &s, now()).contains("cache        xfs, reflink\n"));
        let j = json(true, &s, now());
        assert_eq!(
            (j["cache_filesystem"].as_str(), j["cache_clone"].as_str()),
            (Some("xfs"), Some("reflink"))
        );
    }

    #[test]
    fn the_json_names_every_field_and_computes_ages() {
        let v = json(true, &status(), now());
        assert_eq!(v["plane_contact_age_secs"], 5);
        assert_eq!(v["certificate_expires_in_secs"], 10 * 86_400);
        assert_eq!(v["leases"][0]["state"], "custody");
        assert_eq!(v["leases"][0]["custody"], true);
        let never = json(
            true,
            &pb::LocalStatus {
                plane_contact_unix_ms: 0,
                ..status()
            },
            now(),
        );
        assert!(never["plane_contact_age_secs"].is_null());
    }

    #[test]
    fn the_status_says_how_far_this_nodes_clock_is_from_the_planes() {
        let behind = pb::LocalStatus {
            clock_offset_ms: -120_000,
            ..status()
        };
        assert_eq!(json(true, &behind, now())["clock_offset_ms"], -120_000);
        let text = table(true, &behind, now());
        assert!(
            text.contains("last heard 5s ago; this node's clock is 2m behind the plane's"),
            "{text}"
        );
        let in_sync = table(true, &status(), now());
        assert!(!in_sync.contains("clock"), "{in_sync}");
        // Rounded, not cut: 1,199.6 s behind is "20m behind", not "19m".
        let twenty = pb::LocalStatus {
            clock_offset_ms: -1_199_600,
            ..status()
        };
        let text = table(true, &twenty, now());
        assert!(text.contains("clock is 20m behind"), "{text}");
        // Ages round too, and a certificate expired 400 ms ago is expired,
        // not "expires in 0s".
        let now_ms = i64::try_from(
            now()
                .duration_since(UNIX_EPOCH)
                .expect("after the epoch")
                .as_millis(),
        )
        .expect("in range");
        let text = table(
            true,
            &pb::LocalStatus {
                plane_contact_unix_ms: now_ms - 89_900,
                certificate_not_after_unix_ms: now_ms - 400,
                clock_offset_ms: 172_000_000,
                ..status()
            },
            now(),
        );
        assert!(text.contains("last heard 90s ago"), "{text}");
        assert!(text.contains("EXPIRED under 1s ago"), "{text}");
        assert!(text.contains("clock is 2d ahead of"), "{text}");
        // Under a second is not "0s", and a contact dated ahead of this
        // clock is not "5s ago".
        let text = table(
            true,
            &pb::LocalStatus {
                plane_contact_unix_ms: now_ms + 5_000,
                certificate_not_after_unix_ms: now_ms + 400,
                ..status()
            },
            now(),
        );
        assert!(text.contains("last heard just now"), "{text}");
        assert!(text.contains("expires in under 1s"), "{text}");
    }
}
