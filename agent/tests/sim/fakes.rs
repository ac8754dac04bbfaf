//! The simulated world outside the node: the plane's ledger, GitHub's runner
//! registrations, the ground truth about jobs, and the faults the seed
//! injects. One mutex guards all of it and is never held across an await.
//!
//! [`FakeLedger`] is the node's view of this world through the three seams
//! the node calls ([`LeaseStore`] and [`JitSource`] from the runner,
//! [`WarmRooms`] from the warm pool); every call it answers can be made
//! slow, refused (`Unavailable`, nothing done), or have its reply lost
//! (done, then `Unavailable`). The plane's own writes (reserve, renew,
//! release, reap, reconcile, operator force release) are methods on [`Core`]
//! and never fail.
//!
//! The ledger charges the node's room as the stub's does: every open lease
//! ([`LEASE_VCPU`], [`LEASE_MEMORY`]) and every warm runner's row, within
//! [`CAPACITY`]; a reservation that does not fit is refused, and a lease
//! takes over the room of the oldest warm runner charged when the plane
//! reserves it so.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use billet_agent::cache::Observation;
use billet_agent::model::Registration;
use billet_agent::model::{
    ByteSize, Epoch, InstanceName, JitConfig, Lease, LeaseId, Phase, RequestId,
};
use billet_agent::node::ending::{Ending, FailureReason};
use billet_agent::node::plane::{JitSource, LaunchedSet, LeaseStore, PlaneError, Retired};
use billet_agent::node::warm::WarmRooms;
use billet_agent::provider::Instance;
use billet_agent::provider::fake::FakeProvider;
use tokio::sync::Notify;
use tokio::time::Instant;

/// The world runs at a tenth of the reference's timings: `secs(90)` is 9 s
/// of (paused) tokio time. KeepAlive wakes every 500 ms whatever the TTL, so
/// a shorter clock means fewer wakes per seed and a cheaper seed; every
/// ratio that matters (renewal at TTL/3, the reaper's period, the graces,
/// slowness and outages against the TTL) is kept.
pub const fn secs(reference_seconds: u64) -> Duration {
    Duration::from_millis(reference_seconds * 100)
}

/// The lease TTL the plane dictates (90 s in the reference).
pub const TTL: Duration = secs(90);
/// How long a quarantined lease must be expired and absent from the node's
/// inventory before reconcile frees it (5 min in the reference).
pub const QUARANTINE_GRACE: Duration = secs(300);
/// How long the runner waits before the absence of an instance it never saw
/// counts as proof (`strayGrace`, 5 min in the reference).
pub const STRAY_GRACE: Duration = secs(300);
/// The longest the plane's background task sleeps between renewing and
/// reaping (it wakes earlier when a renewal or an expiry is due).
pub const PLANE_TICK: Duration = secs(30);

/// How long after an early completion a runner still working may be left
/// to exit on its own before the node may stop it (a post-job
/// grace, 2 min by default).
pub const POST_JOB_GRACE: Duration = secs(120);

/// What every lease charges (its tier's size).
pub const LEASE_VCPU: u32 = 2;
/// What every lease charges (its tier's size).
pub const LEASE_MEMORY: ByteSize = ByteSize(1 << 30);
/// The node's room in the simulation: eight leases' worth of CPU, and of
/// memory.
pub const CAPACITY: (u64, u64) = (16, 8 << 30);

/// Whether `name` is a warm runner's (`billet_warm-<hex>`), not a lease's.
pub fn is_warm(name: &str) -> bool {
    InstanceName::warm(name).is_some()
}

/// Whether an instance may still run, read the way the Docker provider
/// reports it: an exited container is present and not running.
pub fn may_run(instance: &Instance) -> bool {
    instance.may_run()
}

/// A node-facing ledger or JIT operation, for fault injection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LOp {
    Bind,
    Advance,
    Heartbeat,
    Release,
    MarkFailure,
    CacheObservation,
    ActionsPolicy,
    Lease,
    Launched,
    Reconcile,
    Mint,
    RemoveRunner,
    ReserveWarm,
    ReleaseWarm,
    ConfirmWarm,
}

/// What an injected ledger fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Answer `Unavailable` without doing anything.
    Refuse,
    /// Do it, then answer `Unavailable` (the reply was lost).
    LoseReply,
}

/// A provider operation that can be told to misbehave for one instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum POp {
    Create,
    Destroy,
    Find,
}

/// What an injected provider fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PFault {
    /// An engine error before anything happens.
    Fail,
    /// Create starts the instance, then errs.
    FailAfterStart,
    /// Destroy answers `Requested` and leaves the instance running until the
    /// backend gets round to it (a later step, or quiescence).
    Requested,
    /// Destroy removes the instance but answers `Requested`.
    RequestedGone,
}

/// A violation planted on purpose, to prove an invariant's check can fail
/// (`sim.rs`, one test per invariant). `None` in every real run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sabotage {
    /// Destroy answers `Stopped` for an exited instance and keeps it.
    DestroyKeepsExited,
    /// GitHub answers a registration removal OK and keeps the registration.
    RemovalKeepsRegistration,
    /// Destroy answers `Stopped` for a running instance and keeps it running.
    DestroyKeepsRunning,
    /// Something kills a busy runner's instance through the provider.
    KillBusyRunner,
    /// Every create is handed the first JIT config ever used.
    ReuseJitConfig,
    /// The node's mint reaches the plane twice.
    MintTwice,
    /// The plane's background task panics at its first tick.
    PanicInPlaneTask,
    /// A task nobody joins panics.
    PanicInDetachedTask,
    /// A lease whose runner exited 0 is recorded `failed`, reason `oom`.
    FailCleanExit,
    /// Every warm runner is started holding a registration's config, as a
    /// provider that bakes it into the container would.
    WarmStartsRegistered,
    /// The ledger answers a warm runner's reservation OK and charges
    /// nothing.
    WarmReserveChargesNothing,
    /// A claimed warm runner is handed its config twice.
    ClaimHandsConfigTwice,
}

/// One lease row of the ledger.
#[derive(Debug, Clone)]
pub struct Row {
    pub id: LeaseId,
    pub epoch: u64,
    pub phase: Phase,
    pub bound: bool,
    pub request: RequestId,
    pub expires: Instant,
    pub force_release: bool,
    /// The registration minted for it: (runner id, runner name).
    pub runner: Option<(i64, String)>,
    /// Who ended it, for diagnosis.
    pub ended_by: Option<&'static str>,
    /// Why its job will fail, as the node marked it (the first reason).
    pub failure_reason: Option<String>,
}

