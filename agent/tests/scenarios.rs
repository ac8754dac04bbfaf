//! spec/node.md §7, scenario by scenario: one test per runner scenario that
//! applies to this design (the table is `docs/spec-coverage.md`). Each drives
//! the real [`Runner`] over the crate's `FakeProvider`, the simulation's fake
//! ledger and GitHub (`sim/fakes.rs`, reused as is) and an in-memory journal
//! shared across "restarts", in paused tokio time where time matters, and
//! asserts the scenario's effect on the provider's recorded calls, the
//! ledger's phase, epoch and outcome, and GitHub's registrations.

#![allow(dead_code)]

#[path = "sim/fakes.rs"]
mod fakes;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use billet_agent::journal::{Journal, LaunchRecord, MemoryJournal};
use billet_agent::model::Registration;
use billet_agent::model::{
    ByteSize, DestroyOrder, Epoch, InstanceName, Job, Lease, LeaseId, Phase, RequestId,
    RunnerVersion, TierSpec, Trust,
};
use billet_agent::node::ending::{EndReason, Ending, FailureReason, SpotAction};
use billet_agent::node::plane::{JitSource, LaunchedSet, LeaseStore, PlaneError, Retired};
use billet_agent::node::runner::{
    HeldState, POST_JOB_GRACE, Runner, RunnerError, RunnerOptions, STRAY_GRACE,
};
use billet_agent::provider::fake::{Call, DestroyMode, FakeProvider, Operation};
use billet_agent::provider::{Exit, Instance, InstanceState, Provider};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use fakes::{Core, FakeLedger, Fault, LOp, Shared};

// ----- a thin wrapper over the sim's fake ledger: knobs the sim lacks -----

/// The sim's [`FakeLedger`] with what these scenarios need on top: a TTL
/// that can change, a recorded failure reason per lease, a GitHub runner
/// name that differs from the requested one, and a log of calls (each
/// registration removal noting how many destroys the provider had seen).
#[derive(Debug)]
struct Plane {
    inner: FakeLedger,
    fake: Arc<FakeProvider>,
    ttl: Mutex<Duration>,
    reasons: Mutex<BTreeMap<LeaseId, String>>,
    github_name: Mutex<Option<String>>,
    log: Mutex<Vec<String>>,
    heartbeats: Mutex<Vec<Instant>>,
    reconciles: Mutex<Vec<Vec<LeaseId>>>,
}

impl Plane {
    fn note(&self, what: String) {
        self.log.lock().unwrap().push(what);
    }
    fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }
    fn heartbeats(&self) -> usize {
        self.heartbeats.lock().unwrap().len()
    }
    /// The lease as the ledger holds it, with its failure reason.
    async fn read(&self, lease: &LeaseId) -> Result<Lease, PlaneError> {
        let mut l = self.inner.lease(lease).await?;
        l.failure_reason = self.reasons.lock().unwrap().get(lease).cloned();
        Ok(l)
    }
    /// How many calls the log has whose line starts with `what`.
    fn count(&self, what: &str) -> usize {
        self.log().iter().filter(|l| l.starts_with(what)).count()
    }
}

/// A journal that counts its writes (each call one transaction) and can be
/// told to fail its next custody writes (a full or failing disk).
#[derive(Debug, Default)]
struct CountingJournal {
    inner: MemoryJournal,
    writes: Mutex<usize>,
    custody_failures: Mutex<u32>,
}

impl CountingJournal {
    fn wrote(&self) {
        *self.writes.lock().unwrap() += 1;
    }
    fn writes(&self) -> usize {
        *self.writes.lock().unwrap()
    }
    /// The next `times` custody writes fail.
    fn fail_custody_writes(&self, times: u32) {
        *self.custody_failures.lock().unwrap() += times;
    }
    fn custody_write(&self) -> Result<(), billet_agent::journal::JournalError> {
        self.wrote();
        let mut failures = self.custody_failures.lock().unwrap();
        if *failures > 0 {
            *failures -= 1;
            return Err(billet_agent::journal::JournalError::Io(
                "injected: disk I/O error".into(),
            ));
        }
        Ok(())
    }
}

#[async_trait]
impl Journal for CountingJournal {
    async fn put_launch(
        &self,
        launch: &LaunchRecord,
    ) -> Result<(), billet_agent::journal::JournalError> {
        self.wrote();
        self.inner.put_launch(launch).await
    }
    async fn forget_launch(&self, lease: &str) -> Result<(), billet_agent::journal::JournalError> {
        self.wrote();
        self.inner.forget_launch(lease).await
    }
    async fn launches(&self) -> Result<Vec<LaunchRecord>, billet_agent::journal::JournalError> {
        self.inner.launches().await
    }
    async fn put_custody(
        &self,
        entry: &billet_agent::journal::CustodyRecord,
    ) -> Result<(), billet_agent::journal::JournalError> {
        self.custody_write()?;
        self.inner.put_custody(entry).await
    }
    async fn put_custody_all(
        &self,
        entries: &[billet_agent::journal::CustodyRecord],
    ) -> Result<(), billet_agent::journal::JournalError> {
        self.custody_write()?;
        self.inner.put_custody_all(entries).await
    }
    async fn forget_custody(&self, lease: &str) -> Result<(), billet_agent::journal::JournalError> {
        self.wrote();
        self.inner.forget_custody(lease).await
    }
    async fn custody(
        &self,
    ) -> Result<Vec<billet_agent::journal::CustodyRecord>, billet_agent::journal::JournalError>
    {
        self.inner.custody().await
    }
    async fn put_result(
        &self,
        command: &str,
        encoded: &[u8],
        durability: billet_agent::journal::Durability,
    ) -> Result<(), billet_agent::journal::JournalError> {
        self.wrote();
        self.inner.put_result(command, encoded, durability).await
    }
    async fn results(&self) -> Result<Vec<(String, Vec<u8>)>, billet_agent::journal::JournalError> {
        self.inner.results().await
    }
}

#[async_trait]
impl LeaseStore for Plane {
    async fn bind(&self, lease: &LeaseId, epoch: Epoch) -> Result<(), PlaneError> {
        self.note(format!("bind {lease}"));
        self.inner.bind(lease, epoch).await
    }
    async fn advance(&self, lease: &LeaseId, epoch: Epoch, phase: Phase) -> Result<(), PlaneError> {
        self.note(format!("advance {lease} {phase}"));
        self.inner.advance(lease, epoch, phase).await
    }
    async fn heartbeat(
        &self,
        leases: &[(LeaseId, Epoch)],
    ) -> Result<Vec<Result<(), PlaneError>>, PlaneError> {
        self.heartbeats.lock().unwrap().push(Instant::now());
        self.inner.heartbeat(leases).await
    }
    async fn release(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        ending: &Ending,
    ) -> Result<(), PlaneError> {
        if let Some(reason) = ending.reason() {
            self.reasons
                .lock()
                .unwrap()
                .entry(lease.clone())
                .or_insert_with(|| reason.to_string());
        }
        self.note(format!("release {lease} {}", ending.phase()));
        self.inner.release(lease, epoch, ending).await
    }
    async fn mark_failure(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        why: &FailureReason,
    ) -> Result<(), PlaneError> {
        let reason = &why.to_string();
        self.note(format!("mark_failure {lease} {reason}"));
        self.inner.mark_failure(lease, epoch, why).await?;
        self.reasons
            .lock()
            .unwrap()
            .entry(lease.clone())
            .or_insert_with(|| reason.to_owned());
        Ok(())
    }
    async fn record_cache_observation(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        observation: &billet_agent::cache::Observation,
    ) -> Result<billet_agent::cache::Observation, PlaneError> {
        self.note(format!("record_cache_observation {lease}"));
        self.inner
            .record_cache_observation(lease, epoch, observation)
            .await
    }
    async fn actions_cache_allowed(
        &self,
        owner: &str,
        repository: &str,
    ) -> Result<bool, PlaneError> {
        self.note(format!("actions_policy {owner}/{repository}"));
        self.inner.actions_cache_allowed(owner, repository).await
    }
    async fn lease(&self, lease: &LeaseId) -> Result<Lease, PlaneError> {
        self.note(format!("get_lease {lease}"));
        self.read(lease).await
    }
    /// As the stub plane answers it: the set with its leases.
    async fn launched(&self) -> Result<LaunchedSet, PlaneError> {
        self.note("launched".into());
        let mut set = self.inner.launched().await?;
        for id in set.launched.clone().iter().chain(&set.quarantined.clone()) {
            set.leases.push(self.read(id).await?);
        }
        Ok(set)
    }
    async fn reconcile(&self, running: &[LeaseId]) -> Result<u32, PlaneError> {
        self.reconciles.lock().unwrap().push(running.to_vec());
        self.inner.reconcile(running).await
    }
    fn lease_ttl(&self) -> Duration {
        *self.ttl.lock().unwrap()
    }
}

#[async_trait]
impl JitSource for Plane {
    async fn mint(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        runner_name: &InstanceName,
    ) -> Result<Registration, PlaneError> {
        self.note(format!("mint {lease} {runner_name}"));
        let mut r = self.inner.mint(lease, epoch, runner_name).await?;
        if let Some(name) = self.github_name.lock().unwrap().clone() {
            r.runner_name = name;
        }
        Ok(r)
    }
    async fn remove_runner(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        runner_id: i64,
        runner_name: &str,
    ) -> Result<(), PlaneError> {
        let destroys = self.fake.count(Operation::Destroy);
        self.note(format!("remove {lease} after {destroys} destroys"));
        self.inner
            .remove_runner(lease, epoch, runner_id, runner_name)
            .await
    }
    async fn retire_runner(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        runner_id: i64,
        runner_name: &str,
    ) -> Result<Retired, PlaneError> {
        let destroys = self.fake.count(Operation::Destroy);
        self.note(format!("remove {lease} after {destroys} destroys"));
        self.inner
            .retire_runner(lease, epoch, runner_id, runner_name)
            .await
    }
}

// ----- the world of one scenario -----

struct World {
    fake: Arc<FakeProvider>,
    shared: Arc<Shared>,
    plane: Arc<Plane>,
    journal: Arc<MemoryJournal>,
}

impl World {
    fn new() -> Self {
        let fake = Arc::new(FakeProvider::new());
        let shared = Shared::new(Core::new(Arc::clone(&fake), false));
        // A scenario holds as many leases as it needs: the node's room is
        // the simulation's to exercise.
        shared.lock().capacity = (u64::MAX, u64::MAX);
        let plane = Arc::new(Plane {
            inner: FakeLedger(Arc::clone(&shared)),
            fake: Arc::clone(&fake),
            ttl: Mutex::new(fakes::TTL),
            reasons: Mutex::new(BTreeMap::new()),
            github_name: Mutex::new(None),
            log: Mutex::new(Vec::new()),
            heartbeats: Mutex::new(Vec::new()),
            reconciles: Mutex::new(Vec::new()),
        });
        Self {
            fake,
            shared,
            plane,
            journal: Arc::new(MemoryJournal::default()),
        }
    }

    /// A runner over this world; a second call is the same node restarted
    /// (same provider, ledger and journal, fresh memory).
    fn runner(&self) -> Arc<Runner> {
        self.runner_with(RunnerOptions::default())
    }

    fn runner_with(&self, options: RunnerOptions) -> Arc<Runner> {
        let provider: Arc<dyn Provider> = self.fake.clone();
        Arc::new(
            Runner::new(provider, self.plane.clone(), self.plane.clone(), options)
                .with_journal(self.journal.clone()),
        )
    }

    fn core(&self) -> MutexGuard<'_, Core> {
        self.shared.lock()
    }

    /// The plane reserves a lease for `request` (assigned, epoch 1, unbound).
    fn reserve(&self, request: i64) -> Lease {
        let id = self
            .core()
            .reserve(RequestId(request), false)
            .expect("the node has room for the lease");
        Lease {
            id,
            epoch: Epoch(1),
            tier: "t".into(),
            phase: Phase::Assigned,
            vcpu: 2,
            memory: ByteSize(1 << 30),
            request_id: RequestId(request),
            providers: vec!["docker".into()],
            failure_reason: None,
        }
    }

    /// A lease already bound to this node and launching (an earlier process
    /// got that far).
    fn launching_lease(&self, request: i64) -> Lease {
        let lease = self.reserve(request);
        let mut c = self.core();
        c.bind(&lease.id, Epoch(1)).unwrap();
        c.advance(&lease.id, Epoch(1), Phase::Launching).unwrap();
        lease
    }

    /// The launch record an earlier process synced for `lease` (epoch 1)
    /// before it died, with no registration and nothing created yet.
    async fn journal_unminted_launch(&self, lease: &Lease) {
        self.journal
            .put_launch(&LaunchRecord {
                lease: lease.id.as_str().to_owned(),
                epoch: lease.epoch.0,
                request_id: lease.request_id.0,
                instance: name(&lease.id),
                runner_id: 0,
                runner_name: String::new(),
                created: false,
            })
            .await
            .unwrap();
    }

    /// An instance appears without any call (left by an earlier process).
    fn put_instance(&self, name: &str, running: bool) {
        self.fake.insert_behind_back(Instance {
            id: format!("left-{name}"),
            name: name.to_owned(),
            state: if running {
                InstanceState::Running
            } else {
                InstanceState::Exited(Exit {
                    code: 0,
                    oom_killed: false,
                })
            },
            labels: BTreeMap::new(),
        });
    }

    /// Reserves a lease for `request` and launches it successfully.
    async fn launched(&self, runner: &Runner, request: i64) -> Lease {
        let lease = self.reserve(request);
        runner
            .launch(lease.clone(), tier(Trust::Trusted), job(request, "push"))
            .await
            .expect("the launch succeeds");
        lease
    }

    fn phase(&self, lease: &LeaseId) -> Phase {
        self.core().leases[lease].phase
    }
    fn epoch(&self, lease: &LeaseId) -> u64 {
        self.core().leases[lease].epoch
    }
    fn bound(&self, lease: &LeaseId) -> bool {
        self.core().leases[lease].bound
    }
    fn expires(&self, lease: &LeaseId) -> Instant {
        self.core().leases[lease].expires
    }
    fn registered(&self, lease: &LeaseId) -> bool {
        self.core().regs.contains_key(&name(lease))
    }
    fn exists(&self, lease: &LeaseId) -> bool {
        self.fake.instance(&name(lease)).is_some()
    }
    fn destroys_of(&self, lease: &LeaseId) -> usize {
        let n = InstanceName::for_lease(lease);
        self.fake
            .calls()
            .iter()
            .filter(|c| **c == Call::Destroy(n.clone()))
            .count()
    }
    fn fault(&self, lease: &LeaseId, op: LOp, fault: Fault) {
        self.core()
            .faults
            .lease
            .entry((lease.clone(), op))
            .or_default()
            .push_back(fault);
    }
    /// The reaper runs now.
    fn reap(&self) {
        self.core().reap(Instant::now());
    }
}

fn name(lease: &LeaseId) -> String {
    InstanceName::for_lease(lease).as_str().to_owned()
}

fn tier(trust: Trust) -> TierSpec {
    TierSpec {
        label: "t".into(),
        image: "runner:tier-image".into(),
        command: vec!["/run.sh".into()],
        trust,
        shm: ByteSize(0),
        network: None,
        env: vec![("TIER".into(), "t".into())],
        sticky_disks: Vec::new(),
        actions_cache: None,
        docker_image_store: false,
        min_runner_version: None,
        host: Default::default(),
        pids_limit: None,
    }
}

fn job(request: i64, event: &str) -> Job {
    Job {
        request_id: RequestId(request),
        run_id: 1,
        event: event.into(),
        owner: "octo".into(),
        repository: "repo".into(),
        workflow_ref: "octo/repo/.github/workflows/ci.yml@refs/heads/main".into(),
    }
}

fn custody(runner: &Runner) -> BTreeSet<LeaseId> {
    runner.custody_leases().into_iter().collect()
}

async fn sleep(d: Duration) {
    tokio::time::sleep(d).await;
}

// ======================= 7.A Launch =======================

#[tokio::test]
async fn a_launch_mints_a_registration_and_starts_an_instance_sized_from_the_lease_with_the_tier_image()
 {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 7).await;

    assert!(w.bound(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Launching);
    let config = w.core().regs[&name(&lease.id)].config.clone();
    let specs = w.fake.specs();
    assert_eq!(specs.len(), 1);
    let spec = &specs[0];
    assert_eq!(spec.image, "runner:tier-image");
    assert_eq!(spec.command, vec!["/run.sh".to_owned()]);
    assert_eq!((spec.vcpu, spec.memory), (2, ByteSize(1 << 30)));
    assert_eq!(spec.jit_config.expose(), config);
    assert!(w.fake.instance(&name(&lease.id)).unwrap().may_run());
    assert!(r.holding());
}

#[tokio::test]
async fn the_tiers_trust_decides_and_the_jobs_event_neither_downgrades_nor_upgrades_it() {
    let w = World::new();
    let r = w.runner();
    let trusted = w.reserve(1);
    r.launch(
        trusted.clone(),
        tier(Trust::Trusted),
        job(1, "pull_request"),
    )
    .await
    .expect("a trusted tier runs whatever the event");
    assert!(w.exists(&trusted.id));

    let untrusted = w.reserve(2);
    let err = r
        .launch(untrusted.clone(), tier(Trust::Untrusted), job(2, "push"))
        .await
        .expect_err("an untrusted tier is refused on a host-sharing provider");
    assert!(!err.is_custody());
    assert!(
        err.to_string().contains("--isolated-containers"),
        "the refusal names the flag that allows it: {err}"
    );
    assert!(!w.bound(&untrusted.id));
    assert!(!w.exists(&untrusted.id));
    assert_eq!(w.fake.count(Operation::Create), 1);

    // The operator says the containers are isolated by other means: the
    // same tier runs.
    let isolated = w.runner_with(RunnerOptions {
        isolated_containers: true,
        ..RunnerOptions::default()
    });
    let third = w.reserve(3);
    isolated
        .launch(
            third.clone(),
            tier(Trust::Untrusted),
            job(3, "pull_request"),
        )
        .await
        .expect("an untrusted tier runs where the operator vouches for the isolation");
    assert!(w.exists(&third.id));
}

