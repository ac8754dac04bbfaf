//! Every job's story as an operator reads it: why the plane could not give
//! a job a runner ([`WaitKind`], the closed set its placement decision
//! names), and the text `billet-plane jobs` prints from the ledger's
//! [`JobRecord`]s: a table of recent jobs ([`table`]), the same as JSON
//! ([`json`]), and one job from first to last line ([`story`]).
//!
//! Times are the ledger's unix milliseconds, printed in UTC; offsets count
//! from when GitHub queued the job (GitHub's clock, so a first offset may be
//! a little off the plane's).

use billet_proto::ending::ReasonCode;
use std::fmt::Write as _;

use serde::Serialize;

use crate::ledger::{JobAttempt, JobRecord};

/// Why a job has no runner yet, as the plane's placement decision says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum WaitKind {
    /// No node is attached.
    NoNode,
    /// No attached node has room for the tier's runner.
    NoCapacity,
    /// Every node with room says it is degraded.
    NodeDegraded,
    /// The tier is held: its image carries a runner GitHub refuses.
    TierHeld,
    /// The node refused the launch: it does not have the tier's image.
    ImageMissing,
    /// A launch did not end with a runner; the next one waits.
    BackingOff,
    /// GitHub says the scale set does not exist.
    ScaleSetMissing,
    /// The scale set has as many runners as it may.
    AtMaximum,
    /// A lease was placed; its runner is starting.
    RunnerStarting,
    /// A lease took over a warm runner; the job waits for it to be taken.
    WarmRunner,
}

impl WaitKind {
    /// Every kind, for gauges that show each.
    pub(crate) const ALL: [WaitKind; 10] = [
        WaitKind::NoNode,
        WaitKind::NoCapacity,
        WaitKind::NodeDegraded,
        WaitKind::TierHeld,
        WaitKind::ImageMissing,
        WaitKind::BackingOff,
        WaitKind::ScaleSetMissing,
        WaitKind::AtMaximum,
        WaitKind::RunnerStarting,
        WaitKind::WarmRunner,
    ];

    /// The kind as stored and as a metric label.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            WaitKind::NoNode => "no_node",
            WaitKind::NoCapacity => "no_capacity",
            WaitKind::NodeDegraded => "node_degraded",
            WaitKind::TierHeld => "tier_held",
            WaitKind::ImageMissing => "image_missing",
            WaitKind::BackingOff => "backing_off",
            WaitKind::ScaleSetMissing => "scale_set_missing",
            WaitKind::AtMaximum => "at_maximum",
            WaitKind::RunnerStarting => "runner_starting",
            WaitKind::WarmRunner => "warm_runner",
        }
    }

    /// The kind [`WaitKind::as_str`] spells.
    pub(crate) fn parse(text: &str) -> Option<WaitKind> {
        WaitKind::ALL.into_iter().find(|k| k.as_str() == text)
    }

    /// The kind in words.
    pub(crate) fn words(self) -> &'static str {
        match self {
            WaitKind::NoNode => "no node attached",
            WaitKind::NoCapacity => "no capacity",
            WaitKind::NodeDegraded => "node degraded",
            WaitKind::TierHeld => "tier held",
            WaitKind::ImageMissing => "image missing",
            WaitKind::BackingOff => "backing off",
            WaitKind::ScaleSetMissing => "scale set missing",
            WaitKind::AtMaximum => "scale set at its maximum",
            WaitKind::RunnerStarting => "runner starting",
            WaitKind::WarmRunner => "warm runner taking it",
        }
    }

    /// Whether the job has a lease placed for it: every other kind means
    /// it cannot be placed anywhere now.
    pub(crate) fn placed(self) -> bool {
        matches!(self, WaitKind::RunnerStarting | WaitKind::WarmRunner)
    }
}

/// The typed reason an attempt ended with, read from the lease's phase and
/// its recorded reason ([`ReasonCode::parse_legacy`] reads the text every
/// release writes, typed or older); `None` while it has not ended.
fn end_code(phase: Option<&str>, reason: Option<&str>) -> Option<ReasonCode> {
    match (phase, reason.map(str::trim).filter(|r| !r.is_empty())) {
        (_, Some(text)) => Some(ReasonCode::parse_legacy(text).0),
        (Some("done"), None) => Some(ReasonCode::Completed),
        (Some("failed"), None) => Some(ReasonCode::Unrecorded),
        _ => None,
    }
}