/// A GitHub runner registration.
#[derive(Debug, Clone)]
pub struct Reg {
    pub id: i64,
    pub lease: LeaseId,
    pub config: String,
    /// An instance started with its config.
    pub connected: bool,
    /// GitHub's own record that a job runs on this runner: while set, a
    /// removal is refused (`JobStillRunning`), whoever asks.
    pub job: bool,
    /// The busy flag GitHub's runner listing shows. It lags behind `job`:
    /// set only when GitHub catches up (`Core::busy_catches_up`), so a
    /// runner that has just taken a job still lists as idle.
    pub busy: bool,
}

/// What an instance is doing, as GitHub would know it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Job {
    /// Started by a create that failed: it runs no job.
    Stray,
    /// Connected and waiting for its job (no job assigned yet).
    Idle,
    /// Running its job.
    Live,
    /// GitHub reported the job completed while the runner still works
    /// (an early completion); it exits on its own later.
    Finishing,
    /// Its job completed; the runner exited.
    Completed,
    /// It died before its job completed (GitHub fails the job).
    Dead,
}

/// The plane's view of a lease it reserved.
#[derive(Debug, Clone)]
pub struct PlaneLease {
    pub request: RequestId,
    /// The epoch the plane reserved it at.
    pub epoch: Epoch,
    /// The plane renews it (it is not held by the node).
    pub managed: bool,
    pub last_renew: Instant,
    /// The warm runner whose room the lease took over at its reservation:
    /// its launch names it.
    pub warm: Option<InstanceName>,
}

/// A warm runner's row in the ledger: its room.
#[derive(Debug, Clone)]
pub struct WarmRoom {
    pub tier: String,
    pub vcpu: u32,
    pub memory: ByteSize,
}

/// Warm runners, as the ledger, the engine and GitHub know them.
#[derive(Debug, Default)]
pub struct Warm {
    /// The ledger's warm rooms, by warm runner name.
    pub rooms: BTreeMap<String, WarmRoom>,
    /// Warm runners whose room a lease took over when the plane reserved
    /// it: their room is that lease's while it is open.
    pub taken: BTreeMap<String, LeaseId>,
    /// The JIT configs handed to each container, by the engine's id, which
    /// a claim keeps through its rename: a warm runner's runner holds a
    /// registration from the moment it is handed one.
    pub handed: BTreeMap<String, Vec<String>>,
    /// How many times a launch asked the provider to claim each warm
    /// runner.
    pub claims: BTreeMap<String, u32>,
    /// Warm runners whose room was handed back while they still ran and
    /// that no claim named since: room the ledger lends out again while
    /// the container still takes it.
    pub released_running: BTreeSet<String>,
    /// Claimed containers whose runner was never handed its config (the
    /// start was withheld): it waits on its handoff and never exits on its
    /// own, so only the node removes it.
    pub waiting: BTreeSet<String>,
    /// The names the pool has given so far (the next one is this plus
    /// one): a counter, so names sort in the order they were given.
    pub named: u64,
}

/// Armed faults and degraded modes.
#[derive(Debug, Default)]
pub struct Faults {
    pub ledger_down: bool,
    pub slow_ledger: Option<Duration>,
    pub slow_provider: Option<Duration>,
    pub plane_stalled: bool,
    pub lease: BTreeMap<(LeaseId, LOp), VecDeque<Fault>>,
    pub global: BTreeMap<LOp, VecDeque<Fault>>,
    pub instance: BTreeMap<(String, POp), VecDeque<PFault>>,
    pub list: u32,
    /// Every call of the tend under way takes this long.
    pub inside_tend: Option<Duration>,
    /// GitHub accepts the removal of a runner at work (its busy flag lags
    /// behind the job): the registration goes, the job runs on.
    pub removal_ignores_job: bool,
    /// How many warm runners' creates fail next.
    pub warm_create: u32,
    /// How many listings of the warm runners fail next.
    pub warm_list: u32,
}

/// A crash armed to happen at the `countdown`-th node-side call.
#[derive(Debug, Clone, Copy)]
pub struct Crash {
    pub countdown: u32,
    /// Crash after the call took effect, before its answer is seen.
    pub after_effect: bool,
}

/// Whether a node-side call proceeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    Go,
    CrashBefore,
    CrashAfter,
}