#[tokio::test]
async fn two_launches_request_distinct_runner_names_each_named_after_its_lease() {
    let w = World::new();
    let r = w.runner();
    let a = w.launched(&r, 1).await;
    let b = w.launched(&r, 2).await;
    let mints: Vec<String> = w
        .plane
        .log()
        .into_iter()
        .filter(|l| l.starts_with("mint "))
        .collect();
    assert_eq!(
        mints,
        vec![
            format!("mint {} billet-{}", a.id, a.id.as_str()),
            format!("mint {} billet-{}", b.id, b.id.as_str()),
        ]
    );
    assert!(w.registered(&a.id) && w.registered(&b.id));
    assert_ne!(name(&a.id), name(&b.id));
}

#[tokio::test]
async fn a_lease_reserved_for_another_backend_is_refused_and_nothing_starts() {
    let w = World::new();
    let r = w.runner();
    let mut lease = w.reserve(1);
    lease.providers = vec!["ec2".into()];
    let err = r
        .launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
        .await
        .expect_err("refused");
    assert!(matches!(err, RunnerError::Failed(_)));
    assert!(!w.bound(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Assigned);
    assert!(
        w.plane.log().is_empty(),
        "no ledger or GitHub call: {:?}",
        w.plane.log()
    );
    assert!(w.fake.calls().is_empty());
    assert!(!r.holding());
}

#[tokio::test]
async fn a_launch_that_fails_after_creating_the_instance_finds_and_destroys_it() {
    let w = World::new();
    let r = w.runner();
    w.fake.fail_create_after_starting(1);
    let lease = w.reserve(1);
    let err = r
        .launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
        .await
        .expect_err("the create failed");
    assert!(matches!(err, RunnerError::Failed(_)), "{err}");
    let n = InstanceName::for_lease(&lease.id);
    assert_eq!(
        w.fake.calls(),
        vec![
            Call::CheckImage("runner:tier-image".into()),
            Call::Create(n.clone()),
            Call::Find(n.clone()),
            Call::Destroy(n)
        ]
    );
    assert!(!w.exists(&lease.id));
    assert!(!w.registered(&lease.id));
}

#[tokio::test]
async fn a_clean_launch_failure_destroys_nothing() {
    let w = World::new();
    let r = w.runner();
    w.fake.fail_next(Operation::Create, 1);
    let lease = w.reserve(1);
    r.launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
        .await
        .expect_err("the create failed");
    assert_eq!(w.fake.count(Operation::Destroy), 0);
    assert!(!w.registered(&lease.id), "its registration is removed");
}

#[tokio::test]
async fn the_instance_is_named_after_the_lease_not_after_githubs_runner_name() {
    let w = World::new();
    *w.plane.github_name.lock().unwrap() = Some("gh-runner-4711".into());
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    assert_eq!(w.fake.specs()[0].name, InstanceName::for_lease(&lease.id));
    assert!(w.exists(&lease.id));
    assert!(w.fake.instance("gh-runner-4711").is_none());
}

#[tokio::test]
async fn a_failed_mint_is_not_retried_and_starts_nothing() {
    let w = World::new();
    let r = w.runner();
    let lease = w.reserve(1);
    w.fault(&lease.id, LOp::Mint, Fault::Refuse);
    let err = r
        .launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
        .await
        .expect_err("the mint failed");
    assert!(matches!(err, RunnerError::Failed(_)), "{err}");
    let mints = w
        .plane
        .log()
        .iter()
        .filter(|l| l.starts_with("mint "))
        .count();
    assert_eq!(mints, 1, "the mint is asked once and never again");
    assert_eq!(w.fake.count(Operation::Create), 0);
    assert!(!r.holding());
}

#[tokio::test]
async fn a_host_running_the_leases_second_choice_backend_runs_it() {
    let w = World::new();
    let r = w.runner();
    let mut lease = w.reserve(1);
    lease.providers = vec!["ec2".into(), "docker".into()];
    r.launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
        .await
        .expect("docker is in the list");
    assert!(w.exists(&lease.id));
}

#[tokio::test]
async fn a_host_whose_backend_is_not_in_the_leases_list_refuses_before_starting_anything() {
    let w = World::new();
    let r = w.runner();
    let mut lease = w.reserve(1);
    lease.providers = vec!["ec2".into(), "firecracker".into()];
    let err = r
        .launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
        .await
        .expect_err("refused");
    assert!(!err.is_custody());
    assert!(!w.bound(&lease.id));
    assert!(!w.core().mint_attempts.contains_key(&lease.id));
    assert!(w.fake.calls().is_empty());
}

#[tokio::test]
async fn the_guest_is_sized_from_the_lease() {
    let w = World::new();
    let r = w.runner();
    let mut lease = w.reserve(1);
    lease.vcpu = 6;
    lease.memory = ByteSize(12 << 30);
    r.launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
        .await
        .unwrap();
    let spec = &w.fake.specs()[0];
    assert_eq!((spec.vcpu, spec.memory), (6, ByteSize(12 << 30)));
}

#[tokio::test(start_paused = true)]
async fn an_ambiguous_launch_carries_its_first_absent_observation_into_custody() {
    let w = World::new();
    let r = w.runner();
    w.fake.fail_next(Operation::Create, 1);
    let lease = w.reserve(1);
    let err = r
        .launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
        .await
        .expect_err("create failed");
    assert!(
        err.is_custody(),
        "an absence never seen before proves nothing yet: {err}"
    );
    sleep(STRAY_GRACE + Duration::from_secs(1)).await;
    // The first tend after the grace: the absence began at launch, not now.
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert!(!r.holding());
}

#[tokio::test(start_paused = true)]
async fn an_ambiguous_launch_carries_its_positive_observation_into_custody() {
    let w = World::new();
    let r = w.runner();
    w.fake.fail_create_after_starting(1);
    w.fake.fail_next(Operation::Destroy, 1);
    let lease = w.reserve(1);
    let err = r
        .launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
        .await
        .expect_err("create failed");
    assert!(err.is_custody(), "{err}");
    assert!(w.exists(&lease.id));
    w.fake.remove_behind_back(&name(&lease.id));
    // Seen during cleanup, so its absence is proof at once: no grace.
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert!(!r.holding());
}

#[tokio::test]
async fn a_failed_launch_whose_registration_cannot_be_removed_leaves_compute_untouched_until_it_is()
{
    let w = World::new();
    let r = w.runner();
    w.fake.fail_create_after_starting(1);
    let lease = w.reserve(1);
    w.fault(&lease.id, LOp::RemoveRunner, Fault::Refuse);
    let err = r
        .launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
        .await
        .expect_err("create failed");
    assert!(err.is_custody(), "{err}");
    assert_eq!(
        w.fake.calls(),
        vec![
            Call::CheckImage("runner:tier-image".into()),
            Call::Create(InstanceName::for_lease(&lease.id))
        ],
        "compute is not touched while routing remains"
    );
    assert!(w.registered(&lease.id));
    assert!(w.exists(&lease.id));

    r.tend().await.unwrap();
    assert!(!w.registered(&lease.id));
    assert!(!w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    let removals: Vec<String> = w
        .plane
        .log()
        .into_iter()
        .filter(|l| l.starts_with("remove "))
        .collect();
    assert_eq!(
        removals.last().unwrap(),
        &format!("remove {} after 0 destroys", lease.id),
        "routing goes before compute"
    );
    assert_eq!(w.destroys_of(&lease.id), 1);
}

#[tokio::test]
async fn after_a_restart_a_failed_launchs_registration_goes_before_its_compute_and_destroy_answers_custody_meanwhile()
 {
    let w = World::new();
    let first = w.runner();
    w.fake.fail_create_after_starting(1);
    let lease = w.reserve(3);
    w.fault(&lease.id, LOp::RemoveRunner, Fault::Refuse);
    first
        .launch(lease.clone(), tier(Trust::Trusted), job(3, "push"))
        .await
        .expect_err("create failed");
    drop(first);

    let r = w.runner();
    r.recover().await.unwrap();
    assert_eq!(custody(&r), BTreeSet::from([lease.id.clone()]));
    w.fault(&lease.id, LOp::RemoveRunner, Fault::Refuse);
    let err = r
        .destroy(RequestId(3), &DestroyOrder::scale_down())
        .await
        .expect_err("the registration is still there");
    assert!(err.is_custody(), "{err}");
    assert!(w.exists(&lease.id), "compute waits for routing");
    assert_eq!(w.destroys_of(&lease.id), 0);

    r.destroy(RequestId(3), &DestroyOrder::scale_down())
        .await
        .unwrap();
    assert!(!w.registered(&lease.id));
    assert!(!w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert!(!r.holding());
}

/// The launch record says created once the instance exists, while it
/// starts. A process killed between the two leaves a record saying created
/// and an instance that never ran (`created`): it is an unconfirmed launch
/// like one killed mid-create, asked about at GitHub and, idle, torn down
/// and released `failed`, not adopted as a job (adopted, it would have
/// ended `done` with no job run).
#[tokio::test]
async fn after_a_restart_an_instance_journaled_created_that_never_started_is_torn_down_failed() {
    let w = World::new();
    let lease = w.launching_lease(23);
    let runner_name = name(&lease.id);
    let registration = w
        .core()
        .mint(&lease.id, Epoch(1), &runner_name)
        .expect("minted");
    w.journal
        .put_launch(&LaunchRecord {
            lease: lease.id.as_str().to_owned(),
            epoch: 1,
            request_id: 23,
            instance: runner_name.clone(),
            runner_id: registration.runner_id,
            runner_name: registration.runner_name,
            created: true,
        })
        .await
        .unwrap();
    w.put_instance(&runner_name, true);
    assert!(w.fake.set_state(&runner_name, InstanceState::Created));

    let r = w.runner();
    r.recover().await.unwrap();
    r.tend().await.unwrap();

    assert!(!w.registered(&lease.id), "the runner is still routable");
    assert!(!w.exists(&lease.id), "the instance that never ran was kept");
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert!(!r.holding());
}

/// A launch carrying its registration creates its instance beside the
/// launch record's sync and its bind, and starts it only once both hold.
/// A process killed in between leaves an instance that never started,
/// bound here, with no launch record: it is torn down and its
/// registration removed, never adopted as a job (a `created` instance
/// runs nothing and billet never starts it later).
#[tokio::test]
async fn after_a_restart_an_unstarted_instance_with_no_launch_record_is_torn_down_not_adopted() {
    let w = World::new();
    let lease = w.launching_lease(24);
    let runner_name = name(&lease.id);
    w.core()
        .mint(&lease.id, Epoch(1), &runner_name)
        .expect("minted");
    w.put_instance(&runner_name, true);
    assert!(w.fake.set_state(&runner_name, InstanceState::Created));

    let r = w.runner();
    r.recover().await.unwrap();
    r.tend().await.unwrap();

    assert!(!w.registered(&lease.id), "the runner is still routable");
    assert!(!w.exists(&lease.id), "the instance that never ran was kept");
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert!(!r.holding());
}

/// A process killed mid-create never learned whether its instance started;
/// the next one asks GitHub through the removal itself. GitHub refuses to
/// remove a runner that has taken its job (JobStillRunning), so that runner
/// is kept as a job; the idle one's removal succeeds and it is torn down.
#[tokio::test]
async fn after_a_restart_an_unconfirmed_launch_keeps_a_runner_github_calls_busy_and_tears_down_an_idle_one()
 {
    let w = World::new();
    let mut leases = Vec::new();
    for request in [21, 22] {
        let lease = w.launching_lease(request);
        let runner_name = name(&lease.id);
        let registration = w
            .core()
            .mint(&lease.id, Epoch(1), &runner_name)
            .expect("minted");
        w.journal
            .put_launch(&LaunchRecord {
                lease: lease.id.as_str().to_owned(),
                epoch: 1,
                request_id: request,
                instance: runner_name.clone(),
                runner_id: registration.runner_id,
                runner_name: registration.runner_name,
                created: false,
            })
            .await
            .unwrap();
        w.put_instance(&runner_name, true);
        leases.push(lease);
    }
    let (busy, idle) = (&leases[0], &leases[1]);
    w.core().job_starts(&name(&busy.id));

    let r = w.runner();
    r.recover().await.unwrap();
    r.tend().await.unwrap();

    assert!(w.exists(&busy.id), "the busy runner's job was killed");
    assert!(w.registered(&busy.id), "GitHub removed a busy runner");
    assert_eq!(w.destroys_of(&busy.id), 0);
    assert!(!w.phase(&busy.id).is_terminal());
    assert!(
        custody(&r).contains(&busy.id),
        "the busy runner is not held"
    );

    assert!(!w.registered(&idle.id), "the idle runner is still routable");
    assert!(!w.exists(&idle.id), "the idle runner was kept");
    assert_eq!(w.phase(&idle.id), Phase::Failed);
    assert_eq!(
        reason(&w, &idle.id).as_deref(),
        Some("launch_interrupted"),
        "the idle runner of an interrupted launch ends saying so"
    );
}

/// The node was killed before it recorded that its runner started; while
/// it was down the runner took its job, finished it (GitHub removed the
/// ephemeral registration) and exited 0. Its job's end is its lease's:
/// released `done`, not failed as an idle runner.
#[tokio::test]
async fn after_a_restart_an_unconfirmed_launch_whose_runner_finished_its_job_ends_done() {
    let w = World::new();
    let lease = w.launching_lease(25);
    let runner_name = name(&lease.id);
    let registration = w
        .core()
        .mint(&lease.id, Epoch(1), &runner_name)
        .expect("minted");
    w.journal
        .put_launch(&LaunchRecord {
            lease: lease.id.as_str().to_owned(),
            epoch: 1,
            request_id: 25,
            instance: runner_name.clone(),
            runner_id: registration.runner_id,
            runner_name: registration.runner_name,
            created: false,
        })
        .await
        .unwrap();
    w.put_instance(&runner_name, false);
    w.core().job_starts(&runner_name);
    w.core()
        .job_ends(&runner_name, fakes::Job::Completed, "succeeded");

    let r = w.runner();
    r.recover().await.unwrap();
    r.tend().await.unwrap();

    assert!(!w.exists(&lease.id));
    assert_eq!(
        w.phase(&lease.id),
        Phase::Done,
        "{:?}",
        reason(&w, &lease.id)
    );
    assert_eq!(reason(&w, &lease.id), None);
    assert!(!r.holding());
}

/// The node was killed mid-start: its launch is journaled, its lease
/// launching, and no instance exists. The next process holds the lease
/// until the registration is removed and the stray grace has passed, and
/// ends it `failed` saying why: `launch_interrupted`.
#[tokio::test(start_paused = true)]
async fn a_launch_interrupted_before_its_instance_existed_ends_failed_launch_interrupted() {
    let w = World::new();
    let lease = w.launching_lease(26);
    let runner_name = name(&lease.id);
    w.journal
        .put_launch(&LaunchRecord {
            lease: lease.id.as_str().to_owned(),
            epoch: 1,
            request_id: 26,
            instance: runner_name.clone(),
            runner_id: 0,
            runner_name: String::new(),
            created: false,
        })
        .await
        .unwrap();
    let r = w.runner();
    r.recover().await.unwrap();
    sleep(STRAY_GRACE + Duration::from_secs(1)).await;
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert_eq!(reason(&w, &lease.id).as_deref(), Some("launch_interrupted"));
    assert!(!r.holding());
}

#[tokio::test]
async fn an_unconfirmed_cleanup_holds_the_capacity() {
    let w = World::new();
    let r = w.runner();
    w.fake.fail_create_after_starting(1);
    w.fake.set_destroy_mode(DestroyMode::RequestAndKeep);
    let lease = w.reserve(1);
    let err = r
        .launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
        .await
        .expect_err("create failed");
    assert!(err.is_custody(), "{err}");
    assert!(!w.phase(&lease.id).is_terminal());
    assert_eq!(custody(&r), BTreeSet::from([lease.id.clone()]));
}

#[tokio::test]
async fn a_confirmed_cleanup_holds_nothing() {
    let w = World::new();
    let r = w.runner();
    w.fake.fail_create_after_starting(1);
    let lease = w.reserve(1);
    let err = r
        .launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
        .await
        .expect_err("create failed");
    assert!(matches!(err, RunnerError::Failed(_)), "{err}");
    assert!(!r.holding());
    assert!(w.journal.custody().await.unwrap().is_empty());
    assert!(w.journal.launches().await.unwrap().is_empty());
}

#[tokio::test]
async fn a_redelivered_job_for_an_adopted_request_is_not_launched_again() {
    let w = World::new();
    let first = w.runner();
    let lease = w.launched(&first, 5).await;
    drop(first);
    let r = w.runner();
    r.recover().await.unwrap();
    assert_eq!(custody(&r), BTreeSet::from([lease.id.clone()]));

    let again = w.reserve(5);
    let err = r
        .launch(again.clone(), tier(Trust::Trusted), job(5, "push"))
        .await
        .expect_err("the request already has compute here");
    assert!(!err.is_custody());
    assert!(!w.bound(&again.id));
    assert!(!w.core().mint_attempts.contains_key(&again.id));
    assert_eq!(w.fake.count(Operation::Create), 1);
}

#[tokio::test(start_paused = true)]
async fn keep_alive_renews_a_lease_while_its_create_is_still_running() {
    let w = World::new();
    let r = w.runner();
    let stop = CancellationToken::new();
    let ka = tokio::spawn({
        let r = r.clone();
        let stop = stop.clone();
        async move { r.keep_alive(stop).await }
    });
    w.fake.block(Operation::Create);
    let lease = w.reserve(1);
    let launch = tokio::spawn({
        let r = r.clone();
        let lease = lease.clone();
        async move { r.launch(lease, tier(Trust::Trusted), job(1, "push")).await }
    });
    while w.fake.count(Operation::Create) == 0 {
        sleep(Duration::from_millis(10)).await;
    }
    sleep(fakes::TTL * 4).await;
    w.reap();
    assert_eq!(
        w.phase(&lease.id),
        Phase::Launching,
        "renewed while create runs, so the reaper leaves it"
    );
    assert!(w.plane.heartbeats() >= 3);
    w.fake.unblock(Operation::Create);
    launch.await.unwrap().unwrap();
    stop.cancel();
    ka.await.unwrap();
}

// ======================= 7.B Destroy =======================

#[tokio::test]
async fn destroy_removes_what_was_started_once_and_repeats_and_unknown_requests_succeed() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    w.fake.exit(&name(&lease.id), 0, false); // the ephemeral runner exits after its job
    r.destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
        .await
        .unwrap();
    assert!(!w.exists(&lease.id));
    r.destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
        .await
        .unwrap();
    r.destroy(RequestId(999), &DestroyOrder::scale_down())
        .await
        .unwrap();
    assert_eq!(w.fake.count(Operation::Destroy), 1);
    assert!(!r.holding());
}

#[tokio::test]
async fn an_accepted_teardown_holds_the_capacity_until_the_compute_is_provably_gone() {
    let w = World::new();
    let r = w.runner();
    w.fake.set_destroy_mode(DestroyMode::RequestAndKeep);
    let lease = w.launched(&r, 1).await;
    let err = r
        .destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
        .await
        .unwrap_err();
    assert!(err.is_custody(), "{err}");
    r.tend().await.unwrap();
    assert!(!w.phase(&lease.id).is_terminal(), "still there: still held");
    assert_eq!(w.phase(&lease.id), Phase::Teardown);
    assert_eq!(custody(&r), BTreeSet::from([lease.id.clone()]));
    w.fake.remove_behind_back(&name(&lease.id));
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Done);
    assert!(!r.holding());
}

#[tokio::test(start_paused = true)]
async fn a_fast_accepted_teardown_releases_on_the_first_absent_inventory() {
    let w = World::new();
    let r = w.runner();
    w.fake.set_destroy_mode(DestroyMode::RequestAndRemove);
    let lease = w.launched(&r, 1).await;
    w.fake.exit(&name(&lease.id), 0, false); // the ephemeral runner exits after its job
    assert!(
        r.destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
            .await
            .unwrap_err()
            .is_custody()
    );
    r.tend().await.unwrap();
    assert!(w.phase(&lease.id).is_terminal());
    assert!(!r.holding());
}

#[tokio::test(start_paused = true)]
async fn a_host_teardown_keeps_its_launch_observation() {
    let w = World::new();
    let r = w.runner();
    w.fake.set_destroy_mode(DestroyMode::RequestAndKeep);
    let lease = w.launched(&r, 1).await;
    assert!(
        r.destroy(RequestId(1), &DestroyOrder::scale_down())
            .await
            .unwrap_err()
            .is_custody()
    );
    // Gone before any tend saw it: the launch on this host is the sighting.
    w.fake.remove_behind_back(&name(&lease.id));
    r.tend().await.unwrap();
    assert!(w.phase(&lease.id).is_terminal());
    // One inventory per tend, and no find for the entry: the one find is
    // the scale-down's own read of the instance.
    assert_eq!(w.fake.count(Operation::List), 1);
    assert_eq!(w.fake.count(Operation::Find), 1);
}

#[tokio::test(start_paused = true)]
async fn a_provider_error_resets_a_strays_run_of_absences() {
    let w = World::new();
    let r = w.runner();
    w.fake.fail_next(Operation::Create, 1);
    let lease = w.reserve(1);
    assert!(
        r.launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
            .await
            .unwrap_err()
            .is_custody()
    );
    sleep(Duration::from_secs(200)).await;
    w.fake.fail_next(Operation::List, 1);
    r.tend().await.expect_err("list failed");
    sleep(Duration::from_secs(150)).await;
    r.tend().await.unwrap();
    assert!(
        !w.phase(&lease.id).is_terminal(),
        "350 s since the first miss, but the error restarted the run"
    );
    sleep(STRAY_GRACE + Duration::from_secs(1)).await;
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Failed);
}