/// The class of an attempt's end (`job`, `runner`, `infra`, `operator`,
/// or `unknown` for an end recorded before reasons had codes); `ongoing`
/// while it has not ended.
pub(crate) fn attempt_class(phase: Option<&str>, reason: Option<&str>) -> &'static str {
    end_code(phase, reason).map_or("ongoing", |code| code.class().as_str())
}

/// The reason an attempt's end is counted under: its code from the closed
/// set ([`ReasonCode::as_str`]); `ongoing` while it has not ended.
pub(crate) fn end_reason_label(phase: Option<&str>, reason: Option<&str>) -> &'static str {
    end_code(phase, reason).map_or("ongoing", ReasonCode::as_str)
}

/// Where a job is, in words: `completed: <result>`, `running`,
/// `stuck: <reason>`, `waiting: <reason>`, or `queued`.
pub(crate) fn state(job: &JobRecord) -> String {
    if job.completed_at_ms.is_some() {
        return format!("completed: {}", job.result.as_deref().unwrap_or("?"));
    }
    if job.started_at_ms.is_some() {
        return "running".to_owned();
    }
    let open = job.waits.iter().rev().find(|w| w.until_ms.is_none());
    if let (Some(at), Some(reason)) = (job.stuck_at_ms, &job.stuck_reason) {
        // Stuck until a node answers a launch for it again.
        let placed_since = job
            .attempts
            .iter()
            .any(|a| a.launched_at_ms.is_some_and(|l| l > at));
        let waiting_placed = open
            .and_then(|w| WaitKind::parse(&w.reason))
            .is_some_and(WaitKind::placed);
        if !placed_since && !waiting_placed {
            return format!("stuck: {}", reason_words(reason));
        }
    }
    match open {
        Some(w) => format!("waiting: {}", reason_words(&w.reason)),
        None => "queued".to_owned(),
    }
}

fn reason_words(reason: &str) -> &str {
    // A kind this build does not know reads as stored.
    match WaitKind::parse(reason) {
        Some(kind) => kind.words(),
        None => reason,
    }
}

/// When the job's clock starts: queued, else first seen.
fn origin(job: &JobRecord) -> i64 {
    job.queued_at_ms.unwrap_or(job.first_seen_at_ms)
}

/// How long the job waited for a runner: from queued to started, or to
/// `now_ms` while it waits; `None` when it ended without starting.
pub(crate) fn waited_ms(job: &JobRecord, now_ms: i64) -> Option<i64> {
    match (job.started_at_ms, job.completed_at_ms) {
        (Some(started), _) => Some(started - origin(job)),
        (None, Some(_)) => None,
        (None, None) => Some(now_ms - origin(job)),
    }
}

/// A length in milliseconds as `850ms`, `7.2s`, `3m05s` or `2h03m`.
pub(crate) fn length(ms: i64) -> String {
    let ms = ms.max(0);
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms < 60_000 {
        format!("{}.{}s", ms / 1000, (ms % 1000) / 100)
    } else if ms < 3_600_000 {
        format!("{}m{:02}s", ms / 60_000, (ms % 60_000) / 1000)
    } else {
        format!("{}h{:02}m", ms / 3_600_000, (ms % 3_600_000) / 60_000)
    }
}

/// Unix milliseconds as `2026-12-06 05:00:01.123` (UTC).
fn at(ms: i64) -> String {
    match jiff::Timestamp::from_millisecond(ms) {
        Ok(t) => {
            let text = format!("{t:.3}");
            text.trim_end_matches('Z').replacen('T', " ", 1)
        }
        Err(_) => ms.to_string(),
    }
}