/// Everything outside the node.
#[derive(Debug)]
pub struct Core {
    pub fake: Arc<FakeProvider>,
    pub leases: BTreeMap<LeaseId, Row>,
    /// The leases not yet done or failed (what the reaper and the plane's
    /// renewals look at).
    pub open: BTreeSet<LeaseId>,
    /// An instance was created since the last full check.
    pub created_since_check: bool,
    /// A create was called (and handed a JIT config) since the last check.
    pub create_called: bool,
    /// GitHub's registrations, by runner name.
    pub regs: BTreeMap<String, Reg>,
    /// The JIT configs handed to creates that may have started their
    /// instance (a create whose start was withheld ran no runner, so its
    /// config was never consumed), in order: invariant (5) reads it.
    pub configs_run: Vec<String>,
    /// Leases whose registration the plane minted before dispatching the
    /// launch: the plane's registration pass removes such a registration
    /// once its lease has ended, as the stub's does.
    pub minted_ahead: BTreeSet<LeaseId>,
    pub mints: BTreeMap<LeaseId, u32>,
    pub mint_attempts: BTreeMap<LeaseId, u32>,
    pub next_runner_id: i64,
    pub next_lease: u64,
    /// Ground truth per instance name.
    pub jobs: BTreeMap<String, Job>,
    /// When GitHub sent the early completion of a runner still finishing.
    pub finishing: BTreeMap<String, Instant>,
    /// Leases an operator force-released (authority to destroy their compute).
    pub authority: BTreeSet<LeaseId>,
    /// Instances whose removal a remote backend accepted but has not done.
    pub pending_removal: BTreeSet<String>,
    /// Completions GitHub reported that the plane has not settled, kept
    /// sorted (a tend may end several jobs, in the runner's order).
    pub completions: BTreeSet<(LeaseId, &'static str)>,
    pub plane: BTreeMap<LeaseId, PlaneLease>,
    pub faults: Faults,
    pub crash: Option<Crash>,
    pub crashed: bool,
    pub violations: Vec<String>,
    /// Runners (by instance name) whose container exited 0: they ended
    /// with their job, whatever the engine's OOM flag says (invariant 6).
    pub clean_exits: BTreeSet<String>,
    /// Ledger and GitHub events since the world last drained them.
    pub events: Vec<String>,
    pub verbose: bool,
    /// Counts of what happened, for the coverage report.
    pub tally: BTreeMap<&'static str, u64>,
    /// A violation planted to test a check.
    pub sabotage: Option<Sabotage>,
    /// What the cache did for each lease's job, the first recorded kept,
    /// as the stub's ledger keeps it.
    pub cache_observations: BTreeMap<LeaseId, Observation>,
    /// `owner` or `owner/repository` names the kill switch blocks from the
    /// node-local Actions cache, as the stub's ledger keeps them.
    pub cache_blocks: std::collections::BTreeSet<String>,
    /// Warm runners' rooms, and what the world knows of the runners.
    pub warm: Warm,
    /// The node's room, as (vCPUs, memory bytes).
    pub capacity: (u64, u64),
    /// Whether a destroy fault may land on a claimed runner never handed
    /// its config (`Warm::waiting`): a known bug's injection.
    pub withheld_claim_faults: bool,
}

fn name_of(lease: &LeaseId) -> String {
    InstanceName::for_lease(lease).as_str().to_owned()
}

fn unavailable(why: &str) -> PlaneError {
    PlaneError::Unavailable(why.to_owned())
}

impl Core {
    pub fn new(fake: Arc<FakeProvider>, verbose: bool) -> Self {
        Self {
            fake,
            leases: BTreeMap::new(),
            open: BTreeSet::new(),
            created_since_check: false,
            create_called: false,
            regs: BTreeMap::new(),
            configs_run: Vec::new(),
            minted_ahead: BTreeSet::new(),
            mints: BTreeMap::new(),
            mint_attempts: BTreeMap::new(),
            next_runner_id: 1000,
            next_lease: 1,
            jobs: BTreeMap::new(),
            finishing: BTreeMap::new(),
            authority: BTreeSet::new(),
            pending_removal: BTreeSet::new(),
            completions: BTreeSet::new(),
            plane: BTreeMap::new(),
            faults: Faults::default(),
            crash: None,
            crashed: false,
            violations: Vec::new(),
            clean_exits: BTreeSet::new(),
            events: Vec::new(),
            verbose,
            tally: BTreeMap::new(),
            sabotage: None,
            cache_observations: BTreeMap::new(),
            cache_blocks: std::collections::BTreeSet::new(),
            warm: Warm::default(),
            capacity: CAPACITY,
            withheld_claim_faults: false,
        }
    }

    fn event(&mut self, text: impl FnOnce() -> String) {
        if self.verbose {
            self.events.push(text());
        }
    }

    pub fn tally(&mut self, what: &'static str) {
        *self.tally.entry(what).or_default() += 1;
    }

    pub fn violate(&mut self, text: String) {
        self.violations.push(text);
    }

    /// The id the next reservation will get.
    pub fn peek_lease(&self) -> LeaseId {
        LeaseId::parse("sim", &format!("l{}", self.next_lease)).expect("a valid id")
    }

    // ----- the ledger, as the node calls it (after fault handling) -----

    fn open(&self, id: &LeaseId, epoch: Epoch) -> Result<&Row, PlaneError> {
        let row = self
            .leases
            .get(id)
            .ok_or_else(|| PlaneError::NotFound(format!("lease {id} is not in the ledger")))?;
        if row.epoch != epoch.0 {
            return Err(PlaneError::Fenced(format!(
                "lease {id} is at epoch {}, not {epoch}",
                row.epoch
            )));
        }
        if row.phase.is_terminal() {
            return Err(PlaneError::NotFound(format!("lease {id} ended")));
        }
        Ok(row)
    }

    fn owned(&self, id: &LeaseId) -> Result<&Row, PlaneError> {
        let row = self
            .leases
            .get(id)
            .ok_or_else(|| PlaneError::NotFound(format!("lease {id} is not in the ledger")))?;
        if !row.bound {
            return Err(PlaneError::WrongNode(format!(
                "lease {id} is not bound to this node"
            )));
        }
        Ok(row)
    }

    fn row(&mut self, id: &LeaseId) -> &mut Row {
        self.leases.get_mut(id).expect("checked above")
    }

    pub fn bind(&mut self, id: &LeaseId, epoch: Epoch) -> Result<(), PlaneError> {
        let row = self.open(id, epoch)?;
        if row.bound {
            return Ok(());
        }
        if !matches!(row.phase, Phase::Capacity | Phase::Assigned) {
            return Err(PlaneError::WrongNode(format!(
                "lease {id} is {} and unbound; it is never adopted",
                row.phase
            )));
        }
        self.row(id).bound = true;
        Ok(())
    }

    pub fn advance(&mut self, id: &LeaseId, epoch: Epoch, to: Phase) -> Result<(), PlaneError> {
        let row = self.open(id, epoch)?;
        if !row.bound {
            return Err(PlaneError::WrongNode(format!(
                "lease {id} is not bound here"
            )));
        }
        let from = row.phase;
        if to == Phase::Quarantine || (from != to && !from.can_move_to(to)) {
            return Err(PlaneError::BadTransition(format!("{id}: {from} -> {to}")));
        }
        if from == to {
            return Ok(());
        }
        if to.is_terminal() {
            self.end(id, to, false, "node advance");
        } else {
            let row = self.row(id);
            row.phase = to;
            row.expires = Instant::now() + TTL;
            self.event(|| format!("ledger: {id} {from} -> {to}"));
        }
        Ok(())
    }

    fn heartbeat_one(&mut self, id: &LeaseId, epoch: Epoch) -> Result<(), PlaneError> {
        let row = self.open(id, epoch)?;
        if row.force_release {
            return Err(PlaneError::ForceRelease(format!("lease {id}")));
        }
        self.row(id).expires = Instant::now() + TTL;
        Ok(())
    }

    pub fn release(
        &mut self,
        id: &LeaseId,
        epoch: Epoch,
        outcome: Phase,
    ) -> Result<(), PlaneError> {
        let row = self
            .leases
            .get(id)
            .ok_or_else(|| PlaneError::NotFound(format!("lease {id} is not in the ledger")))?;
        if row.epoch != epoch.0 {
            return Err(PlaneError::Fenced(format!(
                "lease {id} is at epoch {}, not {epoch}",
                row.epoch
            )));
        }
        if !row.bound {
            return Err(PlaneError::WrongNode(format!(
                "lease {id} is not bound here"
            )));
        }
        if !outcome.is_terminal() {
            return Err(PlaneError::Refused(format!("release as {outcome}")));
        }
        if row.phase.is_terminal() {
            return if row.phase == outcome {
                Ok(())
            } else {
                Err(PlaneError::Refused(format!(
                    "lease {id} already ended as {}",
                    row.phase
                )))
            };
        }
        self.end(id, outcome, false, "node release");
        Ok(())
    }