#[tokio::test]
async fn a_second_destroy_for_held_compute_still_reports_custody() {
    let w = World::new();
    let r = w.runner();
    w.fake.set_destroy_mode(DestroyMode::RequestAndKeep);
    let lease = w.launched(&r, 1).await;
    assert!(
        r.destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
            .await
            .unwrap_err()
            .is_custody()
    );
    assert!(
        r.destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
            .await
            .unwrap_err()
            .is_custody()
    );
    assert!(!w.phase(&lease.id).is_terminal());
    w.fake.remove_behind_back(&name(&lease.id));
    r.destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
        .await
        .unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Done);
    assert!(!r.holding());
}

/// A lease taken into custody while its runner runs (a launch whose
/// result the plane never acknowledged) is one row of what the node holds,
/// in custody, for status and metrics alike; and still one once its job's
/// completion leaves the runner ending.
#[tokio::test]
async fn a_running_lease_taken_into_custody_is_held_once_in_custody() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    assert_eq!(r.held().len(), 1);
    assert_eq!(r.held()[0].state, HeldState::Running);
    r.assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    let held = r.held();
    assert_eq!(held.len(), 1, "one row per lease: {held:?}");
    assert_eq!(held[0].lease, lease.id);
    assert_eq!(held[0].state, HeldState::Custody, "{held:?}");
    assert!(
        held[0].runner.is_some(),
        "the runner's name is kept: {held:?}"
    );
    let err = r
        .destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
        .await
        .unwrap_err();
    assert!(err.is_custody(), "{err}");
    let held = r.held();
    assert_eq!(held.len(), 1, "one row per lease: {held:?}");
    assert_eq!(held[0].state, HeldState::Ending, "{held:?}");
}

/// A Launch of a lease whose runner already works here, at another epoch
/// than the one it holds, is not what the node holds: it is answered BUSY
/// (the plane keeps the lease), and nothing is minted, created or
/// destroyed; the same epoch again is still answered OK. The same holds
/// once the lease is in custody.
#[tokio::test]
async fn a_launch_at_another_epoch_of_a_lease_whose_runner_works_is_answered_busy_and_starts_nothing()
 {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    let creates = || {
        w.fake
            .calls()
            .iter()
            .filter(|c| matches!(c, Call::Create(_)))
            .count()
    };
    let (mints, created) = (w.plane.count("mint "), creates());
    for held in [false, true] {
        if held {
            r.assume_custody(&lease.id, lease.epoch, RequestId(1))
                .await
                .unwrap();
        }
        let mut higher = lease.clone();
        higher.epoch = Epoch(lease.epoch.0 + 1);
        let err = r
            .launch(higher, tier(Trust::Trusted), job(1, "push"))
            .await
            .expect_err("another epoch is not what the node holds");
        assert!(
            matches!(err, RunnerError::Busy { held: false, .. }),
            "custody {held}: {err}"
        );
        let message = err.to_string();
        assert!(
            message.contains("epoch 1") && message.contains("epoch 2"),
            "both epochs named: {message}"
        );
        r.launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
            .await
            .expect("the same epoch again is what the node holds");
    }
    assert_eq!(w.plane.count("mint "), mints, "{:?}", w.plane.log());
    assert_eq!(creates(), created);
    assert!(w.exists(&lease.id));
    assert_eq!(w.destroys_of(&lease.id), 0);
    assert_eq!(r.held().len(), 1);
}

#[tokio::test]
async fn a_request_with_both_custody_and_a_running_instance_still_stops_the_running_one() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    r.assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    r.destroy(RequestId(1), &DestroyOrder::scale_down())
        .await
        .unwrap();
    assert!(!w.exists(&lease.id));
    assert!(w.destroys_of(&lease.id) >= 1);
    assert!(!w.registered(&lease.id));
    assert!(!r.holding());
}

#[tokio::test]
async fn an_accepted_teardown_of_a_finished_job_records_it_done() {
    let w = World::new();
    let r = w.runner();
    w.fake.set_destroy_mode(DestroyMode::RequestAndRemove);
    let lease = w.launched(&r, 1).await;
    w.fake.exit(&name(&lease.id), 0, false); // the ephemeral runner exits after its job
    assert!(
        r.destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
            .await
            .unwrap_err()
            .is_custody()
    );
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Done);
}

#[tokio::test]
async fn an_instance_that_will_not_die_stays_tracked_and_the_retry_removes_it() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    w.fake.fail_next(Operation::Destroy, 1);
    w.fake.exit(&name(&lease.id), 0, false); // the ephemeral runner exits after its job
    let err = r
        .destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
        .await
        .unwrap_err();
    assert!(matches!(err, RunnerError::Failed(_)), "{err}");
    assert!(w.exists(&lease.id));
    assert!(r.holding());
    r.destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
        .await
        .unwrap();
    assert_eq!(w.destroys_of(&lease.id), 2);
    assert!(!w.exists(&lease.id));
    assert!(!r.holding());
}

#[tokio::test]
async fn a_completion_ends_an_adoption() {
    let w = World::new();
    let first = w.runner();
    let lease = w.launched(&first, 4).await;
    drop(first);
    let r = w.runner();
    r.recover().await.unwrap();
    assert!(r.holding());
    w.fake.exit(&name(&lease.id), 0, false); // the ephemeral runner exits after its job
    r.destroy(RequestId(4), &DestroyOrder::completion("succeeded"))
        .await
        .unwrap();
    assert!(!w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Done);
    assert!(!r.holding());
}

#[tokio::test]
async fn a_completion_clears_both_the_running_and_the_held_compute_of_its_request() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    r.assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    w.fake.exit(&name(&lease.id), 0, false); // the ephemeral runner exits after its job
    r.destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
        .await
        .unwrap();
    assert!(!w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Done);
    assert!(!r.holding(), "neither half is left");
}

#[tokio::test]
async fn a_completion_clears_every_custody_entry_for_its_request() {
    let w = World::new();
    let a = w.launching_lease(9);
    let b = w.launching_lease(9);
    w.put_instance(&name(&a.id), true);
    w.put_instance(&name(&b.id), true);
    let r = w.runner();
    r.recover().await.unwrap();
    assert_eq!(custody(&r), BTreeSet::from([a.id.clone(), b.id.clone()]));
    w.fake.exit(&name(&a.id), 0, false); // the ephemeral runners exit after their job
    w.fake.exit(&name(&b.id), 0, false);
    r.destroy(RequestId(9), &DestroyOrder::completion("succeeded"))
        .await
        .unwrap();
    assert!(!w.exists(&a.id) && !w.exists(&b.id));
    assert!(w.phase(&a.id).is_terminal() && w.phase(&b.id).is_terminal());
    assert!(!r.holding());
}

#[tokio::test]
async fn a_custody_side_failure_does_not_turn_the_running_halfs_success_into_an_error() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    r.assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    w.fault(&lease.id, LOp::Heartbeat, Fault::Refuse);
    w.fake.exit(&name(&lease.id), 0, false); // the ephemeral runner exits after its job
    r.destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
        .await
        .expect("the running half stopped");
    assert!(!w.exists(&lease.id));
    r.tend().await.unwrap();
    assert!(w.phase(&lease.id).is_terminal());
    assert!(!r.holding());
}

// ----- a Destroy never kills a busy runner without authority -----

#[tokio::test(start_paused = true)]
async fn a_scale_down_of_a_runner_that_has_just_taken_its_job_answers_busy_and_destroys_nothing() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    // GitHub's listing still shows it idle; its own record has the job.
    w.core().job_starts(&name(&lease.id));
    let err = r
        .destroy(RequestId(1), &DestroyOrder::scale_down())
        .await
        .expect_err("busy");
    assert!(
        matches!(err, RunnerError::Busy { held: false, .. }),
        "{err}"
    );
    assert!(!err.is_custody(), "the plane keeps the lease");
    assert!(w.exists(&lease.id), "nothing killed");
    assert_eq!(w.destroys_of(&lease.id), 0);
    assert!(w.registered(&lease.id));
    assert!(!w.phase(&lease.id).is_terminal(), "the lease is held");
    assert!(r.holding());
}

/// GitHub's busy flag lags behind the job, so it may accept the removal of
/// a runner at work. The runner's job process is the node's own evidence:
/// the scale-down is answered busy and nothing is destroyed, though the
/// registration is gone; the job runs to its end and its lease ends `done`.
#[tokio::test(start_paused = true)]
async fn a_scale_down_github_accepts_while_the_job_process_runs_answers_busy_and_destroys_nothing()
{
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    let runner = name(&lease.id);
    w.core().job_starts(&runner);
    w.fake.set_working(&runner, true);
    w.core().faults.removal_ignores_job = true;
    let mints = w.plane.count("mint");
    let err = r
        .destroy(RequestId(1), &DestroyOrder::scale_down())
        .await
        .expect_err("busy");
    assert!(
        matches!(err, RunnerError::Busy { held: false, .. }),
        "{err}"
    );
    assert!(w.exists(&lease.id), "a runner at work was destroyed");
    assert_eq!(w.destroys_of(&lease.id), 0);
    assert!(!w.registered(&lease.id), "GitHub removed the registration");
    assert!(!w.phase(&lease.id).is_terminal(), "the lease is held");
    // Asked again, still busy, and nothing is minted.
    let err = r
        .destroy(RequestId(1), &DestroyOrder::scale_down())
        .await
        .expect_err("busy");
    assert!(matches!(err, RunnerError::Busy { .. }), "{err}");
    assert_eq!(w.plane.count("mint"), mints, "{:?}", w.plane.log());
    // The job ends; the ephemeral runner exits; its lease ends `done`.
    w.core()
        .job_ends(&runner, fakes::Job::Completed, "succeeded");
    w.fake.set_working(&runner, false);
    w.fake.exit(&runner, 0, false);
    r.tend().await.unwrap();
    assert!(!w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Done);
    assert_eq!(reason(&w, &lease.id), None);
    assert!(!r.holding());
}

/// The same lag in a drain: a runner whose removal GitHub accepts while its
/// job process runs is kept to finish its job, not retired.
#[tokio::test]
async fn a_drain_keeps_a_runner_whose_job_process_runs_though_github_accepted_its_removal() {
    let w = World::new();
    let r = w.runner();
    let idle = w.launched(&r, 1).await;
    let busy = w.launched(&r, 2).await;
    w.core().job_starts(&name(&busy.id));
    w.fake.set_working(&name(&busy.id), true);
    w.core().faults.removal_ignores_job = true;
    r.start_draining();
    assert_eq!(r.retire_idle_runners().await, 1);
    assert!(!w.exists(&idle.id), "the idle runner was kept");
    assert_eq!(reason(&w, &idle.id).as_deref(), Some("drained"));
    assert!(w.exists(&busy.id), "a runner at work was retired");
    assert_eq!(w.destroys_of(&busy.id), 0);
    assert!(!w.phase(&busy.id).is_terminal());
    // Online now: not asked about again.
    let removals = w.plane.count("remove ");
    r.retire_idle_runners().await;
    assert_eq!(w.plane.count("remove "), removals, "{:?}", w.plane.log());
}

/// The same lag at the start deadline: a runner at work is online, not torn
/// down, whatever GitHub answered the removal.
#[tokio::test(start_paused = true)]
async fn a_runner_whose_job_process_runs_at_the_start_deadline_is_online_though_github_accepted_its_removal()
 {
    let w = World::new();
    let r = w.runner_with(RunnerOptions {
        start_deadline: Some(Duration::from_secs(60)),
        ..RunnerOptions::default()
    });
    let lease = w.launched(&r, 1).await;
    w.core().job_starts(&name(&lease.id));
    w.fake.set_working(&name(&lease.id), true);
    w.core().faults.removal_ignores_job = true;
    sleep(Duration::from_secs(61)).await;
    r.tend().await.unwrap();
    sleep(Duration::from_secs(600)).await;
    r.tend().await.unwrap();
    assert!(w.exists(&lease.id), "a runner at work was torn down");
    assert_eq!(w.destroys_of(&lease.id), 0);
    assert!(!w.phase(&lease.id).is_terminal());
}

/// The same lag for a runner the node holds in custody (adopted after a
/// restart, or its launch unacknowledged): a scale-down GitHub accepts while
/// its job process runs keeps it, held, answered BUSY; and a restart then
/// past the start deadline, its registration gone, still finds it at work
/// and keeps it. Its job's completion then ends the lease `done`.
#[tokio::test(start_paused = true)]
async fn a_held_runner_whose_job_process_runs_is_kept_by_a_scale_down_and_the_start_deadline_though_github_accepted_its_removal()
 {
    let w = World::new();
    let options = RunnerOptions {
        start_deadline: Some(Duration::from_secs(60)),
        ..RunnerOptions::default()
    };
    let r = w.runner_with(options.clone());
    let lease = w.launched(&r, 1).await;
    w.core().job_starts(&name(&lease.id));
    w.fake.set_working(&name(&lease.id), true);
    w.core().faults.removal_ignores_job = true;
    let r = w.runner_with(options);
    r.recover().await.unwrap();
    assert_eq!(custody(&r), BTreeSet::from([lease.id.clone()]));

    let err = r
        .destroy(RequestId(1), &DestroyOrder::scale_down())
        .await
        .expect_err("a runner at work is kept");
    assert!(err.is_busy() && err.is_custody(), "{err:?}");
    assert!(!w.registered(&lease.id), "GitHub accepted the removal");
    sleep(Duration::from_secs(61)).await;
    r.tend().await.unwrap();
    sleep(Duration::from_secs(600)).await;
    r.tend().await.unwrap();
    assert!(w.exists(&lease.id), "a runner at work was torn down");
    assert_eq!(w.destroys_of(&lease.id), 0);
    assert!(!w.phase(&lease.id).is_terminal());

    w.fake.set_working(&name(&lease.id), false);
    w.fake.exit(&name(&lease.id), 0, false);
    r.destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
        .await
        .unwrap();
    r.tend().await.unwrap();
    assert!(!w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Done);
    assert!(!r.holding());
}