/// The last thing said of why the job has no runner, or why its last
/// attempt ended.
fn last_reason(job: &JobRecord) -> String {
    let attempt = job.attempts.last();
    let wait = job.waits.last();
    let attempt_at = attempt.map(|a| a.ended_at_ms.unwrap_or(a.placed_at_ms));
    match (attempt, wait) {
        (Some(_), Some(w)) if Some(w.since_ms) > attempt_at => wait_text(w),
        (Some(a), _) => match (&a.end_reason, &a.phase) {
            (Some(reason), _) => reason.clone(),
            (None, Some(phase)) => phase.clone(),
            (None, None) => String::new(),
        },
        (None, Some(w)) => wait_text(w),
        (None, None) => String::new(),
    }
}

fn wait_text(w: &crate::ledger::JobWait) -> String {
    if w.detail.is_empty() {
        reason_words(&w.reason).to_owned()
    } else {
        format!("{}: {}", reason_words(&w.reason), w.detail)
    }
}

/// The table `billet-plane jobs` prints: one line per job, the latest
/// first, as `jobs` is ordered.
pub fn table(jobs: &[JobRecord], now_ms: i64) -> String {
    let mut rows = vec![[
        "JOB".to_owned(),
        "REPOSITORY".to_owned(),
        "STATE".to_owned(),
        "QUEUED".to_owned(),
        "WAITED".to_owned(),
        "ATTEMPTS".to_owned(),
        "LAST REASON".to_owned(),
    ]];
    for job in jobs {
        rows.push([
            job.request_id.to_string(),
            job.repository.clone().unwrap_or_else(|| "-".to_owned()),
            state(job),
            at(origin(job)),
            waited_ms(job, now_ms).map_or_else(|| "-".to_owned(), length),
            job.attempts.len().to_string(),
            last_reason(job),
        ]);
    }
    let mut widths = [0usize; 7];
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in &rows {
        let mut line = String::new();
        for (i, (cell, w)) in row.iter().zip(widths).enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<w$}  ");
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// One job as JSON: the record and what the table derives from it.
#[derive(Debug, Serialize)]
struct JsonJob<'a> {
    #[serde(flatten)]
    record: &'a JobRecord,
    state: String,
    waited_ms: Option<i64>,
    attempt_classes: Vec<&'static str>,
}

/// `jobs` as a JSON array, each record with its `state`, `waited_ms` and
/// each attempt's class.
pub fn json(jobs: &[JobRecord], now_ms: i64) -> String {
    let rows: Vec<JsonJob<'_>> = jobs
        .iter()
        .map(|job| JsonJob {
            record: job,
            state: state(job),
            waited_ms: waited_ms(job, now_ms),
            attempt_classes: job
                .attempts
                .iter()
                .map(|a| attempt_class(a.phase.as_deref(), a.end_reason.as_deref()))
                .collect(),
        })
        .collect();
    serde_json::to_string_pretty(&rows).unwrap_or_else(|_| "[]".to_owned())
}

fn attempt_end(a: &JobAttempt) -> String {
    let phase = a.phase.as_deref().unwrap_or("unknown");
    let class = attempt_class(a.phase.as_deref(), a.end_reason.as_deref());
    match &a.end_reason {
        Some(reason) => format!(
            "attempt {}: lease {} ended {phase} ({class}): {reason}",
            a.attempt, a.lease
        ),
        None => format!(
            "attempt {}: lease {} ended {phase} ({class})",
            a.attempt, a.lease
        ),
    }
}