    pub fn lease(&self, id: &LeaseId) -> Result<Lease, PlaneError> {
        let row = self.owned(id)?;
        Ok(Lease {
            id: row.id.clone(),
            epoch: Epoch(row.epoch),
            tier: "sim".into(),
            phase: row.phase,
            vcpu: LEASE_VCPU,
            memory: LEASE_MEMORY,
            request_id: row.request,
            providers: Vec::new(),
            failure_reason: row.failure_reason.clone(),
        })
    }

    /// Keeps the first observation, fenced by epoch, terminal leases too,
    /// as the stub's ledger does.
    pub fn record_cache_observation(
        &mut self,
        id: &LeaseId,
        epoch: Epoch,
        observation: &Observation,
    ) -> Result<Observation, PlaneError> {
        let row = self
            .leases
            .get(id)
            .ok_or_else(|| PlaneError::NotFound(format!("lease {id} is not in the ledger")))?;
        if row.epoch != epoch.0 {
            return Err(PlaneError::Fenced(format!(
                "lease {id} is at epoch {}, not {epoch}",
                row.epoch
            )));
        }
        Ok(*self
            .cache_observations
            .entry(id.clone())
            .or_insert(*observation))
    }

    /// Keeps the first reason, as the stub's ledger does.
    pub fn mark_failure(
        &mut self,
        id: &LeaseId,
        epoch: Epoch,
        reason: &str,
    ) -> Result<(), PlaneError> {
        let row = self
            .leases
            .get_mut(id)
            .ok_or_else(|| PlaneError::NotFound(format!("lease {id} is not in the ledger")))?;
        if row.epoch != epoch.0 {
            return Err(PlaneError::Fenced(format!(
                "lease {id} is at epoch {}, not {epoch}",
                row.epoch
            )));
        }
        row.failure_reason.get_or_insert_with(|| reason.to_owned());
        // A runner that exited 0 ended with its job, whatever else the
        // engine says of its container (the OOM flag of a step killed
        // inside it): its lease is not a death.
        let name = name_of(id);
        if (reason == "oom" || reason == "killed" || reason.starts_with("exit "))
            && self.clean_exits.contains(&name)
        {
            self.violate(format!(
                "invariant (6) no finished runner read as dead: lease {id} is marked failed ({reason}) though {name} exited 0"
            ));
        }
        Ok(())
    }

    pub fn launched(&self) -> LaunchedSet {
        let mut set = LaunchedSet::default();
        for row in self
            .open
            .iter()
            .map(|id| &self.leases[id])
            .filter(|r| r.bound)
        {
            if row.phase == Phase::Quarantine {
                set.quarantined.push(row.id.clone());
            } else if row.phase.may_have_compute() {
                set.launched.push(row.id.clone());
            }
        }
        set
    }

    pub fn reconcile(&mut self, running: &[LeaseId]) -> u32 {
        let now = Instant::now();
        let free: Vec<LeaseId> = self
            .open
            .iter()
            .map(|id| &self.leases[id])
            .filter(|r| {
                r.bound
                    && r.phase == Phase::Quarantine
                    && r.expires + QUARANTINE_GRACE < now
                    && !running.contains(&r.id)
            })
            .map(|r| r.id.clone())
            .collect();
        for id in &free {
            self.end(
                id,
                Phase::Failed,
                true,
                "reconcile (absent from the inventory)",
            );
            self.tally("ledger: quarantine freed by reconcile");
        }
        free.len() as u32
    }

    pub fn mint(
        &mut self,
        id: &LeaseId,
        epoch: Epoch,
        runner_name: &str,
    ) -> Result<Registration, PlaneError> {
        let attempts = self.mint_attempts.entry(id.clone()).or_default();
        *attempts += 1;
        if *attempts > 1 {
            // The plane refuses a second mint below (as the stub does), so
            // this is the node asking again: a blind retry.
            let n = *attempts;
            self.violate(format!(
                "invariant (5) no lease minted twice: the node asked to mint a JIT config for {id} {n} times"
            ));
        }
        let row = self.owned(id)?;
        if row.epoch != epoch.0 {
            return Err(PlaneError::Fenced(format!(
                "lease {id} is at epoch {}, not {epoch}",
                row.epoch
            )));
        }
        if row.phase != Phase::Launching {
            return Err(PlaneError::BadTransition(format!(
                "lease {id} is {}; a JIT config is minted only while launching",
                row.phase
            )));
        }
        if runner_name != name_of(id) {
            return Err(PlaneError::Refused(format!(
                "runner name must be {}",
                name_of(id)
            )));
        }
        if row.runner.is_some() {
            self.tally("ledger: second mint refused");
            return Err(PlaneError::Refused(format!(
                "lease {id} already had a JIT config minted; a registration is never minted twice"
            )));
        }
        let registration = self.register(id, runner_name);
        self.event(|| {
            format!(
                "github: minted {runner_name} (runner {})",
                registration.runner_id
            )
        });
        Ok(registration)
    }

    /// GitHub registers `runner_name` for lease `id`, recorded against it.
    fn register(&mut self, id: &LeaseId, runner_name: &str) -> Registration {
        self.next_runner_id += 1;
        let runner_id = self.next_runner_id;
        let config = format!("jit-{id}-{runner_id}");
        self.row(id).runner = Some((runner_id, runner_name.to_owned()));
        self.regs.insert(
            runner_name.to_owned(),
            Reg {
                id: runner_id,
                lease: id.clone(),
                config: config.clone(),
                connected: false,
                job: false,
                busy: false,
            },
        );
        *self.mints.entry(id.clone()).or_default() += 1;
        Registration {
            config: JitConfig::new(config),
            runner_id,
            runner_name: runner_name.to_owned(),
        }
    }