#[tokio::test(start_paused = true)]
async fn a_scale_down_whose_registration_removal_fails_destroys_nothing_and_asks_to_be_sent_again()
{
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    w.fault(&lease.id, LOp::RemoveRunner, Fault::Refuse);
    let err = r
        .destroy(RequestId(1), &DestroyOrder::scale_down())
        .await
        .expect_err("the plane was not reached");
    assert!(matches!(err, RunnerError::Failed(_)), "{err}");
    assert!(w.exists(&lease.id) && w.registered(&lease.id));
    assert_eq!(w.destroys_of(&lease.id), 0);
    // Sent again once the plane answers: an idle runner goes, routing first.
    r.destroy(RequestId(1), &DestroyOrder::scale_down())
        .await
        .unwrap();
    assert!(!w.exists(&lease.id) && !w.registered(&lease.id));
}

#[tokio::test(start_paused = true)]
async fn a_completion_while_the_runner_still_works_leaves_it_the_post_job_grace_and_releases_done_when_it_exits()
 {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    let err = r
        .destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
        .await
        .expect_err("still working");
    assert!(matches!(err, RunnerError::Busy { held: true, .. }), "{err}");
    assert!(err.is_custody(), "the node holds the lease");
    assert!(w.exists(&lease.id), "not killed");
    let held = r.held();
    assert_eq!(held[0].state, HeldState::Ending, "{held:?}");
    sleep(Duration::from_secs(60)).await;
    r.tend().await.unwrap();
    assert!(w.exists(&lease.id), "within the grace, still not killed");
    assert_eq!(w.destroys_of(&lease.id), 0);
    assert_eq!(w.phase(&lease.id), Phase::Teardown);
    // The runner finishes its post-job work and exits.
    w.fake.exit(&name(&lease.id), 0, false);
    r.tend().await.unwrap();
    assert!(!w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Done);
    assert!(w.fake.calls().iter().all(|c| !matches!(c, Call::Stop(..))));
    assert!(!r.holding());
}

#[tokio::test(start_paused = true)]
async fn a_runner_still_working_past_the_post_job_grace_is_stopped_sigterm_then_sigkill_and_released_failed_post_job_timeout()
 {
    let w = World::new();
    let r = w.runner_with(RunnerOptions {
        post_job_grace: Duration::from_secs(30),
        ..RunnerOptions::default()
    });
    let lease = w.launched(&r, 1).await;
    w.fake.ignore_sigterm(&name(&lease.id));
    assert!(
        r.destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
            .await
            .unwrap_err()
            .is_busy()
    );
    sleep(Duration::from_secs(31)).await;
    let began = Instant::now();
    r.tend().await.unwrap();
    assert!(
        began.elapsed() >= Duration::from_secs(10),
        "SIGKILL came before the stop timeout"
    );
    let instance = InstanceName::for_lease(&lease.id);
    assert!(
        w.fake
            .calls()
            .contains(&Call::Stop(instance, Duration::from_secs(10))),
        "{:?}",
        w.fake.calls()
    );
    assert!(!w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert_eq!(
        w.core().leases[&lease.id].failure_reason.as_deref(),
        Some("post_job_timeout")
    );
    assert!(!w.registered(&lease.id));
    assert!(!r.holding());
}

#[tokio::test(start_paused = true)]
async fn a_forced_destroy_ends_a_busy_runner_and_records_its_reason() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    w.core().job_starts(&name(&lease.id));
    r.destroy(RequestId(1), &DestroyOrder::forced("cancelled"))
        .await
        .unwrap();
    assert!(!w.exists(&lease.id), "force destroys regardless");
    assert_eq!(
        w.core().leases[&lease.id].failure_reason.as_deref(),
        Some("cancelled")
    );
    // GitHub still has the job on the runner: its removal is on the
    // backoff, kept in the journal for a restart.
    assert!(w.registered(&lease.id));
    assert!(
        w.journal
            .launches()
            .await
            .unwrap()
            .iter()
            .any(|l| l.lease == lease.id.as_str())
    );
}

#[tokio::test(start_paused = true)]
async fn a_completion_of_a_held_job_still_working_stays_ending_across_a_restart() {
    let w = World::new();
    let first = w.runner();
    let lease = w.launched(&first, 1).await;
    first
        .assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    let err = first
        .destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
        .await
        .unwrap_err();
    assert!(matches!(err, RunnerError::Busy { held: true, .. }), "{err}");
    drop(first);
    let r = w.runner();
    r.recover().await.unwrap();
    assert_eq!(r.held()[0].state, HeldState::Ending);
    sleep(POST_JOB_GRACE + Duration::from_secs(1)).await;
    r.tend().await.unwrap();
    assert!(!w.exists(&lease.id), "the grace ran on across the restart");
    assert_eq!(w.phase(&lease.id), Phase::Failed);
}

#[tokio::test(start_paused = true)]
async fn a_scale_down_answered_custody_keeps_its_teardown_across_a_restart_even_when_the_renewal_failed()
 {
    let w = World::new();
    let first = w.runner();
    let lease = w.launched(&first, 1).await;
    drop(first);
    // Adopted after a restart: held in custody as a job.
    let second = w.runner();
    second.recover().await.unwrap();
    assert_eq!(second.held()[0].state, HeldState::Custody);
    w.fault(&lease.id, LOp::Heartbeat, Fault::Refuse);
    let err = second
        .destroy(RequestId(1), &DestroyOrder::scale_down())
        .await
        .unwrap_err();
    assert!(err.is_custody(), "{err}");
    assert!(w.exists(&lease.id), "the renewal failed before the destroy");
    drop(second);
    let r = w.runner();
    r.recover().await.unwrap();
    assert_eq!(r.held()[0].state, HeldState::Discard, "{:?}", r.held());
    r.tend().await.unwrap();
    assert!(!w.exists(&lease.id), "the idle runner was torn down");
    assert!(!r.holding());
}

// ======================= 7.C Force release =======================

#[tokio::test]
async fn an_operators_force_release_ends_custody_at_the_next_tend() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    r.assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Custody, "visible in the ledger");
    w.core().leases.get_mut(&lease.id).unwrap().force_release = true;
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert!(!w.exists(&lease.id));
    assert!(!r.holding());
}

#[tokio::test]
async fn a_force_release_requested_before_a_restart_is_honoured_after_recovery() {
    let w = World::new();
    let first = w.runner();
    let lease = w.launched(&first, 1).await;
    first
        .assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    drop(first);
    w.core().leases.get_mut(&lease.id).unwrap().force_release = true;
    let r = w.runner();
    r.recover().await.unwrap();
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert!(!w.exists(&lease.id));
    assert!(!r.holding());
}

// ======================= 7.E Recover =======================

#[tokio::test]
async fn recover_never_touches_an_instance_billet_did_not_name() {
    let w = World::new();
    w.put_instance("someone-elses-container", false);
    let r = w.runner();
    r.recover().await.unwrap();
    assert_eq!(w.fake.count(Operation::Destroy), 0);
    assert!(w.fake.instance("someone-elses-container").is_some());
}

#[tokio::test]
async fn recover_fails_when_it_could_not_destroy_an_orphan() {
    let w = World::new();
    w.put_instance("billet-nobody", false);
    w.fake.fail_next(Operation::Destroy, 1);
    let r = w.runner();
    r.recover().await.expect_err("an orphan survived");
    assert!(w.fake.instance("billet-nobody").is_some());
}

#[tokio::test]
async fn recover_fails_when_the_provider_cannot_be_enumerated() {
    let w = World::new();
    let lease = w.launching_lease(1);
    w.put_instance(&name(&lease.id), true);
    w.fake.fail_next(Operation::List, 1);
    let r = w.runner();
    r.recover().await.expect_err("list failed");
    assert_eq!(w.fake.count(Operation::Destroy), 0);
    assert!(!r.holding());
}

#[tokio::test]
async fn a_stopped_instance_under_an_open_lease_is_destroyed_and_its_lease_released() {
    let w = World::new();
    let lease = w.launching_lease(1);
    w.put_instance(&name(&lease.id), false);
    let r = w.runner();
    r.recover().await.unwrap();
    r.tend().await.unwrap();
    assert!(!w.exists(&lease.id));
    assert!(w.phase(&lease.id).is_terminal());
    assert!(!r.holding());
}

#[tokio::test]
async fn recover_adopts_a_job_that_is_still_running() {
    let w = World::new();
    let lease = w.launching_lease(1);
    w.put_instance(&name(&lease.id), true);
    let r = w.runner();
    r.recover().await.unwrap();
    r.tend().await.unwrap();
    assert_eq!(custody(&r), BTreeSet::from([lease.id.clone()]));
    assert!(w.exists(&lease.id));
    assert_eq!(w.fake.count(Operation::Destroy), 0);
    assert_eq!(w.phase(&lease.id), Phase::Custody);
}

/// Compute adopted at start-up is charged like launched compute, so the
/// node's `held` (Hello, Instances, Sweep) covers it and the plane
/// places nothing on its capacity.
#[tokio::test]
async fn a_lease_adopted_by_recovery_counts_in_what_the_node_holds() {
    let w = World::new();
    let lease = w.launching_lease(1);
    w.put_instance(&name(&lease.id), true);
    let r = w.runner();
    assert_eq!(r.held_charge(), (0, 0));
    r.recover().await.unwrap();
    assert_eq!(custody(&r), BTreeSet::from([lease.id.clone()]));
    assert_eq!(r.held_charge(), (lease.vcpu, lease.memory.0));
}

/// So is quarantined compute a sweep adopts.
#[tokio::test(start_paused = true)]
async fn a_lease_adopted_by_a_sweep_counts_in_what_the_node_holds() {
    let w = World::new();
    let lease = w.launching_lease(1);
    w.put_instance(&name(&lease.id), true);
    sleep(fakes::TTL * 2).await;
    w.reap();
    let r = w.runner();
    let swept = r.sweep_inventory().await;
    swept.result.unwrap();
    assert_eq!(swept.listed, Some(vec![lease.id.clone()]));
    assert_eq!(custody(&r), BTreeSet::from([lease.id.clone()]));
    assert_eq!(r.held_charge(), (lease.vcpu, lease.memory.0));
}

#[tokio::test(start_paused = true)]
async fn an_adopted_lease_is_kept_alive() {
    let w = World::new();
    let lease = w.launching_lease(1);
    w.put_instance(&name(&lease.id), true);
    let r = w.runner();
    r.recover().await.unwrap();
    let stop = CancellationToken::new();
    let ka = tokio::spawn({
        let r = r.clone();
        let stop = stop.clone();
        async move { r.keep_alive(stop).await }
    });
    sleep(fakes::TTL * 4).await;
    w.reap();
    assert_eq!(w.phase(&lease.id), Phase::Launching, "not quarantined");
    assert!(w.expires(&lease.id) > Instant::now());
    stop.cancel();
    ka.await.unwrap();
}

/// A scale-down of an adopted runner at work: GitHub accepting the removal
/// does not end it while its job process runs; the node holds it on.
#[tokio::test]
async fn a_scale_down_of_an_adopted_runner_whose_job_process_runs_answers_busy_and_keeps_it() {
    let w = World::new();
    let lease = w.launching_lease(1);
    w.put_instance(&name(&lease.id), true);
    w.fake.set_working(&name(&lease.id), true);
    w.core().faults.removal_ignores_job = true;
    let r = w.runner();
    r.recover().await.unwrap();
    let err = r
        .destroy(lease.request_id, &DestroyOrder::scale_down())
        .await
        .expect_err("busy");
    assert!(matches!(err, RunnerError::Busy { held: true, .. }), "{err}");
    r.tend().await.unwrap();
    assert!(w.exists(&lease.id), "a runner at work was destroyed");
    assert_eq!(w.fake.count(Operation::Destroy), 0);
    assert_eq!(custody(&r), BTreeSet::from([lease.id.clone()]));
    // Its job ends and the runner exits: the lease is `done`.
    w.fake.set_working(&name(&lease.id), false);
    w.fake.exit(&name(&lease.id), 0, false);
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Done);
    assert!(!r.holding());
}

#[tokio::test]
async fn an_adopted_job_is_cleaned_up_when_it_finishes() {
    let w = World::new();
    let lease = w.launching_lease(1);
    w.put_instance(&name(&lease.id), true);
    let r = w.runner();
    r.recover().await.unwrap();
    r.tend().await.unwrap();
    assert!(w.exists(&lease.id));
    w.fake.exit(&name(&lease.id), 0, false);
    r.tend().await.unwrap();
    assert!(!w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Done);
    assert!(!r.holding());
}

#[tokio::test]
async fn an_adopted_job_is_destroyed_when_its_lease_is_released() {
    let w = World::new();
    let lease = w.launching_lease(1);
    w.put_instance(&name(&lease.id), true);
    let r = w.runner();
    r.recover().await.unwrap();
    w.core()
        .plane_release(&lease.id, None, Phase::Done, "listener");
    r.tend().await.unwrap();
    assert!(!w.exists(&lease.id));
    assert!(!r.holding());
}

#[tokio::test]
async fn recover_destroys_an_instance_nothing_is_waiting_for() {
    let w = World::new();
    let lease = w.launching_lease(1);
    w.core()
        .plane_release(&lease.id, None, Phase::Failed, "gone");
    w.put_instance(&name(&lease.id), false);
    let r = w.runner();
    r.recover().await.unwrap();
    assert_eq!(w.destroys_of(&lease.id), 1);
    assert!(!w.exists(&lease.id));
    assert!(!r.holding());
}

/// A launch carrying its registration creates beside its bind, so a node
/// killed before the bind and before its launch record leaves an instance
/// whose lease is not launched: recovery destroys it as an orphan, and,
/// knowing no record, removes its registration by lease at no known epoch.
/// The plane then redelivers the launch, which binds the lease: that
/// pending removal was of a launch never bound, and must take neither the
/// relaunched runner's registration (the same one, minted before dispatch)
/// nor, once done, its launch record. So when the runner's compute is
/// later removed behind the node's back, across a restart too, the lease
/// still ends `failed` `removed`, and its capacity is freed.
#[tokio::test(start_paused = true)]
async fn a_launch_redelivered_after_recovery_destroyed_its_orphan_keeps_its_registration_and_its_vanished_compute_ends_the_lease()
 {
    let w = World::new();
    let lease = w.reserve(1);
    let registration = w.core().mint_ahead(&lease.id, lease.epoch).unwrap();
    w.fake.insert_behind_back(Instance {
        id: "left-created".into(),
        name: name(&lease.id),
        state: InstanceState::Created,
        labels: BTreeMap::new(),
    });
    let r = w.runner();
    r.recover().await.unwrap();
    assert!(!w.exists(&lease.id), "recovery destroyed the orphan");

    r.launch_with(
        lease.clone(),
        tier(Trust::Trusted),
        job(1, "push"),
        Some(registration),
    )
    .await
    .expect("the redelivered launch starts its runner");
    r.tend().await.unwrap();
    assert!(
        w.registered(&lease.id),
        "the orphan's pending removal took the relaunched runner's registration: {:?}",
        w.plane.log()
    );
    assert!(
        w.journal
            .launches()
            .await
            .unwrap()
            .iter()
            .any(|l| l.lease == lease.id.as_str()),
        "the running lease's launch record is kept"
    );

    w.fake.remove_behind_back(&name(&lease.id));
    let r = w.runner();
    r.recover().await.unwrap();
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert_eq!(reason(&w, &lease.id).as_deref(), Some("removed"));
    assert!(!w.registered(&lease.id));
    assert!(!r.holding());
}

/// As above, but the orphan's removal by lease was already on its way to
/// the plane when the redelivered launch bound the lease, so it takes the
/// relaunched runner's registration (a call under way cannot be recalled).
/// The launch record is the live launch's by the time the removal answers,
/// and it stays: a restart after the runner's compute vanished still finds
/// the lease and ends it, freeing its capacity.
#[tokio::test(start_paused = true)]
async fn a_removal_under_way_when_a_redelivered_launch_binds_its_lease_leaves_that_launchs_record()
{
    let w = World::new();
    let lease = w.reserve(1);
    let registration = w.core().mint_ahead(&lease.id, lease.epoch).unwrap();
    w.fake.insert_behind_back(Instance {
        id: "left-created".into(),
        name: name(&lease.id),
        state: InstanceState::Created,
        labels: BTreeMap::new(),
    });
    let r = w.runner();
    r.recover().await.unwrap();
    // Every plane call now takes a second: the bind answers at 1 s and the
    // advance at 2 s; the removal, asked at 1.5 s, lands at 2.5 s.
    w.core().faults.inside_tend = Some(Duration::from_secs(1));
    let launch = tokio::spawn({
        let r = r.clone();
        let lease = lease.clone();
        async move {
            r.launch_with(
                lease,
                tier(Trust::Trusted),
                job(1, "push"),
                Some(registration),
            )
            .await
        }
    });
    sleep(Duration::from_millis(1500)).await;
    r.tend().await.unwrap();
    launch
        .await
        .unwrap()
        .expect("the redelivered launch starts its runner");
    w.core().faults.inside_tend = None;
    assert!(
        !w.registered(&lease.id),
        "the removal under way took the registration: {:?}",
        w.plane.log()
    );
    assert!(
        w.journal
            .launches()
            .await
            .unwrap()
            .iter()
            .any(|l| l.lease == lease.id.as_str()),
        "the running lease's launch record is kept"
    );

    w.fake.remove_behind_back(&name(&lease.id));
    let r = w.runner();
    r.recover().await.unwrap();
    r.tend().await.unwrap();
    // Ended (GitHub no longer has the registration, which the node reads as
    // a job GitHub ended before the compute did), its capacity freed.
    assert!(w.phase(&lease.id).is_terminal(), "{:?}", w.phase(&lease.id));
    assert!(!r.holding());
}

#[tokio::test]
async fn recover_does_not_destroy_when_it_cannot_read_the_lease() {
    let w = World::new();
    let lease = w.launching_lease(1);
    w.put_instance(&name(&lease.id), true);
    w.fault(&lease.id, LOp::Lease, Fault::Refuse);
    let r = w.runner();
    r.recover().await.expect_err("the lease could not be read");
    assert_eq!(w.fake.count(Operation::Destroy), 0);
    assert!(w.exists(&lease.id));
    assert!(!r.holding());
}