/// One job from first to last line: each event with its time and its
/// offset from queued, each attempt and its end, each wait with its reason
/// and length (so far, while it lasts, at `now_ms`).
pub fn story(job: &JobRecord, now_ms: i64) -> String {
    let mut events: Vec<(i64, u8, String)> = Vec::new();
    let mut push = |t: Option<i64>, order: u8, text: String| {
        if let Some(t) = t {
            events.push((t, order, text));
        }
    };
    push(job.queued_at_ms, 0, "queued at GitHub".to_owned());
    push(
        job.acquired_at_ms,
        1,
        "acquired by the plane's listener".to_owned(),
    );
    push(
        job.assigned_at_ms,
        2,
        format!("assigned to scale set {}", job.tier),
    );
    for w in &job.waits {
        let detail = if w.detail.is_empty() {
            String::new()
        } else {
            format!(" ({})", w.detail)
        };
        let text = match w.until_ms {
            Some(until) => format!(
                "waited {} for: {}{detail}",
                length(until - w.since_ms),
                reason_words(&w.reason)
            ),
            None => format!(
                "waiting, {} so far, for: {}{detail}",
                length(now_ms - w.since_ms),
                reason_words(&w.reason)
            ),
        };
        push(Some(w.since_ms), 6, text);
    }
    if let (Some(t), Some(reason)) = (job.stuck_at_ms, &job.stuck_reason) {
        push(
            Some(t),
            7,
            format!(
                "stuck: {} (no lease could be placed for longer than the bound)",
                reason_words(reason)
            ),
        );
    }
    for a in &job.attempts {
        let warm = a
            .warm_runner
            .as_ref()
            .map(|w| format!(", taking over warm runner {w}"))
            .unwrap_or_default();
        push(
            Some(a.placed_at_ms),
            4,
            format!(
                "attempt {}: lease {} placed on node {}{warm}",
                a.attempt, a.lease, a.node
            ),
        );
        push(
            a.launched_at_ms,
            5,
            format!("attempt {}: launched (the node answered OK)", a.attempt),
        );
        push(a.ended_at_ms, 3, attempt_end(a));
    }
    push(
        job.started_at_ms,
        8,
        format!(
            "started: runner {} took the job (online)",
            job.runner_name.as_deref().unwrap_or("?")
        ),
    );
    push(
        job.completed_at_ms,
        9,
        format!(
            "completed: {}",
            job.result.as_deref().unwrap_or("no result given")
        ),
    );
    push(
        job.runner_gone_at_ms,
        10,
        "compute proven gone (the runner's lease ended)".to_owned(),
    );
    events.sort_by_key(|(t, order, _)| (*t, *order));
    let origin = origin(job);
    let mut out = String::new();
    let _ = write!(out, "job {}", job.request_id);
    let mut about = Vec::new();
    if let Some(r) = &job.repository {
        about.push(r.clone());
    }
    if let Some(run) = job.run_id {
        about.push(format!("run {run}"));
    }
    if let Some(w) = &job.workflow {
        about.push(format!("workflow {w}"));
    }
    if let Some(id) = &job.github_job_id {
        about.push(format!("GitHub job {id}"));
    }
    if !about.is_empty() {
        let _ = write!(out, " ({})", about.join(", "));
    }
    let _ = writeln!(out, ": {}", state(job));
    for (t, _, text) in events {
        let offset = t - origin;
        let sign = if offset < 0 { "-" } else { "+" };
        let _ = writeln!(
            out,
            "  {}  {sign}{:>7}  {text}",
            at(t),
            length(offset.abs())
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_wait_kind_reads_back_from_its_name() {
        for kind in WaitKind::ALL {
            assert_eq!(WaitKind::parse(kind.as_str()), Some(kind));
        }
        assert_eq!(WaitKind::parse("later"), None);
    }

    #[test]
    fn an_end_reason_is_counted_under_its_code_and_class() {
        assert_eq!(end_reason_label(Some("done"), None), "completed");
        assert_eq!(attempt_class(Some("done"), None), "job");
        assert_eq!(
            end_reason_label(Some("failed"), Some("launch: refused")),
            "launch_failed"
        );
        assert_eq!(
            end_reason_label(Some("failed"), Some("exit 1")),
            "runner_exit"
        );
        assert_eq!(
            end_reason_label(Some("failed"), Some("ec2 spot interruption: terminate")),
            "spot_interruption"
        );
        assert_eq!(
            attempt_class(Some("failed"), Some("ec2 spot interruption: terminate")),
            "infra"
        );
        assert_eq!(end_reason_label(Some("failed"), None), "unrecorded");
        assert_eq!(attempt_class(Some("launching"), None), "ongoing");
    }

    #[test]
    fn lengths_read_at_a_glance() {
        assert_eq!(length(850), "850ms");
        assert_eq!(length(7_250), "7.2s");
        assert_eq!(length(185_000), "3m05s");
        assert_eq!(length(7_380_000), "2h03m");
    }
}