    /// The plane mints the registration of an open lease before it
    /// dispatches its launch, recorded against the lease. The node must
    /// then never mint for it: this counts as the one mint, so a node that
    /// asks again breaks invariant (5).
    pub fn mint_ahead(&mut self, id: &LeaseId, epoch: Epoch) -> Result<Registration, PlaneError> {
        let row = self.open(id, epoch)?;
        if row.runner.is_some() {
            return Err(PlaneError::Refused(format!(
                "lease {id} already had a JIT config minted"
            )));
        }
        *self.mint_attempts.entry(id.clone()).or_default() += 1;
        let registration = self.register(id, &name_of(id));
        self.minted_ahead.insert(id.clone());
        self.event(|| {
            format!(
                "plane: minted {} (runner {}) before dispatch",
                registration.runner_name, registration.runner_id
            )
        });
        Ok(registration)
    }

    /// The plane removes the registration it minted before dispatching a
    /// launch that started nothing.
    pub fn plane_remove_registration(&mut self, id: &LeaseId) {
        let Some((_, name)) = self.leases.get(id).and_then(|r| r.runner.clone()) else {
            return;
        };
        if self.regs.get(&name).is_some_and(|r| r.lease == *id) {
            self.regs.remove(&name);
            self.event(|| {
                format!("plane: removed {name}, minted for a launch that started nothing")
            });
        }
    }

    /// The plane's registration pass (the stub's `registrations_once`),
    /// for the registrations it minted before dispatch: one whose lease
    /// has ended and whose runner took no job is removed. (A registration
    /// the node minted is left to the node, so the simulation still sees a
    /// node that forgets its own.)
    pub fn plane_registration_pass(&mut self) {
        let ended: Vec<String> = self
            .regs
            .iter()
            .filter(|(_, reg)| {
                !reg.job
                    && self.minted_ahead.contains(&reg.lease)
                    && self
                        .leases
                        .get(&reg.lease)
                        .is_none_or(|r| r.phase.is_terminal())
            })
            .map(|(name, _)| name.clone())
            .collect();
        for name in ended {
            self.regs.remove(&name);
            self.event(|| format!("plane: registration pass removed {name}, its lease ended"));
        }
    }

    /// Whether a node has bound the lease.
    pub fn bound(&self, id: &LeaseId) -> bool {
        self.leases.get(id).is_some_and(|r| r.bound)
    }

    /// Removes a registration as the plane does, telling whether GitHub
    /// still had it (an ephemeral one goes with its completed job).
    pub fn remove_runner(
        &mut self,
        id: &LeaseId,
        runner_id: i64,
        runner_name: &str,
    ) -> Result<Retired, PlaneError> {
        let row = self.owned(id)?;
        let name = if runner_id > 0 {
            if row.runner.as_ref().is_some_and(|(r, _)| *r != runner_id) {
                return Err(PlaneError::WrongNode(format!(
                    "runner {runner_id} is not the registration of lease {id}"
                )));
            }
            runner_name.to_owned()
        } else {
            match &row.runner {
                Some((_, name)) => name.clone(),
                None => return Ok(Retired::Removed),
            }
        };
        let exact = self
            .regs
            .get(&name)
            .is_some_and(|r| runner_id <= 0 || r.id == runner_id);
        if exact {
            if self.regs[&name].job && self.faults.removal_ignores_job {
                self.regs.remove(&name);
                self.tally("github: removal of a runner at work accepted");
                self.event(|| format!("github: removed registration {name} of a runner at work"));
                return Ok(Retired::Removed);
            }
            if self.regs[&name].job {
                // As GitHub does (400 JobStillRunning), whoever asks and
                // whatever authority they hold: a runner GitHub records as
                // running a job cannot be removed. (Destroying its instance
                // without authority is invariant (4), checked by the
                // provider.)
                self.tally("github: removal refused, job still running");
                self.event(|| format!("github: refused to remove busy runner {name}"));
                return Err(PlaneError::Busy(format!(
                    "JobStillRunning: runner {name} is still running a job"
                )));
            }
            if self.sabotage == Some(Sabotage::RemovalKeepsRegistration) {
                return Ok(Retired::Removed);
            }
            self.regs.remove(&name);
            self.event(|| format!("github: node removed registration {name}"));
            return Ok(Retired::Removed);
        }
        Ok(Retired::AlreadyGone)
    }

    fn take_fault(&mut self, op: LOp, keys: &[LeaseId]) -> Option<Fault> {
        if keys.is_empty() {
            return self
                .faults
                .global
                .get_mut(&op)
                .and_then(VecDeque::pop_front);
        }
        let mut sorted: Vec<&LeaseId> = keys.iter().collect();
        sorted.sort();
        for key in sorted {
            if let Some(queue) = self.faults.lease.get_mut(&(key.clone(), op))
                && let Some(fault) = queue.pop_front()
            {
                return Some(fault);
            }
        }
        None
    }

    pub fn take_pfault(&mut self, name: &str, op: POp) -> Option<PFault> {
        self.faults
            .instance
            .get_mut(&(name.to_owned(), op))
            .and_then(VecDeque::pop_front)
    }

    fn gate(&mut self) -> Gate {
        if self.crashed {
            return Gate::CrashBefore;
        }
        let Some(crash) = self.crash.as_mut() else {
            return Gate::Go;
        };
        crash.countdown = crash.countdown.saturating_sub(1);
        if crash.countdown > 0 {
            return Gate::Go;
        }
        let after = crash.after_effect;
        self.crash = None;
        if after {
            Gate::CrashAfter
        } else {
            self.crashed = true;
            Gate::CrashBefore
        }
    }

    // ----- the ledger, as the plane and the operator write it -----

    /// Ends a lease, checking invariant (3) at the moment it happens.
    pub fn end(&mut self, id: &LeaseId, outcome: Phase, bump: bool, who: &'static str) {
        let row = self.leases.get_mut(id).expect("a known lease");
        let from = row.phase;
        row.phase = outcome;
        if bump {
            row.epoch += 1;
        }
        row.ended_by = Some(who);
        let epoch = row.epoch;
        self.open.remove(id);
        let name = name_of(id);
        self.tally(who);
        if let Some(instance) = self.fake.instance(&name)
            && may_run(&instance)
        {
            self.violate(format!(
                "invariant (3) no capacity freed while an instance may exist: lease {id} went {from} -> {outcome} ({who}) while {name} still runs"
            ));
        }
        self.event(|| format!("ledger: {id} {from} -> {outcome} at epoch {epoch} ({who})"));
    }

    /// What the ledger charges on the node: every open lease and every
    /// warm runner's row, as (vCPUs, memory bytes).
    pub fn charged(&self) -> (u64, u64) {
        let leases = self.open.len() as u64;
        let warm = self
            .warm
            .rooms
            .values()
            .fold((0, 0), |(v, m), r| (v + u64::from(r.vcpu), m + r.memory.0));
        (
            leases * u64::from(LEASE_VCPU) + warm.0,
            leases * LEASE_MEMORY.0 + warm.1,
        )
    }