#[tokio::test(start_paused = true)]
async fn recovery_adopts_quarantined_compute_and_leaves_its_phase_quarantine() {
    let w = World::new();
    let lease = w.launching_lease(1);
    w.put_instance(&name(&lease.id), true);
    sleep(fakes::TTL * 2).await;
    w.reap();
    assert_eq!(w.phase(&lease.id), Phase::Quarantine);
    let r = w.runner();
    r.recover().await.unwrap();
    r.tend().await.unwrap();
    r.tend().await.unwrap();
    assert_eq!(custody(&r), BTreeSet::from([lease.id.clone()]));
    assert!(w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Quarantine);
    assert!(
        !w.plane.log().iter().any(|l| l.starts_with("advance ")),
        "no phase reported for quarantined compute: {:?}",
        w.plane.log()
    );
}

#[tokio::test(start_paused = true)]
async fn an_adopted_custody_entry_carries_its_leases_current_epoch() {
    let w = World::new();
    let lease = w.launching_lease(1);
    w.put_instance(&name(&lease.id), true);
    sleep(fakes::TTL * 2).await;
    w.reap();
    assert_eq!(w.epoch(&lease.id), 2);
    let r = w.runner();
    r.recover().await.unwrap();
    sleep(fakes::TTL * 2).await;
    // Renewed at the first try: the entry presents epoch 2, not the
    // launch's 1 (a stale epoch would be fenced and renew nothing).
    r.tend().await.unwrap();
    assert!(w.expires(&lease.id) > Instant::now());
}

// ======================= 7.F Sweep =======================

#[tokio::test]
async fn sweep_keeps_an_instance_whose_lease_is_launching() {
    let w = World::new();
    let lease = w.launching_lease(1);
    w.put_instance(&name(&lease.id), true);
    let r = w.runner();
    r.sweep().await.unwrap();
    assert_eq!(w.fake.count(Operation::Destroy), 0);
    assert!(w.exists(&lease.id));
}

#[tokio::test]
async fn sweep_destroys_an_instance_whose_lease_is_terminal() {
    let w = World::new();
    let lease = w.launching_lease(1);
    w.core()
        .plane_release(&lease.id, None, Phase::Done, "listener");
    w.put_instance(&name(&lease.id), true);
    let r = w.runner();
    r.sweep().await.unwrap();
    assert!(!w.exists(&lease.id));
}

#[tokio::test]
async fn sweep_destroys_an_instance_whose_lease_never_launched() {
    let w = World::new();
    let lease = w.reserve(1);
    w.core().bind(&lease.id, Epoch(1)).unwrap();
    w.put_instance(&name(&lease.id), true);
    let r = w.runner();
    r.sweep().await.unwrap();
    assert!(!w.exists(&lease.id));
}

#[tokio::test]
async fn sweep_destroys_an_instance_whose_lease_is_bound_to_another_node() {
    let w = World::new();
    let lease = w.reserve(1);
    {
        let mut c = w.core();
        let row = c.leases.get_mut(&lease.id).unwrap();
        row.phase = Phase::Launching;
        row.bound = false; // bound, but not to this node
    }
    w.put_instance(&name(&lease.id), true);
    let r = w.runner();
    r.sweep().await.unwrap();
    assert!(!w.exists(&lease.id));
}

#[tokio::test(start_paused = true)]
async fn sweep_adopts_quarantined_compute_rather_than_destroying_it() {
    let w = World::new();
    let lease = w.launching_lease(1);
    w.put_instance(&name(&lease.id), true);
    sleep(fakes::TTL * 2).await;
    w.reap();
    let r = w.runner();
    r.sweep().await.unwrap();
    assert_eq!(w.fake.count(Operation::Destroy), 0);
    assert_eq!(custody(&r), BTreeSet::from([lease.id.clone()]));
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Quarantine);
    assert!(w.exists(&lease.id));
}

#[tokio::test(start_paused = true)]
async fn a_failed_quarantined_lease_is_torn_down_without_leaving_quarantine_and_ends_failed() {
    let w = World::new();
    let lease = w.launching_lease(1);
    w.put_instance(&name(&lease.id), true);
    sleep(fakes::TTL * 2).await;
    w.reap();
    w.plane
        .reasons
        .lock()
        .unwrap()
        .insert(lease.id.clone(), "the job was cancelled".into());
    let r = w.runner();
    r.sweep().await.unwrap();
    r.tend().await.unwrap();
    assert!(!w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert!(
        !w.plane.log().iter().any(|l| l.starts_with("advance ")),
        "never moved out of quarantine: {:?}",
        w.plane.log()
    );
}

#[tokio::test(start_paused = true)]
async fn a_sweep_reports_an_empty_inventory_and_an_aged_quarantine_is_resolved() {
    let w = World::new();
    let lease = w.launching_lease(1);
    sleep(fakes::TTL * 2).await;
    w.reap();
    sleep(fakes::QUARANTINE_GRACE + fakes::TTL).await;
    let r = w.runner();
    r.sweep().await.unwrap();
    assert_eq!(
        *w.plane.reconciles.lock().unwrap(),
        vec![Vec::<LeaseId>::new()]
    );
    assert_eq!(w.phase(&lease.id), Phase::Failed);
}

#[tokio::test]
async fn sweep_leaves_held_compute_alone() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    r.assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    // No longer in the launched set; only this node's custody accounts for it.
    w.core()
        .plane_release(&lease.id, None, Phase::Done, "listener");
    r.sweep().await.unwrap();
    assert_eq!(w.fake.count(Operation::Destroy), 0);
    assert!(w.exists(&lease.id));
}

// ======================= 7.G AssumeCustody / quarantine =======================

#[tokio::test(start_paused = true)]
async fn custody_survives_its_lease_being_quarantined_and_the_job_keeps_running() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    r.assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    sleep(fakes::TTL * 2).await;
    w.reap();
    assert_eq!(
        (w.phase(&lease.id), w.epoch(&lease.id)),
        (Phase::Quarantine, 2)
    );
    r.tend().await.unwrap();
    sleep(fakes::TTL * 2).await;
    r.tend().await.unwrap();
    assert!(w.expires(&lease.id) > Instant::now(), "renewed at epoch 2");
    r.tend().await.unwrap();
    assert_eq!(w.fake.count(Operation::Destroy), 0);
    assert!(w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Quarantine);
    assert_eq!(custody(&r), BTreeSet::from([lease.id.clone()]));
}

#[tokio::test(start_paused = true)]
async fn assume_custody_trusts_a_host_launch_before_its_first_absence() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    r.assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    w.fake.remove_behind_back(&name(&lease.id));
    r.tend().await.unwrap();
    // Released at the first miss; a held job whose compute was removed
    // behind the node's back did not finish: `failed`, reason `removed`, as
    // for a running one (the reference releases `done`, though GitHub may
    // still hold the job of an adopted runner so removed).
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert_eq!(reason(&w, &lease.id).as_deref(), Some("removed"));
    assert!(!r.holding());
}

// ======================= 7.H Tend / custody lifecycle =======================

#[tokio::test]
async fn custody_ends_when_the_stray_is_finally_destroyed() {
    let w = World::new();
    let r = w.runner();
    w.fake.fail_create_after_starting(1);
    w.fake.fail_next(Operation::Destroy, 1);
    let lease = w.reserve(1);
    assert!(
        r.launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
            .await
            .unwrap_err()
            .is_custody()
    );
    assert!(w.exists(&lease.id));
    r.tend().await.unwrap();
    assert!(!w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert!(!r.holding());
}

#[tokio::test(start_paused = true)]
async fn custody_records_when_it_started() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    // Its runner holds a job: past the start deadline it is online.
    w.core().job_starts(&name(&lease.id));
    let wall_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64
    };
    let began_ms = wall_ms();
    r.assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    // An hour of the node's (paused) clock, its tends in between: the
    // record still says when custody began, not when it was last written.
    // (The wall clock does not move in paused time; a tend that changes
    // nothing does not rewrite the record.)
    sleep(Duration::from_secs(3600)).await;
    r.tend().await.unwrap();
    let records = w.journal.custody().await.unwrap();
    assert_eq!(records.len(), 1);
    let off_ms = (records[0].since_unix_ms - began_ms).abs();
    assert!(
        off_ms < 1_000,
        "the record keeps the start: {off_ms} ms from when custody began"
    );
}

#[tokio::test]
async fn custody_is_kept_when_the_release_fails_and_the_next_tend_retries() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    r.assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    w.fake.remove_behind_back(&name(&lease.id));
    w.fault(&lease.id, LOp::Release, Fault::Refuse);
    r.tend().await.expect_err("release failed");
    assert_eq!(custody(&r), BTreeSet::from([lease.id.clone()]));
    assert!(!w.phase(&lease.id).is_terminal());
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert_eq!(reason(&w, &lease.id).as_deref(), Some("removed"));
    assert!(!r.holding());
}

#[tokio::test]
async fn tend_reports_an_unreachable_ledger_rather_than_treating_it_as_gone() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    r.assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    w.core().faults.ledger_down = true;
    r.tend().await.expect_err("the ledger is unreachable");
    assert_eq!(w.fake.count(Operation::Destroy), 0);
    assert!(w.exists(&lease.id));
    assert_eq!(custody(&r), BTreeSet::from([lease.id.clone()]));
}

#[tokio::test]
async fn a_discarded_launch_in_custody_records_a_failure() {
    let w = World::new();
    let r = w.runner();
    w.fake.fail_create_after_starting(1);
    w.fake.set_destroy_mode(DestroyMode::RequestAndKeep);
    let lease = w.reserve(1);
    assert!(
        r.launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
            .await
            .unwrap_err()
            .is_custody()
    );
    w.fake.set_destroy_mode(DestroyMode::Stop);
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Failed);
}

#[tokio::test(start_paused = true)]
async fn an_absent_stray_is_not_believed_before_the_grace() {
    let w = World::new();
    let r = w.runner();
    w.fake.fail_next(Operation::Create, 1);
    let lease = w.reserve(1);
    assert!(
        r.launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
            .await
            .unwrap_err()
            .is_custody()
    );
    r.tend().await.unwrap();
    sleep(STRAY_GRACE - Duration::from_secs(1)).await;
    r.tend().await.unwrap();
    assert!(!w.phase(&lease.id).is_terminal());
    assert!(r.holding());
    sleep(Duration::from_secs(2)).await;
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Failed);
}

#[tokio::test(start_paused = true)]
async fn held_compute_is_not_destroyed_on_a_timer_by_default() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    // A job runs in it (a runner that never took one is the start
    // deadline's to end, held or not).
    w.core().job_starts(&name(&lease.id));
    r.assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    sleep(Duration::from_secs(3 * 24 * 3600)).await;
    r.tend().await.unwrap();
    assert_eq!(w.fake.count(Operation::Destroy), 0);
    assert!(w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Custody);
}

/// A runner with `max_custody` set to `bound`, holding a launched lease in
/// custody from now.
async fn held_under_a_bound(w: &World, bound: Duration) -> (Arc<Runner>, Lease) {
    let r = w.runner_with(RunnerOptions {
        max_custody: Some(bound),
        // The bound alone: no start deadline asks GitHub first.
        start_deadline: None,
        ..RunnerOptions::default()
    });
    let lease = w.launched(&r, 1).await;
    r.assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    (r, lease)
}

#[tokio::test(start_paused = true)]
async fn a_configured_custody_bound_destroys_and_records_a_failure() {
    let w = World::new();
    let (r, lease) = held_under_a_bound(&w, Duration::from_secs(3600)).await;
    sleep(Duration::from_secs(1800)).await;
    r.tend().await.unwrap();
    assert!(w.exists(&lease.id), "within the bound");
    sleep(Duration::from_secs(1801)).await;
    r.tend().await.unwrap();
    assert!(!w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Failed);
}

#[tokio::test(start_paused = true)]
async fn a_zero_custody_bound_is_off_not_an_instant_kill() {
    let w = World::new();
    let (r, lease) = held_under_a_bound(&w, Duration::ZERO).await;
    sleep(Duration::from_secs(1)).await;
    r.tend().await.unwrap();
    sleep(Duration::from_secs(7200)).await;
    r.tend().await.unwrap();
    assert_eq!(
        w.fake.count(Operation::Destroy),
        0,
        "a running job in custody was destroyed"
    );
    assert!(w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Custody);
}

#[tokio::test(start_paused = true)]
async fn a_vanished_adopted_container_is_released_without_waiting() {
    let w = World::new();
    let lease = w.launching_lease(1);
    w.put_instance(&name(&lease.id), true);
    let r = w.runner();
    r.recover().await.unwrap();
    w.fake.remove_behind_back(&name(&lease.id));
    r.tend().await.unwrap();
    assert!(w.phase(&lease.id).is_terminal());
    assert!(!r.holding());
}

/// The launch record is synced while the lease is bound, so a node can die
/// with the record written and the lease never bound. The restarted node
/// starts nothing for it and holds a removal by lease for it; the plane's
/// redelivered launch of the same lease binds, which drops that removal, so
/// the new runner keeps its registration (else, as in the simulation's seed
/// 4347, it is removed at the next tend and the lease launches for ever).
#[tokio::test]
async fn a_launch_record_whose_lease_was_never_bound_does_not_unregister_the_relaunched_runner() {
    let w = World::new();
    let lease = w.reserve(1);
    w.journal_unminted_launch(&lease).await;
    let r = w.runner();
    r.recover().await.unwrap();
    assert!(!w.bound(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Assigned);
    assert_eq!(w.fake.count(Operation::Create), 0);
    r.launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
        .await
        .expect("the lease launches");
    r.tend().await.unwrap();
    assert!(w.exists(&lease.id));
    assert!(
        w.registered(&lease.id),
        "the relaunched runner lost its registration"
    );
    assert_eq!(w.phase(&lease.id), Phase::Launching);
    assert_eq!(w.fake.count(Operation::Create), 1);
    assert!(r.holding());
    let records = w.journal.launches().await.unwrap();
    assert_eq!(records.len(), 1, "{records:?}");
    assert!(
        records[0].created && records[0].runner_id > 0,
        "{records:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn an_unseen_stray_from_before_a_restart_still_waits_the_grace() {
    let w = World::new();
    let lease = w.launching_lease(1);
    // The earlier process journaled the launch and died before create.
    w.journal_unminted_launch(&lease).await;
    let r = w.runner();
    r.recover().await.unwrap();
    assert_eq!(custody(&r), BTreeSet::from([lease.id.clone()]));
    r.tend().await.unwrap();
    assert!(!w.phase(&lease.id).is_terminal());
    sleep(STRAY_GRACE + Duration::from_secs(1)).await;
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert!(!r.holding());
}

#[tokio::test(start_paused = true)]
async fn a_stray_that_appears_becomes_observed_and_its_later_absence_needs_no_grace() {
    let w = World::new();
    let r = w.runner();
    w.fake.fail_next(Operation::Create, 1);
    let lease = w.reserve(1);
    assert!(
        r.launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
            .await
            .unwrap_err()
            .is_custody()
    );
    w.fake.set_destroy_mode(DestroyMode::RequestAndKeep);
    w.put_instance(&name(&lease.id), true);
    r.tend().await.unwrap();
    assert!(!w.phase(&lease.id).is_terminal());
    w.fake.remove_behind_back(&name(&lease.id));
    r.tend().await.unwrap();
    assert_eq!(
        w.phase(&lease.id),
        Phase::Failed,
        "released well within the grace"
    );
}

#[tokio::test(start_paused = true)]
async fn the_custody_bound_removes_the_registration_before_destroying_the_compute() {
    let w = World::new();
    let (r, lease) = held_under_a_bound(&w, Duration::from_secs(3600)).await;
    sleep(Duration::from_secs(3601)).await;
    r.tend().await.unwrap();
    assert!(!w.registered(&lease.id));
    assert!(!w.exists(&lease.id));
    let removals: Vec<String> = w
        .plane
        .log()
        .into_iter()
        .filter(|l| l.starts_with("remove "))
        .collect();
    assert_eq!(
        removals,
        vec![format!("remove {} after 0 destroys", lease.id)]
    );
    assert_eq!(w.phase(&lease.id), Phase::Failed);
}

#[tokio::test(start_paused = true)]
async fn an_unreachable_github_holds_a_custody_kill_until_the_registration_can_go_first() {
    let w = World::new();
    let (r, lease) = held_under_a_bound(&w, Duration::from_secs(3600)).await;
    sleep(Duration::from_secs(3601)).await;
    w.fault(&lease.id, LOp::RemoveRunner, Fault::Refuse);
    let _ = r.tend().await;
    assert_eq!(
        w.fake.count(Operation::Destroy),
        0,
        "compute went before routing"
    );
    assert!(w.exists(&lease.id));
    assert!(w.registered(&lease.id));
    r.tend().await.unwrap();
    assert!(!w.registered(&lease.id));
    assert!(!w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Failed);
}

// ======================= 7.I KeepAlive =======================

#[tokio::test(start_paused = true)]
async fn keep_alive_renews_held_leases_while_tend_is_blocked_in_the_provider() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    r.assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    let stop = CancellationToken::new();
    let ka = tokio::spawn({
        let r = r.clone();
        let stop = stop.clone();
        async move { r.keep_alive(stop).await }
    });
    w.fake.block(Operation::List);
    let tend = tokio::spawn({
        let r = r.clone();
        async move { r.tend().await }
    });
    while w.fake.count(Operation::List) == 0 {
        sleep(Duration::from_millis(10)).await;
    }
    let before = w.plane.heartbeats();
    sleep(fakes::TTL * 4).await;
    w.reap();
    assert!(w.plane.heartbeats() >= before + 3);
    assert_ne!(w.phase(&lease.id), Phase::Quarantine);
    w.fake.unblock(Operation::List);
    tend.await.unwrap().unwrap();
    stop.cancel();
    ka.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn keep_alive_follows_a_shortened_lease_ttl_within_a_tick() {
    let w = World::new();
    *w.plane.ttl.lock().unwrap() = Duration::from_secs(90);
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    r.assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    let stop = CancellationToken::new();
    let ka = tokio::spawn({
        let r = r.clone();
        let stop = stop.clone();
        async move { r.keep_alive(stop).await }
    });
    sleep(Duration::from_secs(31)).await;
    let at_90 = w.plane.heartbeats();
    *w.plane.ttl.lock().unwrap() = Duration::from_secs(3);
    sleep(Duration::from_secs(4)).await;
    let renewals = w.plane.heartbeats() - at_90;
    assert!(
        renewals >= 3,
        "a 3 s TTL renews every second: {renewals} renewals in 4 s"
    );
    stop.cancel();
    ka.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn keep_alive_stops_with_its_context() {
    let w = World::new();
    let r = w.runner();
    let stop = CancellationToken::new();
    let ka = tokio::spawn({
        let r = r.clone();
        let stop = stop.clone();
        async move { r.keep_alive(stop).await }
    });
    sleep(Duration::from_secs(5)).await;
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(1), ka)
        .await
        .expect("keep_alive returned")
        .unwrap();
}

#[tokio::test(start_paused = true)]
async fn keep_alive_does_not_act_on_a_renewal_failure() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    r.assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    // Reaped: every renewal at epoch 1 is now fenced.
    w.core().leases.get_mut(&lease.id).unwrap().expires = Instant::now();
    sleep(Duration::from_millis(1)).await;
    w.reap();
    assert_eq!(w.epoch(&lease.id), 2);
    let before = w.plane.heartbeats();
    let stop = CancellationToken::new();
    let ka = tokio::spawn({
        let r = r.clone();
        let stop = stop.clone();
        async move { r.keep_alive(stop).await }
    });
    sleep(fakes::TTL * 3).await;
    stop.cancel();
    ka.await.unwrap();
    assert!(w.plane.heartbeats() > before, "it kept trying");
    assert_eq!(w.fake.count(Operation::Destroy), 0);
    assert!(w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Quarantine);
    assert_eq!(custody(&r), BTreeSet::from([lease.id.clone()]));
    assert!(!w.plane.log().iter().any(|l| l.starts_with("release ")));
}

// ======================= 7.J Superseded / Holding =======================

#[tokio::test]
async fn an_ordinary_running_job_counts_as_holding() {
    let w = World::new();
    let r = w.runner();
    assert!(!r.holding());
    w.launched(&r, 1).await;
    assert!(r.holding());
    assert!(custody(&r).is_empty());
}

#[tokio::test]
async fn supersession_moves_running_work_into_custody_rather_than_copying_it() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    r.superseded().await;
    assert_eq!(custody(&r), BTreeSet::from([lease.id.clone()]));
    // Moved, not copied: one entry ends it, once. (Compute removed behind
    // the node's back ends `failed` `removed` held or running alike.)
    w.fake.remove_behind_back(&name(&lease.id));
    r.sweep().await.unwrap();
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert_eq!(reason(&w, &lease.id).as_deref(), Some("removed"));
    assert!(!r.holding(), "the drain can end");
}