    fn fits(&self, freed: (u64, u64), asked: (u64, u64)) -> bool {
        let (vcpu, memory) = self.charged();
        vcpu - freed.0 + asked.0 <= self.capacity.0 && memory - freed.1 + asked.1 <= self.capacity.1
    }

    /// Whether the ledger charged the room of warm runner `name`: it holds
    /// its row, or a lease took that over (the lease may have ended since:
    /// the pool learns so only at its next confirmation).
    pub fn warm_reserved(&self, name: &str) -> bool {
        self.warm.rooms.contains_key(name) || self.warm.taken.contains_key(name)
    }

    /// Reserves a lease for `request` on the node, as the stub's
    /// `reserve_on_warm` does: with `take_warm`, the lease takes over the
    /// room of the oldest warm runner charged there and its launch names
    /// that runner. `None`: the node has no room.
    pub fn reserve(&mut self, request: RequestId, take_warm: bool) -> Option<LeaseId> {
        let warm = if take_warm {
            self.warm
                .rooms
                .iter()
                .find(|(_, r)| r.tier == "sim")
                .map(|(n, _)| n.clone())
        } else {
            None
        };
        let freed = warm.as_ref().map_or((0, 0), |n| {
            let r = &self.warm.rooms[n];
            (u64::from(r.vcpu), r.memory.0)
        });
        if !self.fits(freed, (u64::from(LEASE_VCPU), LEASE_MEMORY.0)) {
            self.tally("plane: no room on the node for a lease");
            self.event(|| format!("plane: no room on the node for request {request}"));
            return None;
        }
        let id = self.peek_lease();
        self.next_lease += 1;
        let now = Instant::now();
        if let Some(name) = &warm {
            self.warm.rooms.remove(name);
            self.warm.taken.insert(name.clone(), id.clone());
            self.tally("plane: a lease took over a warm runner's room");
            self.event(|| format!("plane: {id} takes over the room of warm runner {name}"));
        }
        self.open.insert(id.clone());
        self.leases.insert(
            id.clone(),
            Row {
                id: id.clone(),
                epoch: 1,
                phase: Phase::Assigned,
                bound: false,
                request,
                expires: now + TTL,
                force_release: false,
                runner: None,
                ended_by: None,
                failure_reason: None,
            },
        );
        self.plane.insert(
            id.clone(),
            PlaneLease {
                request,
                epoch: Epoch(1),
                managed: true,
                last_renew: now,
                warm: warm.map(|n| InstanceName::warm(&n).expect("a warm runner's name")),
            },
        );
        self.event(|| format!("plane: reserved {id} for request {request}"));
        Some(id)
    }

    // ----- warm runners' room, as the pool asks for it -----

    /// Charges a warm runner's room unless the node has none left; the
    /// same name again changes nothing.
    pub fn reserve_warm(
        &mut self,
        name: &str,
        tier: &str,
        vcpu: u32,
        memory: ByteSize,
    ) -> Result<(), PlaneError> {
        if self.warm.rooms.contains_key(name) {
            return Ok(());
        }
        if !self.fits((0, 0), (u64::from(vcpu), memory.0)) {
            self.tally("ledger: warm runner refused, no room");
            return Err(PlaneError::Refused(format!(
                "no room on the node for warm runner {name}"
            )));
        }
        if self.sabotage == Some(Sabotage::WarmReserveChargesNothing) {
            return Ok(());
        }
        self.warm.rooms.insert(
            name.to_owned(),
            WarmRoom {
                tier: tier.to_owned(),
                vcpu,
                memory,
            },
        );
        self.event(|| format!("ledger: charged the room of warm runner {name}"));
        Ok(())
    }

    /// Drops a warm runner's room. One that may still run has its room
    /// lent out again while it takes it: kept for the world's check, which
    /// allows it only to a claim that names the runner next.
    pub fn release_warm(&mut self, name: &str) {
        if self.fake.instance(name).is_some_and(|i| may_run(&i)) {
            self.warm.released_running.insert(name.to_owned());
        }
        if self.warm.rooms.remove(name).is_some() {
            self.event(|| format!("ledger: released the room of warm runner {name}"));
        }
    }

    /// The node holds exactly `names`: every other warm row goes; answers
    /// those of `names` still charged.
    pub fn confirm_warm(&mut self, names: &[InstanceName]) -> Vec<InstanceName> {
        let held: BTreeSet<&str> = names.iter().map(InstanceName::as_str).collect();
        let dropped: Vec<String> = self
            .warm
            .rooms
            .keys()
            .filter(|n| !held.contains(n.as_str()))
            .cloned()
            .collect();
        for name in dropped {
            self.warm.rooms.remove(&name);
            self.tally("ledger: warm room dropped by a confirmation");
            self.event(|| format!("ledger: dropped the room of warm runner {name}, not held"));
        }
        names
            .iter()
            .filter(|n| self.warm.rooms.contains_key(n.as_str()))
            .cloned()
            .collect()
    }

    /// The plane gives up renewing a lease (the node holds it, or it ended).
    pub fn unmanage(&mut self, id: &LeaseId) {
        if let Some(p) = self.plane.get_mut(id) {
            p.managed = false;
        }
    }

    /// The plane's release: at the epoch it holds, or (after a destroy, as
    /// the stub does) at the current one. Refusals are logged, not retried.
    pub fn plane_release(
        &mut self,
        id: &LeaseId,
        epoch: Option<Epoch>,
        outcome: Phase,
        who: &'static str,
    ) {
        self.unmanage(id);
        let Some(row) = self.leases.get(id) else {
            return;
        };
        if epoch.is_some_and(|e| e.0 != row.epoch) {
            self.event(|| format!("plane: release of {id} fenced"));
            return;
        }
        if row.phase.is_terminal() {
            return;
        }
        self.end(id, outcome, false, who);
    }

    /// When the plane next has something to do: the earliest renewal due or
    /// expiry, but at most [`PLANE_TICK`] away (a lease reserved meanwhile is
    /// due no sooner than TTL/3 after it).
    pub fn plane_next(&self) -> Instant {
        let now = Instant::now();
        let mut next = now + PLANE_TICK;
        for id in &self.open {
            let row = &self.leases[id];
            if row.phase != Phase::Quarantine {
                next = next.min(row.expires + Duration::from_millis(1));
            }
            if let Some(p) = self.plane.get(id)
                && p.managed
                && !self.faults.plane_stalled
            {
                next = next.min(p.last_renew + TTL / 3);
            }
        }
        next.max(now + Duration::from_millis(1))
    }