#[tokio::test(start_paused = true)]
async fn supersession_trusts_a_host_launch_before_its_first_absence() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    r.superseded().await;
    w.fake.remove_behind_back(&name(&lease.id));
    r.tend().await.unwrap();
    assert!(w.phase(&lease.id).is_terminal());
    assert!(!r.holding());
}

// ======================= 7.L (runner half) =======================

#[tokio::test]
async fn a_draining_node_refuses_a_launch_and_still_serves_a_destroy() {
    let w = World::new();
    let r = w.runner();
    let running = w.launched(&r, 1).await;
    r.start_draining();
    let lease = w.reserve(2);
    let err = r
        .launch(lease.clone(), tier(Trust::Trusted), job(2, "push"))
        .await
        .expect_err("no new launches while draining");
    assert!(matches!(err, RunnerError::Refused(_)), "{err}");
    assert!(!w.bound(&lease.id));
    assert_eq!(w.fake.count(Operation::Create), 1);
    w.fake.exit(&name(&running.id), 0, false); // the ephemeral runner exits after its job
    r.destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
        .await
        .unwrap();
    assert!(!w.exists(&running.id));
    assert!(!r.holding());
}

/// An image that is not on the node is found before a registration
/// exists; the refusal names it and nothing is minted or created. The
/// image is checked beside the bind, so the lease the bind took
/// meanwhile is released `failed` by the node: never left bound,
/// charging nothing. The same image, once present, launches.
#[tokio::test]
async fn a_launch_whose_image_is_missing_mints_and_creates_nothing_releases_its_lease_and_names_the_image()
 {
    let w = World::new();
    let r = w.runner();
    w.fake.remove_image("runner:tier-image");
    let lease = w.reserve(1);
    let err = r
        .launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
        .await
        .expect_err("a missing image refuses the launch");
    match &err {
        RunnerError::ImageUnavailable { image } => assert_eq!(image, "runner:tier-image"),
        other => panic!("refused as {other:?}"),
    }
    assert!(err.to_string().contains("runner:tier-image"), "{err}");
    assert_eq!(
        w.phase(&lease.id),
        Phase::Failed,
        "the lease bound beside the image check was not released"
    );
    assert_eq!(
        w.plane.count(&format!("release {} failed", lease.id)),
        1,
        "{:?}",
        w.plane.log()
    );
    assert_eq!(
        reason(&w, &lease.id).as_deref(),
        Some("image_unavailable runner:tier-image"),
        "a lease refused for its image ends saying so"
    );
    assert!(!w.registered(&lease.id), "a registration was minted");
    assert_eq!(w.plane.count("mint "), 0, "{:?}", w.plane.log());
    assert_eq!(w.fake.count(Operation::Create), 0);
    assert!(!r.holding());
    // The launch record is written while the image is checked: a
    // refusal clears it, so a restart finds nothing to clean up.
    assert_eq!(w.journal.launches().await.unwrap(), Vec::new());
    // The image is built while the job waits: the plane's next lease runs.
    w.fake.restore_image("runner:tier-image");
    let next = w.launched(&r, 1).await;
    assert!(w.registered(&next.id));
    assert!(w.exists(&next.id));
}

/// A provider that cannot be asked refuses the launch as unavailable,
/// before anything is minted; the lease bound beside the check is
/// released `failed`.
#[tokio::test]
async fn a_launch_whose_provider_does_not_answer_is_refused_before_anything_is_minted() {
    let w = World::new();
    let r = w.runner();
    w.fake
        .set_engine(billet_agent::provider::fake::Engine::Unreachable);
    let lease = w.reserve(1);
    let err = r
        .launch(lease.clone(), tier(Trust::Trusted), job(1, "push"))
        .await
        .expect_err("an unreachable engine refuses the launch");
    assert!(
        matches!(err, RunnerError::ProviderUnavailable(_)),
        "{err:?}"
    );
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert_eq!(
        reason(&w, &lease.id).as_deref(),
        Some("provider_unavailable")
    );
    assert!(!w.registered(&lease.id));
    assert_eq!(w.journal.launches().await.unwrap(), Vec::new());
    assert!(!r.holding());
}

/// 7.E.11: adoption renews the lease at once, before any tend or KeepAlive.
#[tokio::test(start_paused = true)]
async fn recover_renews_the_lease_it_adopts() {
    let w = World::new();
    let lease = w.launching_lease(1);
    w.put_instance(&name(&lease.id), true);
    let before = w.expires(&lease.id);
    sleep(fakes::TTL / 2).await;
    let r = w.runner();
    r.recover().await.unwrap();
    assert!(
        w.expires(&lease.id) > before,
        "recover adopted the lease without renewing it"
    );
}

// ======================= A runner's life =======================

/// The ledger's failure reason for a lease, as the node marked it.
fn reason(w: &World, lease: &LeaseId) -> Option<String> {
    w.plane.reasons.lock().unwrap().get(lease).cloned()
}

/// One tend after the runner's process ended under a running lease: torn
/// down, registration removed, released with `outcome` and `why`.
async fn ends_in_one_tend(code: i64, oom_killed: bool, outcome: Phase, why: Option<&str>) {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    assert!(w.fake.exit(&name(&lease.id), code, oom_killed));
    r.tend().await.unwrap();
    assert!(!w.exists(&lease.id), "the exited container is destroyed");
    assert!(!w.registered(&lease.id), "the registration is removed");
    assert_eq!(w.phase(&lease.id), outcome);
    assert_eq!(reason(&w, &lease.id).as_deref(), why);
    assert!(!r.holding());
    assert_eq!(w.fake.count(Operation::List), 1, "one inventory per tend");
    assert_eq!(w.fake.count(Operation::Find), 0, "no find per lease");
}

#[tokio::test]
async fn a_running_runner_killed_is_released_failed_killed_within_one_tend() {
    ends_in_one_tend(137, false, Phase::Failed, Some("killed")).await;
}

/// An operator's forced Destroy of a runner mid-job: its registration is
/// asked to go first (GitHub refuses while the job is assigned: that goes
/// to the removal backoff), its container goes, and the lease is released
/// `failed` with the operator's reason as soon as its compute is proven
/// gone, freeing its capacity; not left open until GitHub lets the job go,
/// and never `done`.
#[tokio::test]
async fn a_forced_destroy_of_a_runner_mid_job_releases_its_lease_failed_with_the_operators_reason()
{
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    w.core().job_starts(&name(&lease.id));
    r.destroy(RequestId(1), &DestroyOrder::forced("operator_x"))
        .await
        .expect("forced");
    assert!(!w.exists(&lease.id), "the container is gone");
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert_eq!(reason(&w, &lease.id).as_deref(), Some("operator_x"));
    assert_eq!(r.held_charge(), (0, 0), "its capacity is free");
    assert!(
        r.held().is_empty(),
        "nothing is held for it: {:?}",
        r.held()
    );
}

/// A drain ends what cannot finish: a runner that has taken no job is
/// retired, its registration removed first and then its compute, and its
/// lease released `failed` `drained`; a runner GitHub says holds a job is
/// kept to finish it. The node then holds only the working job.
#[tokio::test]
async fn a_drain_retires_runners_that_took_no_job_and_keeps_the_working_one() {
    let w = World::new();
    let r = w.runner();
    let idle = w.launched(&r, 1).await;
    let busy = w.launched(&r, 2).await;
    w.core().job_starts(&name(&busy.id));
    r.start_draining();
    r.retire_idle_runners().await;
    assert!(!w.registered(&idle.id), "the idle runner is still routable");
    assert!(!w.exists(&idle.id), "the idle runner was kept");
    assert_eq!(w.phase(&idle.id), Phase::Failed);
    assert_eq!(reason(&w, &idle.id).as_deref(), Some("drained"));
    assert!(
        w.exists(&busy.id) && w.registered(&busy.id),
        "the working job was touched"
    );
    assert_eq!(w.destroys_of(&busy.id), 0);
    let held: Vec<LeaseId> = r.held().into_iter().map(|h| h.lease).collect();
    assert_eq!(held, vec![busy.id.clone()]);
    // Asked again, the working runner is not asked about again.
    let removals = w.plane.count("remove ");
    r.retire_idle_runners().await;
    assert_eq!(w.plane.count("remove "), removals, "{:?}", w.plane.log());
}

/// GitHub recorded the runner's job succeeded (and removed its ephemeral
/// registration); the runner, at its post-job work, is then killed. Its
/// job ended before its compute did: the lease is released `done`, with no
/// failure reason, however the container ended after.
#[tokio::test]
async fn a_runner_killed_after_github_recorded_its_job_is_released_done() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    let runner_name = name(&lease.id);
    w.core().job_starts(&runner_name);
    w.core().completes_early(&runner_name);
    assert!(!w.registered(&lease.id), "GitHub retired the registration");
    assert!(w.fake.exit(&runner_name, 137, false));
    r.tend().await.unwrap();
    assert!(!w.exists(&lease.id));
    assert_eq!(
        w.phase(&lease.id),
        Phase::Done,
        "{:?}",
        reason(&w, &lease.id)
    );
    assert_eq!(reason(&w, &lease.id), None);
    assert!(!r.holding());
}

#[tokio::test]
async fn a_running_runner_oom_killed_is_released_failed_oom_within_one_tend() {
    ends_in_one_tend(137, true, Phase::Failed, Some("oom")).await;
}

#[tokio::test]
async fn a_running_runner_that_exits_3_is_released_failed_exit_3_within_one_tend() {
    ends_in_one_tend(3, false, Phase::Failed, Some("exit 3")).await;
}

#[tokio::test]
async fn a_running_runner_that_exits_0_on_its_own_is_released_done_within_one_tend() {
    ends_in_one_tend(0, false, Phase::Done, None).await;
}