    /// The plane's renewals (every TTL/3) and the reaper.
    pub fn plane_tick(&mut self) {
        let now = Instant::now();
        if !self.faults.plane_stalled {
            let due: Vec<(LeaseId, Epoch)> = self
                .open
                .iter()
                .filter_map(|id| self.plane.get(id).map(|p| (id, p)))
                .filter(|(_, p)| p.managed && now >= p.last_renew + TTL / 3)
                .map(|(id, p)| (id.clone(), p.epoch))
                .collect();
            for (id, epoch) in due {
                let ok = match self.leases.get_mut(&id) {
                    Some(row) if row.epoch == epoch.0 && !row.phase.is_terminal() => {
                        row.expires = now + TTL;
                        true
                    }
                    _ => false,
                };
                let p = self.plane.get_mut(&id).expect("due");
                p.last_renew = now;
                if !ok {
                    p.managed = false;
                    self.event(|| format!("plane: renewal of {id} refused; stops managing it"));
                }
            }
        }
        self.reap(now);
    }

    pub fn reap(&mut self, now: Instant) {
        let expired: Vec<(LeaseId, bool)> = self
            .open
            .iter()
            .map(|id| &self.leases[id])
            .filter(|r| !r.phase.is_terminal() && r.phase != Phase::Quarantine && r.expires < now)
            .map(|r| (r.id.clone(), r.phase.may_have_compute()))
            .collect();
        for (id, had_compute) in expired {
            if had_compute {
                let row = self.row(&id);
                let from = row.phase;
                row.phase = Phase::Quarantine;
                row.epoch += 1;
                let epoch = row.epoch;
                self.tally("ledger: reaper quarantined");
                self.event(|| format!("reaper: {id} {from} -> quarantine at epoch {epoch}"));
            } else {
                self.end(&id, Phase::Failed, true, "reaper");
            }
        }
    }

    // ----- GitHub and the instances' own lives -----

    /// An instance started with `config`: its runner connects. Whether it
    /// has a registration to connect with.
    pub fn connect(&mut self, config: &str) -> bool {
        match self.regs.values_mut().find(|r| r.config == config) {
            Some(reg) => {
                reg.connected = true;
                true
            }
            None => false,
        }
    }

    /// A connected runner takes its job: GitHub records it at once (a
    /// removal is now refused), but its listing still shows the runner idle
    /// until [`Core::busy_catches_up`].
    pub fn job_starts(&mut self, name: &str) {
        self.jobs.insert(name.to_owned(), Job::Live);
        if let Some(reg) = self.regs.get_mut(name) {
            reg.job = true;
        }
        self.event(|| format!("github: {name} took its job (listed idle until GitHub catches up)"));
    }

    /// GitHub's runner listing catches up: every runner with a job lists
    /// as busy.
    pub fn busy_catches_up(&mut self) {
        for reg in self.regs.values_mut() {
            reg.busy = reg.job;
        }
    }

    /// Whether GitHub records a job running on this runner (what a removal
    /// is refused on).
    pub fn busy_at_github(&self, name: &str) -> bool {
        self.regs.get(name).is_some_and(|r| r.job)
    }

    /// An instance's job ended: GitHub removes the ephemeral registration
    /// and reports the completion to the plane.
    pub fn job_ends(&mut self, name: &str, job: Job, result: &'static str) {
        self.jobs.insert(name.to_owned(), job);
        self.finishing.remove(name);
        self.regs.remove(name);
        if let Some(lease) = InstanceName::lease(name) {
            self.completions.insert((lease, result));
        }
        self.event(|| format!("github: job on {name} ended {result}; registration removed"));
    }

    /// An instance is gone (destroyed or removed out of band): a job it was
    /// still running dies with it, and GitHub notices at once (the runner's
    /// connection drops).
    pub fn gone(&mut self, name: &str) {
        self.pending_removal.remove(name);
        self.warm.released_running.remove(name);
        self.warm.waiting.remove(name);
        match self.jobs.get(name) {
            Some(Job::Live) => self.job_ends(name, Job::Dead, "failed"),
            Some(Job::Finishing) => {
                self.jobs.insert(name.to_owned(), Job::Completed);
                self.finishing.remove(name);
            }
            _ => {}
        }
    }

    /// GitHub reports a job completed while its runner is still working
    /// (post-job steps, log upload): the registration is retired and the
    /// completion sent, and the runner exits on its own later.
    pub fn completes_early(&mut self, name: &str) {
        self.job_ends(name, Job::Finishing, "succeeded");
        self.finishing.insert(name.to_owned(), Instant::now());
    }
}

/// The shared world and the crash signal.
#[derive(Debug)]
pub struct Shared {
    core: Mutex<Core>,
    /// Fired when an armed crash happens.
    pub crash: Notify,
}

impl Shared {
    pub fn new(core: Core) -> Arc<Self> {
        Arc::new(Self {
            core: Mutex::new(core),
            crash: Notify::new(),
        })
    }

    pub fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Slowness, then the crash gate. A crashed process's calls never return.
    pub async fn enter(&self, slow: Option<Duration>) -> Gate {
        if let Some(d) = slow {
            tokio::time::sleep(d).await;
        }
        let gate = self.lock().gate();
        if gate == Gate::CrashBefore {
            self.hang().await;
        }
        gate
    }

    /// Answers, unless the crash was armed to strike after the effect.
    pub async fn leave(&self, gate: Gate) {
        if gate == Gate::CrashAfter {
            self.hang().await;
        }
    }