#[tokio::test]
async fn a_running_runner_removed_out_of_band_is_released_failed_removed_within_one_tend() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    assert!(w.fake.remove_behind_back(&name(&lease.id)));
    r.tend().await.unwrap();
    assert!(!w.registered(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert_eq!(reason(&w, &lease.id).as_deref(), Some("removed"));
    assert!(!r.holding());
}

#[tokio::test]
async fn a_held_job_whose_runner_was_killed_is_never_recorded_done() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    r.assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    assert!(w.fake.exit(&name(&lease.id), 137, false));
    r.tend().await.unwrap();
    assert!(!w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert_eq!(reason(&w, &lease.id).as_deref(), Some("killed"));
}

#[tokio::test(start_paused = true)]
async fn a_registration_removal_that_fails_after_the_runner_died_is_retried_with_backoff_not_every_tick()
 {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    let removals = || {
        w.plane
            .log()
            .iter()
            .filter(|l| l.starts_with(&format!("remove {}", lease.id)))
            .count()
    };
    assert!(w.fake.exit(&name(&lease.id), 137, false));
    w.fault(&lease.id, LOp::RemoveRunner, Fault::Refuse);
    w.fault(&lease.id, LOp::RemoveRunner, Fault::Refuse);
    r.tend().await.unwrap();
    // The runner is gone, so its lease does not wait for the removal.
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert!(!w.exists(&lease.id));
    assert!(w.registered(&lease.id));
    assert_eq!(removals(), 1);
    for _ in 0..5 {
        r.tend().await.unwrap();
    }
    assert_eq!(removals(), 1, "tried again on a tick, before its backoff");
    sleep(Duration::from_millis(2100)).await;
    r.tend().await.unwrap();
    assert_eq!(removals(), 2, "tried again once the first backoff passed");
    assert!(w.registered(&lease.id), "the second try failed too");
    r.tend().await.unwrap();
    assert_eq!(removals(), 2, "the second backoff is longer");
    sleep(Duration::from_millis(4100)).await;
    r.tend().await.unwrap();
    assert_eq!(removals(), 3);
    assert!(!w.registered(&lease.id), "removed on the third try");
    sleep(Duration::from_secs(600)).await;
    r.tend().await.unwrap();
    assert_eq!(removals(), 3, "a removal that succeeded is not tried again");
}

// ======================= Start deadline, lease life =======================

/// A runner that never came online is torn down once the deadline
/// passes: its registration removed before its instance, its lease
/// released `failed` with reason `start_deadline`.
#[tokio::test(start_paused = true)]
async fn a_runner_not_online_by_the_start_deadline_is_deregistered_destroyed_and_released_failed() {
    let w = World::new();
    let r = w.runner_with(RunnerOptions {
        start_deadline: Some(Duration::from_secs(60)),
        ..RunnerOptions::default()
    });
    let lease = w.launched(&r, 1).await;
    sleep(Duration::from_secs(59)).await;
    r.tend().await.unwrap();
    assert!(w.exists(&lease.id), "torn down before the deadline");
    assert!(w.registered(&lease.id));
    sleep(Duration::from_secs(2)).await;
    r.tend().await.unwrap();
    assert!(!w.exists(&lease.id));
    assert!(!w.registered(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert_eq!(reason(&w, &lease.id).as_deref(), Some("start_deadline"));
    assert!(!r.holding());
    let first_removal = w
        .plane
        .log()
        .into_iter()
        .find(|l| l.starts_with("remove"))
        .expect("a removal");
    assert!(
        first_removal.ends_with("after 0 destroys"),
        "the instance went before its registration: {first_removal}"
    );
}

/// GitHub refusing to remove the registration (the runner holds a job)
/// says the runner is online: it is left running and never asked about
/// again.
#[tokio::test(start_paused = true)]
async fn a_runner_busy_at_github_at_the_start_deadline_is_online_and_left_running() {
    let w = World::new();
    let r = w.runner_with(RunnerOptions {
        start_deadline: Some(Duration::from_secs(60)),
        ..RunnerOptions::default()
    });
    let lease = w.launched(&r, 1).await;
    w.core().job_starts(&name(&lease.id));
    sleep(Duration::from_secs(61)).await;
    r.tend().await.unwrap();
    for _ in 0..3 {
        sleep(Duration::from_secs(600)).await;
        r.tend().await.unwrap();
    }
    assert!(w.exists(&lease.id), "a busy runner was torn down");
    assert!(w.registered(&lease.id));
    let removals = w
        .plane
        .log()
        .into_iter()
        .filter(|l| l.starts_with("remove"))
        .count();
    assert_eq!(removals, 1, "asked again after GitHub said busy");
    w.fake.exit(&name(&lease.id), 0, false); // the ephemeral runner exits after its job
    r.destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
        .await
        .unwrap();
    assert!(!w.exists(&lease.id));
    assert!(!r.holding());
}

/// With the deadline off (0), a runner that never connects is not torn
/// down on a timer.
/// The start deadline holds in custody too (else a runner adopted after
/// a restart, never connected, is held for ever while its job waits):
/// counted from custody's start, it ends a held runner GitHub says took
/// nothing; a runner seen online before custody is not asked again.
#[tokio::test(start_paused = true)]
async fn a_held_runner_that_took_nothing_is_ended_by_the_start_deadline_counted_from_custody() {
    let w = World::new();
    let r = w.runner_with(RunnerOptions {
        start_deadline: Some(Duration::from_secs(60)),
        ..RunnerOptions::default()
    });
    let idle = w.launched(&r, 1).await;
    let busy = w.launched(&r, 2).await;
    w.core().job_starts(&name(&busy.id));
    sleep(Duration::from_secs(61)).await;
    r.tend().await.unwrap();
    assert!(w.exists(&busy.id));
    // The idle one was torn down by the running path; a third is held
    // before its deadline and counts from custody's start.
    assert_eq!(reason(&w, &idle.id).as_deref(), Some("start_deadline"));
    let held = w.launched(&r, 3).await;
    sleep(Duration::from_secs(50)).await;
    for (lease, request) in [(&held, 3), (&busy, 2)] {
        r.assume_custody(&lease.id, lease.epoch, RequestId(request))
            .await
            .unwrap();
    }
    sleep(Duration::from_secs(30)).await;
    r.tend().await.unwrap();
    assert!(
        w.exists(&held.id),
        "cut before its deadline from custody's start"
    );
    sleep(Duration::from_secs(31)).await;
    r.tend().await.unwrap();
    assert!(
        !w.exists(&held.id),
        "a held runner that took nothing runs on"
    );
    assert_eq!(w.phase(&held.id), Phase::Failed);
    assert_eq!(reason(&w, &held.id).as_deref(), Some("start_deadline"));
    assert!(w.exists(&busy.id), "a busy held runner was torn down");
    assert_eq!(
        removals_of(&w, &busy.id),
        1,
        "a runner known online was asked again in custody"
    );
}

/// A runner whose short job ended before the deadline was first judged,
/// still at its post-job work, its completion not yet delivered: GitHub
/// has already let its ephemeral registration go, so at the deadline the
/// removal finds nothing. Such a runner must not be torn down and its
/// lease released `failed` `start_deadline` for a job that succeeded. It
/// can take no job: it is left the post-job grace to exit, and its exit 0
/// ends the lease `done`.
#[tokio::test(start_paused = true)]
async fn a_runner_whose_job_ended_before_the_start_deadline_is_left_its_grace_to_exit() {
    let w = World::new();
    let r = w.runner_with(RunnerOptions {
        start_deadline: Some(Duration::from_secs(60)),
        post_job_grace: Duration::from_secs(120),
        ..RunnerOptions::default()
    });
    let lease = w.launched(&r, 1).await;
    w.core().job_starts(&name(&lease.id));
    w.core()
        .job_ends(&name(&lease.id), fakes::Job::Finishing, "succeeded");
    sleep(Duration::from_secs(61)).await;
    r.tend().await.unwrap();
    sleep(Duration::from_secs(100)).await;
    r.tend().await.unwrap();
    assert!(
        w.exists(&lease.id),
        "a runner that did its job was torn down"
    );
    w.fake.exit(&name(&lease.id), 0, false);
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Done);
    assert_eq!(reason(&w, &lease.id), None);
}

/// A runner that never connected, its registration removed out of band
/// before the deadline: the removal finds nothing there too, and it
/// must not be held for ever, its job waiting. It is left the same
/// grace and, still running past it, stopped and released `failed`
/// `start_deadline`, held or running.
#[tokio::test(start_paused = true)]
async fn a_never_connected_runner_whose_registration_vanished_is_stopped_after_the_grace() {
    let w = World::new();
    let r = w.runner_with(RunnerOptions {
        start_deadline: Some(Duration::from_secs(60)),
        post_job_grace: Duration::from_secs(120),
        ..RunnerOptions::default()
    });
    let running = w.launched(&r, 1).await;
    let held = w.launched(&r, 2).await;
    r.assume_custody(&held.id, held.epoch, RequestId(2))
        .await
        .unwrap();
    for lease in [&running, &held] {
        w.core().regs.remove(name(&lease.id).as_str());
    }
    sleep(Duration::from_secs(61)).await;
    r.tend().await.unwrap();
    assert!(
        w.exists(&running.id) && w.exists(&held.id),
        "stopped before the grace"
    );
    sleep(Duration::from_secs(121)).await;
    r.tend().await.unwrap();
    r.tend().await.unwrap();
    for lease in [&running, &held] {
        assert!(
            !w.exists(&lease.id),
            "a runner that can take no job runs on"
        );
        assert_eq!(w.phase(&lease.id), Phase::Failed);
        assert_eq!(reason(&w, &lease.id).as_deref(), Some("start_deadline"));
    }
    assert!(!r.holding());
}

/// How many registration removals the plane was asked for `lease`.
fn removals_of(w: &World, lease: &LeaseId) -> usize {
    w.plane
        .log()
        .into_iter()
        .filter(|l| l.starts_with("remove") && l.contains(lease.as_str()))
        .count()
}

#[tokio::test(start_paused = true)]
async fn a_zero_start_deadline_is_off() {
    let w = World::new();
    let r = w.runner_with(RunnerOptions {
        start_deadline: Some(Duration::ZERO),
        ..RunnerOptions::default()
    });
    let lease = w.launched(&r, 1).await;
    sleep(Duration::from_secs(86_400)).await;
    r.tend().await.unwrap();
    assert!(w.exists(&lease.id));
    assert!(w.registered(&lease.id));
}

/// Off by default, a lease lives as long as its job, a week included.
#[tokio::test(start_paused = true)]
async fn no_lease_life_bound_by_default_a_week_old_running_lease_keeps_running() {
    let w = World::new();
    let r = w.runner_with(RunnerOptions {
        start_deadline: None,
        ..RunnerOptions::default()
    });
    let lease = w.launched(&r, 1).await;
    for _ in 0..7 {
        sleep(Duration::from_secs(86_400)).await;
        r.tend().await.unwrap();
    }
    assert!(w.exists(&lease.id));
    assert_ne!(w.phase(&lease.id), Phase::Failed);
}

/// Past the operator's bound a running lease is destroyed on that
/// authority, though GitHub says its runner is busy, and released `failed`
/// with reason `max_lease_life`.
#[tokio::test(start_paused = true)]
async fn a_running_lease_past_max_lease_life_is_destroyed_busy_or_not_and_released_failed() {
    let w = World::new();
    let r = w.runner_with(RunnerOptions {
        start_deadline: None,
        max_lease_life: Some(Duration::from_secs(7200)),
        ..RunnerOptions::default()
    });
    let lease = w.launched(&r, 1).await;
    w.core().job_starts(&name(&lease.id));
    sleep(Duration::from_secs(7199)).await;
    r.tend().await.unwrap();
    assert!(w.exists(&lease.id), "destroyed within the bound");
    sleep(Duration::from_secs(2)).await;
    r.tend().await.unwrap();
    assert!(!w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert_eq!(reason(&w, &lease.id).as_deref(), Some("max_lease_life"));
    assert!(!r.holding());
}

/// The bound holds in custody too.
#[tokio::test(start_paused = true)]
async fn a_lease_in_custody_past_max_lease_life_is_destroyed_and_released_failed() {
    let w = World::new();
    let r = w.runner_with(RunnerOptions {
        start_deadline: None,
        max_lease_life: Some(Duration::from_secs(3600)),
        ..RunnerOptions::default()
    });
    let lease = w.launched(&r, 1).await;
    r.assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    sleep(Duration::from_secs(3599)).await;
    r.tend().await.unwrap();
    assert!(w.exists(&lease.id));
    sleep(Duration::from_secs(2)).await;
    r.tend().await.unwrap();
    assert!(!w.exists(&lease.id));
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert_eq!(reason(&w, &lease.id).as_deref(), Some("max_lease_life"));
}

/// A zero bound is off, not an instant kill.
#[tokio::test(start_paused = true)]
async fn a_zero_lease_life_bound_is_off() {
    let w = World::new();
    let r = w.runner_with(RunnerOptions {
        start_deadline: None,
        max_lease_life: Some(Duration::ZERO),
        ..RunnerOptions::default()
    });
    let lease = w.launched(&r, 1).await;
    sleep(Duration::from_secs(3600)).await;
    r.tend().await.unwrap();
    assert!(w.exists(&lease.id));
}

/// Recovery with N surviving instances asks the plane for the launched set
/// once (the set carries the leases) and journals the N adoptions in one
/// write; each tend then renews every held lease in one heartbeat, lists
/// the provider once, reports each phase once, and writes nothing to the
/// journal while nothing changes.
#[tokio::test]
async fn recovery_and_tend_cost_the_same_number_of_calls_whatever_is_held() {
    let w = World::new();
    let leases: Vec<Lease> = (1..=20)
        .map(|i| {
            let lease = w.launching_lease(i);
            w.put_instance(&name(&lease.id), true);
            lease
        })
        .collect();
    let journal = Arc::new(CountingJournal::default());
    let provider: Arc<dyn Provider> = w.fake.clone();
    let r = Runner::new(
        provider,
        w.plane.clone(),
        w.plane.clone(),
        RunnerOptions::default(),
    )
    .with_journal(journal.clone());
    r.recover().await.unwrap();
    assert_eq!(custody(&r).len(), leases.len());
    assert_eq!(w.plane.count("launched"), 1);
    assert_eq!(w.plane.count("get_lease"), 0, "{:?}", w.plane.log());
    assert_eq!(
        journal.writes(),
        1,
        "the adoptions were journaled one by one"
    );
    assert_eq!(
        w.plane.heartbeats(),
        1,
        "the adopted leases were renewed one by one"
    );

    let lists = w.fake.count(Operation::List);
    r.tend().await.unwrap();
    assert_eq!(w.plane.heartbeats(), 2, "one heartbeat per tend");
    assert_eq!(w.fake.count(Operation::List), lists + 1);
    assert_eq!(w.fake.count(Operation::Find), 0);
    assert_eq!(
        w.plane.count("advance"),
        leases.len(),
        "each phase reported once"
    );
    let writes = journal.writes();
    r.tend().await.unwrap();
    assert_eq!(w.plane.heartbeats(), 3);
    assert_eq!(w.fake.count(Operation::List), lists + 2);
    assert_eq!(
        w.plane.count("advance"),
        leases.len(),
        "a same-phase advance was sent again"
    );
    assert_eq!(
        journal.writes(),
        writes,
        "a tend that changed nothing wrote"
    );
    for lease in &leases {
        assert_eq!(w.phase(&lease.id), Phase::Custody);
    }
}

/// A Tend with nothing running and nothing held asks nothing of the
/// provider or the plane.
#[tokio::test]
async fn a_tend_with_nothing_held_touches_nothing() {
    let w = World::new();
    let r = w.runner();
    r.recover().await.unwrap();
    let (lists, heartbeats) = (w.fake.count(Operation::List), w.plane.heartbeats());
    r.tend().await.unwrap();
    assert_eq!(w.fake.count(Operation::List), lists);
    assert_eq!(w.plane.heartbeats(), heartbeats);
}

// ----- spec/node.md §7.D: interruptions -----

const SPOT: EndReason = EndReason::SpotInterruption(SpotAction::Terminate);

#[tokio::test]
async fn a_spot_interruption_fails_every_running_lease_with_its_reason_and_destroys_its_instance() {
    let w = World::new();
    let r = w.runner();
    let a = w.launched(&r, 1).await;
    let b = w.launched(&r, 2).await;
    w.core().job_starts(&name(&a.id));
    let done = r.interrupt(SPOT).await;
    assert_eq!((done.ended, done.unrecorded), (2, 0));
    for lease in [&a, &b] {
        assert!(!w.exists(&lease.id), "{} still runs", lease.id);
        assert_eq!(
            w.core().leases[&lease.id].failure_reason.as_deref(),
            Some("ec2 spot interruption: terminate")
        );
    }
    r.tend().await.unwrap();
    assert_eq!(w.phase(&a.id), Phase::Failed);
    assert_eq!(w.phase(&b.id), Phase::Failed);
    assert!(!r.holding());
    // Idempotent: a standing notice asked about again ends nothing more.
    assert_eq!(r.interrupt(SPOT).await, Default::default());
}

/// §7.D.2: the reason is durable before anything is destroyed; a plane
/// that cannot record it leaves the runner alone until it can.
#[tokio::test]
async fn an_interruption_destroys_nothing_until_its_reason_is_recorded() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    w.fault(&lease.id, LOp::MarkFailure, Fault::Refuse);
    let done = r.interrupt(SPOT).await;
    assert_eq!((done.ended, done.unrecorded), (0, 1));
    assert!(
        w.exists(&lease.id),
        "destroyed before its reason was recorded"
    );
    assert_eq!(w.fake.count(Operation::Destroy), 0);
    let done = r.interrupt(SPOT).await;
    assert_eq!((done.ended, done.unrecorded), (1, 0));
    assert!(!w.exists(&lease.id));
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert_eq!(
        w.core().leases[&lease.id].failure_reason.as_deref(),
        Some("ec2 spot interruption: terminate")
    );
}

/// A lease in custody (its job left to finish) gets the same treatment:
/// discarded, its instance destroyed, released failed with the reason.
#[tokio::test]
async fn a_spot_interruption_ends_a_lease_held_in_custody_too() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    r.assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    assert_eq!(custody(&r), BTreeSet::from([lease.id.clone()]));
    let done = r.interrupt(SPOT).await;
    assert_eq!((done.ended, done.unrecorded), (1, 0));
    assert!(!w.exists(&lease.id));
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert_eq!(
        w.core().leases[&lease.id].failure_reason.as_deref(),
        Some("ec2 spot interruption: terminate")
    );
    assert!(!r.holding());
}

/// A runner over `w`'s provider and plane whose journal is `journal`.
fn runner_over(w: &World, journal: &Arc<CountingJournal>) -> Runner {
    let provider: Arc<dyn Provider> = w.fake.clone();
    Runner::new(
        provider,
        w.plane.clone(),
        w.plane.clone(),
        RunnerOptions::default(),
    )
    .with_journal(journal.clone())
}

/// The leases the journal holds custody records for.
async fn journaled_custody(journal: &CountingJournal) -> BTreeSet<String> {
    journal
        .custody()
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.lease)
        .collect()
}

/// A custody entry whose journal write failed (a full disk, an I/O error)
/// is written again by the next tend, though nothing in it changed since:
/// a restart must not forget compute this node holds. Once written, a
/// tend that changes nothing writes nothing.
#[tokio::test]
async fn a_custody_entry_whose_journal_write_failed_is_written_at_the_next_tend() {
    let w = World::new();
    let journal = Arc::new(CountingJournal::default());
    let r = runner_over(&w, &journal);
    let lease = w.launched(&r, 1).await;
    journal.fail_custody_writes(1);
    r.assume_custody(&lease.id, lease.epoch, RequestId(1))
        .await
        .unwrap();
    assert_eq!(custody(&r), BTreeSet::from([lease.id.clone()]));
    assert!(
        journaled_custody(&journal).await.is_empty(),
        "the injected failure did not fail the write"
    );
    r.tend().await.unwrap();
    assert_eq!(
        journaled_custody(&journal).await,
        BTreeSet::from([lease.id.as_str().to_owned()]),
        "the next tend did not write the entry again"
    );
    let writes = journal.writes();
    r.tend().await.unwrap();
    assert_eq!(
        journal.writes(),
        writes,
        "a tend that changed nothing wrote"
    );
}

/// Recovery's adoptions, journaled in one transaction that failed, are
/// written at the next tend (in one transaction again).
#[tokio::test]
async fn adoptions_whose_journal_write_failed_are_written_at_the_next_tend() {
    let w = World::new();
    let leases: BTreeSet<String> = (1..=3)
        .map(|i| {
            let lease = w.launching_lease(i);
            w.put_instance(&name(&lease.id), true);
            lease.id.as_str().to_owned()
        })
        .collect();
    let journal = Arc::new(CountingJournal::default());
    journal.fail_custody_writes(1);
    let r = runner_over(&w, &journal);
    r.recover().await.unwrap();
    assert_eq!(custody(&r).len(), leases.len());
    assert!(journaled_custody(&journal).await.is_empty());
    let writes = journal.writes();
    r.tend().await.unwrap();
    assert_eq!(journaled_custody(&journal).await, leases);
    assert_eq!(journal.writes(), writes + 1, "written one by one");
}

// ======================= Sticky disks =======================

#[tokio::test]
async fn a_sticky_disk_is_bound_at_launch_committed_after_a_succeeded_job_and_discarded_otherwise()
{
    use billet_agent::cache::{DiskKey, Generation, Policy, StickyDisk, Store};
    let w = World::new();
    let root = std::env::temp_dir().join(format!(
        "billet-scenario-cache-{}",
        uuid::Uuid::new_v4().simple()
    ));
    let store = Arc::new(
        Store::open(&root, "dev", Arc::new(MemoryJournal::default()))
            .await
            .unwrap(),
    );
    let provider: Arc<dyn Provider> = w.fake.clone();
    let r = Runner::new(
        provider,
        w.plane.clone(),
        w.plane.clone(),
        RunnerOptions::default(),
    )
    .with_journal(w.journal.clone())
    .with_cache(
        store.clone(),
        billet_agent::cache::session::Sessions::open(store.clone()).await,
    );
    let mut t = tier(Trust::Trusted);
    t.sticky_disks = vec![StickyDisk::new("npm", "/cache/npm", Policy::Cas).unwrap()];
    let key = DiskKey::parse("npm").unwrap();

    // A succeeded job: bound before its compute started, committed once it
    // is gone.
    let first = w.reserve(1);
    r.launch(first.clone(), t.clone(), job(1, "push"))
        .await
        .unwrap();
    let spec = w.fake.specs()[0].clone();
    // The disk, then the cache session's directory, its token apart from
    // the plain environment.
    assert_eq!(spec.binds.len(), 2);
    assert_eq!(spec.binds[0].guest, "/cache/npm");
    assert_eq!(spec.binds[1].guest, billet_agent::cache::session::GUEST_DIR);
    assert!(spec.binds[1].host.join("cache.sock").exists());
    assert!(spec.cache_token.is_some());
    assert!(
        spec.env
            .iter()
            .any(|(k, _)| k == billet_agent::cache::session::ENDPOINT_ENV)
    );
    assert!(
        !spec
            .env
            .iter()
            .any(|(k, _)| k == billet_agent::cache::session::TOKEN_ENV)
    );
    let session_dir = spec.binds[1].host.clone();
    std::fs::write(spec.binds[0].host.join("n"), "1").unwrap();
    w.fake.exit(&name(&first.id), 0, false);
    r.destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
        .await
        .unwrap();
    assert_eq!(store.head(&key).await.unwrap(), Some(Generation(1)));
    assert!(!session_dir.exists(), "the session closed with its compute");

    // A failed job finds it and publishes nothing.
    let second = w.reserve(2);
    r.launch(second.clone(), t.clone(), job(2, "push"))
        .await
        .unwrap();
    let spec = w.fake.specs()[1].clone();
    assert_eq!(
        std::fs::read_to_string(spec.binds[0].host.join("n")).unwrap(),
        "1"
    );
    std::fs::write(spec.binds[0].host.join("n"), "2").unwrap();
    w.fake.exit(&name(&second.id), 1, false);
    r.destroy(RequestId(2), &DestroyOrder::completion("failed"))
        .await
        .unwrap();
    assert_eq!(store.head(&key).await.unwrap(), Some(Generation(1)));
    assert!(!spec.binds[0].host.exists());

    // A forced destroy of a job GitHub says succeeded publishes nothing
    // either: the node cannot know the tree is whole.
    let third = w.reserve(3);
    r.launch(third.clone(), t, job(3, "push")).await.unwrap();
    let mut forced = DestroyOrder::completion("succeeded");
    forced.force = true;
    r.destroy(RequestId(3), &forced).await.unwrap();
    assert_eq!(store.head(&key).await.unwrap(), Some(Generation(1)));
    assert!(store.mounts().await.is_empty());
}