    async fn hang(&self) {
        self.lock().crashed = true;
        self.crash.notify_one();
        std::future::pending::<()>().await;
    }
}

/// The node's [`LeaseStore`] and [`JitSource`] over the simulated plane.
#[derive(Debug, Clone)]
pub struct FakeLedger(pub Arc<Shared>);

impl FakeLedger {
    /// Runs a node call. Slowness applies to the calls of a launch and of a
    /// sweep only: those run in an order the runner fixes (a launch's
    /// sequence, a sweep's sorted inventory), while a tend visits custody
    /// entries in `HashMap` order, and time spent there would make a seed's
    /// path depend on that order.
    async fn call<T>(
        &self,
        op: LOp,
        keys: &[LeaseId],
        slow: bool,
        effect: impl FnOnce(&mut Core) -> Result<T, PlaneError>,
    ) -> Result<T, PlaneError> {
        let slow = {
            let c = self.0.lock();
            if slow { c.faults.slow_ledger } else { None }.or(c.faults.inside_tend)
        };
        let gate = self.0.enter(slow).await;
        let result = {
            let mut c = self.0.lock();
            if c.faults.ledger_down {
                Err(unavailable("no plane session is open"))
            } else {
                match c.take_fault(op, keys) {
                    Some(Fault::Refuse) => Err(unavailable("injected: refused")),
                    Some(Fault::LoseReply) => {
                        let done = effect(&mut c);
                        let what = if done.is_ok() { "done" } else { "refused" };
                        c.event(|| format!("ledger: {op:?} {keys:?} {what}, reply lost"));
                        Err(unavailable("injected: the reply was lost"))
                    }
                    None => effect(&mut c),
                }
            }
        };
        self.0.leave(gate).await;
        result
    }
}

#[async_trait]
impl LeaseStore for FakeLedger {
    async fn bind(&self, lease: &LeaseId, epoch: Epoch) -> Result<(), PlaneError> {
        self.call(LOp::Bind, std::slice::from_ref(lease), true, |c| {
            c.bind(lease, epoch)
        })
        .await
    }

    async fn advance(&self, lease: &LeaseId, epoch: Epoch, phase: Phase) -> Result<(), PlaneError> {
        self.call(
            LOp::Advance,
            std::slice::from_ref(lease),
            phase == Phase::Launching,
            |c| c.advance(lease, epoch, phase),
        )
        .await
    }

    async fn heartbeat(
        &self,
        leases: &[(LeaseId, Epoch)],
    ) -> Result<Vec<Result<(), PlaneError>>, PlaneError> {
        let keys: Vec<LeaseId> = leases.iter().map(|(l, _)| l.clone()).collect();
        self.call(LOp::Heartbeat, &keys, false, |c| {
            Ok(leases.iter().map(|(l, e)| c.heartbeat_one(l, *e)).collect())
        })
        .await
    }

    async fn release(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        ending: &Ending,
    ) -> Result<(), PlaneError> {
        self.call(LOp::Release, std::slice::from_ref(lease), false, |c| {
            if let Some(reason) = ending.reason() {
                // As the link does: the first reason is kept, and a refusal
                // of it leaves the release to decide.
                let _ = c.mark_failure(lease, epoch, &reason.to_string());
            }
            c.release(lease, epoch, ending.phase())
        })
        .await
    }

    async fn mark_failure(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        reason: &FailureReason,
    ) -> Result<(), PlaneError> {
        let reason = reason.to_string();
        self.call(LOp::MarkFailure, std::slice::from_ref(lease), false, |c| {
            c.mark_failure(lease, epoch, &reason)
        })
        .await
    }

    async fn record_cache_observation(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        observation: &Observation,
    ) -> Result<Observation, PlaneError> {
        self.call(
            LOp::CacheObservation,
            std::slice::from_ref(lease),
            false,
            |c| c.record_cache_observation(lease, epoch, observation),
        )
        .await
    }

    async fn actions_cache_allowed(
        &self,
        owner: &str,
        repository: &str,
    ) -> Result<bool, PlaneError> {
        let (owner, repository) = (owner.to_lowercase(), repository.to_lowercase());
        self.call(LOp::ActionsPolicy, &[], false, |c| {
            Ok(!c.cache_blocks.contains(&owner)
                && !c.cache_blocks.contains(&format!("{owner}/{repository}")))
        })
        .await
    }

    async fn lease(&self, lease: &LeaseId) -> Result<Lease, PlaneError> {
        self.call(LOp::Lease, std::slice::from_ref(lease), false, |c| {
            c.lease(lease)
        })
        .await
    }

    async fn launched(&self) -> Result<LaunchedSet, PlaneError> {
        self.call(LOp::Launched, &[], true, |c| Ok(c.launched()))
            .await
    }

    async fn reconcile(&self, running: &[LeaseId]) -> Result<u32, PlaneError> {
        self.call(LOp::Reconcile, &[], true, |c| Ok(c.reconcile(running)))
            .await
    }

    fn lease_ttl(&self) -> Duration {
        TTL
    }
}

#[async_trait]
impl JitSource for FakeLedger {
    async fn mint(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        runner_name: &InstanceName,
    ) -> Result<Registration, PlaneError> {
        self.call(LOp::Mint, std::slice::from_ref(lease), true, |c| {
            let minted = c.mint(lease, epoch, runner_name.as_str());
            if c.sabotage == Some(Sabotage::MintTwice) {
                let _ = c.mint(lease, epoch, runner_name.as_str());
            }
            minted
        })
        .await
    }

    async fn remove_runner(
        &self,
        lease: &LeaseId,
        _epoch: Epoch,
        runner_id: i64,
        runner_name: &str,
    ) -> Result<(), PlaneError> {
        self.call(LOp::RemoveRunner, std::slice::from_ref(lease), false, |c| {
            c.remove_runner(lease, runner_id, runner_name).map(drop)
        })
        .await
    }

    async fn retire_runner(
        &self,
        lease: &LeaseId,
        _epoch: Epoch,
        runner_id: i64,
        runner_name: &str,
    ) -> Result<Retired, PlaneError> {
        self.call(LOp::RemoveRunner, std::slice::from_ref(lease), false, |c| {
            c.remove_runner(lease, runner_id, runner_name)
        })
        .await
    }
}

/// The pool calls from its own task, in an order it fixes (one turn at a
/// time, its runners by name), so these calls may be slow too.
#[async_trait]
impl WarmRooms for FakeLedger {
    async fn reserve(
        &self,
        name: &InstanceName,
        tier: &str,
        vcpu: u32,
        memory: ByteSize,
    ) -> Result<(), PlaneError> {
        self.call(LOp::ReserveWarm, &[], true, |c| {
            c.reserve_warm(name.as_str(), tier, vcpu, memory)
        })
        .await
    }

    async fn release(&self, name: &InstanceName) -> Result<(), PlaneError> {
        self.call(LOp::ReleaseWarm, &[], true, |c| {
            c.release_warm(name.as_str());
            Ok(())
        })
        .await
    }

    async fn confirm(&self, names: &[InstanceName]) -> Result<Vec<InstanceName>, PlaneError> {
        self.call(LOp::ConfirmWarm, &[], true, |c| Ok(c.confirm_warm(names)))
            .await
    }
}