/// Waits, up to 10 s, until `done` holds.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Settling a job's sticky disks records what the cache did against its
/// lease, once, at the epoch the lease held when the disks were mounted
/// (fenced: a lease reclaimed meanwhile records nothing, and the teardown
/// goes on); a lease without sticky disks sends nothing.
#[tokio::test]
async fn settling_a_jobs_sticky_disks_records_its_cache_observation_once_epoch_fenced() {
    use billet_agent::cache::{Observation, Policy, StickyDisk, Store};
    let w = World::new();
    let root = std::env::temp_dir().join(format!(
        "billet-scenario-observation-{}",
        uuid::Uuid::new_v4().simple()
    ));
    let store = Arc::new(
        Store::open(&root, "dev", Arc::new(MemoryJournal::default()))
            .await
            .unwrap(),
    );
    let provider: Arc<dyn Provider> = w.fake.clone();
    let r = Runner::new(
        provider,
        w.plane.clone(),
        w.plane.clone(),
        RunnerOptions::default(),
    )
    .with_journal(w.journal.clone())
    .with_cache(
        store.clone(),
        billet_agent::cache::session::Sessions::open(store.clone()).await,
    );
    let mut t = tier(Trust::Trusted);
    t.sticky_disks = vec![StickyDisk::new("npm", "/cache/npm", Policy::Cas).unwrap()];

    // A miss that commits 3 bytes, then a hit restoring them.
    let first = w.reserve(1);
    r.launch(first.clone(), t.clone(), job(1, "push"))
        .await
        .unwrap();
    let spec = w.fake.specs()[0].clone();
    std::fs::write(spec.binds[0].host.join("n"), "abc").unwrap();
    w.fake.exit(&name(&first.id), 0, false);
    r.destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
        .await
        .unwrap();
    until("the first observation", || {
        w.core().cache_observations.contains_key(&first.id)
    })
    .await;
    assert_eq!(
        w.core().cache_observations[&first.id],
        Observation {
            misses: 1,
            bytes_committed: 3,
            ..Observation::default()
        }
    );

    let second = w.reserve(2);
    r.launch(second.clone(), t.clone(), job(2, "push"))
        .await
        .unwrap();
    w.fake.exit(&name(&second.id), 1, false);
    r.destroy(RequestId(2), &DestroyOrder::completion("failed"))
        .await
        .unwrap();
    until("the second observation", || {
        w.core().cache_observations.contains_key(&second.id)
    })
    .await;
    assert_eq!(
        w.core().cache_observations[&second.id],
        Observation {
            hits: 1,
            bytes_restored: 3,
            ..Observation::default()
        }
    );

    // Reclaimed between the mount and the settle: the ledger fences the
    // observation, and the teardown still ends.
    let third = w.reserve(3);
    r.launch(third.clone(), t.clone(), job(3, "push"))
        .await
        .unwrap();
    w.core().leases.get_mut(&third.id).unwrap().epoch += 1;
    let mut forced = DestroyOrder::completion("succeeded");
    forced.force = true;
    r.destroy(RequestId(3), &forced).await.ok();
    until("the third observation sent", || {
        w.plane
            .count(&format!("record_cache_observation {}", third.id))
            == 1
    })
    .await;
    assert!(!w.core().cache_observations.contains_key(&third.id));
    assert!(store.mounts().await.is_empty(), "the disks were settled");

    // A lease without sticky disks sends nothing.
    let fourth = w.reserve(4);
    r.launch(fourth.clone(), tier(Trust::Trusted), job(4, "push"))
        .await
        .unwrap();
    w.fake.exit(&name(&fourth.id), 0, false);
    r.destroy(RequestId(4), &DestroyOrder::completion("succeeded"))
        .await
        .unwrap();
    for lease in [&first.id, &second.id, &third.id, &fourth.id] {
        let line = format!("record_cache_observation {lease}");
        let sent = w.plane.log().iter().filter(|l| **l == line).count();
        assert_eq!(sent, usize::from(*lease != fourth.id), "{lease}");
    }
}

/// A runner with a sticky-disk store of its own under the temp directory,
/// and that store.
async fn cached_runner(
    w: &World,
    options: RunnerOptions,
) -> (Runner, Arc<billet_agent::cache::Store>) {
    use billet_agent::cache::Store;
    let root = std::env::temp_dir().join(format!(
        "billet-scenario-trust-{}",
        uuid::Uuid::new_v4().simple()
    ));
    let store = Arc::new(
        Store::open(&root, "dev", Arc::new(MemoryJournal::default()))
            .await
            .unwrap(),
    );
    let provider: Arc<dyn Provider> = w.fake.clone();
    let runner = Runner::new(provider, w.plane.clone(), w.plane.clone(), options)
        .with_journal(w.journal.clone())
        .with_cache(
            store.clone(),
            billet_agent::cache::session::Sessions::open(store.clone()).await,
        );
    (runner, store)
}

/// spec/cache.md §7.1 scenario 4 and §5.1: an untrusted job reads the
/// trusted baseline and never publishes, whatever GitHub says of its job;
/// its mount is withdrawn in the journal before its compute is created.
#[tokio::test]
async fn an_untrusted_job_reads_the_trusted_generation_and_its_writes_are_discarded() {
    use billet_agent::cache::{DiskKey, Generation, Policy, StickyDisk};
    let w = World::new();
    let (r, store) = cached_runner(
        &w,
        RunnerOptions {
            isolated_containers: true,
            ..RunnerOptions::default()
        },
    )
    .await;
    let disks = vec![StickyDisk::new("npm", "/cache/npm", Policy::LastWriterWins).unwrap()];
    let key = DiskKey::parse("npm").unwrap();
    let mut trusted = tier(Trust::Trusted);
    trusted.sticky_disks = disks.clone();
    let mut untrusted = tier(Trust::Untrusted);
    untrusted.sticky_disks = disks;

    let first = w.reserve(1);
    r.launch(first.clone(), trusted.clone(), job(1, "push"))
        .await
        .unwrap();
    std::fs::write(w.fake.specs()[0].binds[0].host.join("n"), "1").unwrap();
    w.fake.exit(&name(&first.id), 0, false);
    r.destroy(RequestId(1), &DestroyOrder::completion("succeeded"))
        .await
        .unwrap();
    assert_eq!(store.head(&key).await.unwrap(), Some(Generation(1)));

    let second = w.reserve(2);
    r.launch(second.clone(), untrusted, job(2, "pull_request"))
        .await
        .unwrap();
    let spec = w.fake.specs()[1].clone();
    assert_eq!(
        std::fs::read_to_string(spec.binds[0].host.join("n")).unwrap(),
        "1",
        "the untrusted job reads the trusted generation"
    );
    let mounts = store.mounts().await;
    assert_eq!(mounts.len(), 1);
    assert!(
        !mounts[0].committable,
        "withdrawn from publication before the compute ran: {mounts:?}"
    );
    std::fs::write(spec.binds[0].host.join("n"), "poisoned").unwrap();
    w.fake.exit(&name(&second.id), 0, false);
    r.destroy(RequestId(2), &DestroyOrder::completion("succeeded"))
        .await
        .unwrap();
    assert_eq!(
        store.head(&key).await.unwrap(),
        Some(Generation(1)),
        "nothing published"
    );
    assert!(store.mounts().await.is_empty(), "its mount was discarded");
    assert!(!spec.binds[0].host.exists());

    // The next trusted job finds the old head.
    let third = w.reserve(3);
    r.launch(third.clone(), trusted, job(3, "push"))
        .await
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(w.fake.specs()[2].binds[0].host.join("n")).unwrap(),
        "1"
    );
}

/// A sticky disk whose settling failed when its job ended (spec/cache.md
/// §3.2, §3.4) is tried again at the next sweep whose provider listing
/// succeeded, and goes (`RetryClosed`); a sweep whose listing failed
/// discards nothing, because a failed listing is not an empty one
/// (`ReconcileInventory` only from a successful inventory).
#[tokio::test]
async fn a_sticky_disk_left_by_a_failed_settle_goes_at_the_next_listed_sweep_never_at_a_failed_one()
{
    use billet_agent::cache::{Policy, StickyDisk};
    let w = World::new();
    let (r, store) = cached_runner(&w, RunnerOptions::default()).await;
    let root = store.dir().to_owned();
    let mut t = tier(Trust::Trusted);
    t.sticky_disks = vec![StickyDisk::new("npm", "/cache/npm", Policy::Cas).unwrap()];
    let first = w.reserve(1);
    r.launch(first.clone(), t, job(1, "push")).await.unwrap();
    let disk = w.fake.specs()[0].binds[0].host.clone();
    // The job ends while its disk cannot be removed (the store's trash is
    // not a directory): the teardown goes on and the disk stays.
    let trash = root.join("trash");
    std::fs::rename(&trash, root.join("trash.away")).unwrap();
    std::fs::write(&trash, "").unwrap();
    w.fake.exit(&name(&first.id), 1, false);
    r.destroy(RequestId(1), &DestroyOrder::completion("failed"))
        .await
        .unwrap();
    assert!(w.fake.instances().is_empty());
    assert_eq!(store.mounts().await.len(), 1);
    std::fs::remove_file(&trash).unwrap();
    std::fs::rename(root.join("trash.away"), &trash).unwrap();
    // A sweep that cannot list the provider proves nothing.
    w.fake.fail_next(Operation::List, 1);
    assert!(r.sweep().await.is_err());
    assert_eq!(store.mounts().await.len(), 1, "fenced on a failed listing");
    assert!(disk.exists());
    // The next one lists nothing of the lease's, which nobody holds.
    r.sweep().await.unwrap();
    assert!(store.mounts().await.is_empty());
    assert!(!disk.exists());
}

/// A runner that exits before coming online saying GitHub refused its
/// version ends `runner_version_rejected`, not `exit 1`; its image is then
/// refused, typed, before anything is minted for the next launch, and runs
/// again once it is rebuilt (another image id).
#[tokio::test]
async fn a_runner_refused_for_its_version_ends_runner_version_rejected_and_its_image_is_refused_until_rebuilt()
 {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    let runner_name = name(&lease.id);
    w.fake.set_output(
        &InstanceName::for_lease(&lease.id),
        "√ Connected to GitHub\nRunner version v2.331.0 is deprecated and cannot receive messages.\n",
    );
    assert!(w.fake.exit(&runner_name, 1, false));
    r.tend().await.unwrap();
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert_eq!(
        reason(&w, &lease.id).as_deref(),
        Some("runner_version_rejected")
    );
    let mints = w.plane.count("mint ");
    let again = w.reserve(2);
    let refused = r
        .launch(again.clone(), tier(Trust::Trusted), job(2, "push"))
        .await
        .expect_err("an image a runner was refused on launches again");
    assert!(
        matches!(refused, RunnerError::RunnerOutdated(ref m) if m.contains("refused its version")),
        "{refused:?}"
    );
    assert_eq!(w.plane.count("mint "), mints, "{:?}", w.plane.log());
    assert!(!w.exists(&again.id));
    assert_eq!(w.phase(&again.id), Phase::Failed);
    assert_eq!(r.freshness().outdated().len(), 1);
    w.fake.rebuild_image(&tier(Trust::Trusted).image);
    w.launched(&r, 3).await;
}

/// A runner that exits 1 for any other reason ends `exit 1`, and its image
/// launches again.
#[tokio::test]
async fn a_runner_that_exits_1_for_another_reason_ends_exit_1_and_its_image_runs_on() {
    let w = World::new();
    let r = w.runner();
    let lease = w.launched(&r, 1).await;
    w.fake.set_output(
        &InstanceName::for_lease(&lease.id),
        "An error occurred: Not configured\n",
    );
    assert!(w.fake.exit(&name(&lease.id), 1, false));
    r.tend().await.unwrap();
    assert_eq!(reason(&w, &lease.id).as_deref(), Some("exit 1"));
    w.launched(&r, 2).await;
}

/// An image whose label names a runner older than the tier's minimum is
/// refused, typed, naming both versions, before anything is minted.
#[tokio::test]
async fn a_launch_whose_image_is_labelled_older_than_the_minimum_is_refused_before_a_mint() {
    let w = World::new();
    let r = w.runner();
    let mut old = tier(Trust::Trusted);
    old.min_runner_version = Some(RunnerVersion::parse("2.331.0").unwrap());
    w.fake.set_image_version(&old.image, "2.320.0");
    let lease = w.reserve(1);
    let refused = r
        .launch(lease.clone(), old.clone(), job(1, "push"))
        .await
        .expect_err("an outdated runner launches");
    let RunnerError::RunnerOutdated(message) = &refused else {
        panic!("{refused:?}")
    };
    assert!(
        message.contains("2.320.0") && message.contains("2.331.0"),
        "{message}"
    );
    assert_eq!(w.plane.count("mint "), 0, "{:?}", w.plane.log());
    assert_eq!(w.phase(&lease.id), Phase::Failed);
    assert_eq!(reason(&w, &lease.id).as_deref(), Some("runner_outdated"));
    // The same image labelled at the minimum runs.
    w.fake.set_image_version(&old.image, "v2.331.0");
    let lease = w.reserve(2);
    r.launch(lease, old, job(2, "push"))
        .await
        .expect("a runner at the minimum launches");
}

/// A failed launch's compute still being torn down (its create refused,
/// its absence not yet proven) does not refuse the next launch of its job:
/// that compute has no registration and is destroyed on sight.
#[tokio::test]
async fn a_launch_is_not_refused_while_its_jobs_failed_launch_is_still_torn_down() {
    let w = World::new();
    let r = w.runner();
    w.fake.fail_next(Operation::Create, 1);
    let first = w.reserve(1);
    let err = r
        .launch(first.clone(), tier(Trust::Trusted), job(1, "push"))
        .await
        .expect_err("the create failed");
    assert!(
        r.holding(),
        "the failed launch is held until proven gone: {err}"
    );
    let second = w.reserve(1);
    r.launch(second.clone(), tier(Trust::Trusted), job(1, "push"))
        .await
        .expect("the job's next launch goes on beside the teardown");
    assert!(w.exists(&second.id));
}

/// A tier whose creates the engine keeps refusing is refused after three
/// in a row, before anything is bound, minted or created, and says so; a
/// changed tier is let through at once, and its success starts the count
/// over.
#[tokio::test]
async fn a_tier_the_engine_refuses_three_times_in_a_row_is_refused_before_any_bind_or_mint() {
    let w = World::new();
    let r = w.runner();
    w.fake.fail_next(Operation::Create, 3);
    for request in 1..=3 {
        let lease = w.reserve(request);
        let err = r
            .launch(lease, tier(Trust::Trusted), job(request, "push"))
            .await
            .expect_err("the create failed");
        assert!(
            !matches!(err, RunnerError::TierUnhealthy(_)),
            "refused before the third failure: {err}"
        );
    }
    let mints = |w: &World| {
        w.plane
            .log()
            .iter()
            .filter(|l| l.starts_with("mint ") || l.starts_with("bind"))
            .count()
    };
    let before = (mints(&w), w.fake.count(Operation::Create));
    let lease = w.reserve(4);
    let err = r
        .launch(lease.clone(), tier(Trust::Trusted), job(4, "push"))
        .await
        .expect_err("the tier is refused");
    let RunnerError::TierUnhealthy(unhealthy) = &err else {
        panic!("not refused as unhealthy: {err}");
    };
    assert_eq!(unhealthy.failures, 3);
    assert!(unhealthy.last_error.contains("injected failure"), "{err}");
    assert!(
        unhealthy.retry_after > Duration::from_secs(20)
            && unhealthy.retry_after <= Duration::from_secs(30),
        "{err}"
    );
    assert_eq!(
        (mints(&w), w.fake.count(Operation::Create)),
        before,
        "the refused launch bound, minted or created"
    );
    assert!(!w.bound(&lease.id));
    let shown = r.unhealthy_tiers();
    assert_eq!(shown.len(), 1);
    assert_eq!(shown[0].tier, "t");

    // The operator fixes the tier: another definition goes through at once.
    let mut fixed = tier(Trust::Trusted);
    fixed.env.push(("FIXED".into(), "1".into()));
    let lease = w.reserve(5);
    r.launch(lease.clone(), fixed, job(5, "push"))
        .await
        .expect("a changed tier is let through");
    assert!(r.unhealthy_tiers().is_empty());
}

/// A threshold of 0 never refuses a tier.
#[tokio::test]
async fn with_the_threshold_at_zero_a_tier_is_never_refused() {
    let w = World::new();
    let r = w.runner_with(RunnerOptions {
        tier_failures_before_unhealthy: 0,
        ..RunnerOptions::default()
    });
    w.fake.fail_next(Operation::Create, 5);
    for request in 1..=5 {
        let err = r
            .launch(
                w.reserve(request),
                tier(Trust::Trusted),
                job(request, "push"),
            )
            .await
            .expect_err("the create failed");
        assert!(!matches!(err, RunnerError::TierUnhealthy(_)), "{err}");
    }
    assert!(r.unhealthy_tiers().is_empty());
}
