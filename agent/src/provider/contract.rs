//! The provider contract: one set of behaviour checks, written once, that
//! every [`Provider`] passes — the [`FakeProvider`](super::fake::FakeProvider)
//! beside the unit tests and the simulation, and the Docker provider against
//! the real engine — so the fake cannot drift from what Docker does.
//!
//! Each check is a `pub async fn` over a [`Driver`], which hands out the
//! provider and plays the faults the provider cannot play on itself (a
//! runner that exits, one that allocates past its memory limit, a `docker
//! kill`, a container removed behind the node's back, an engine that is down
//! or hangs). A check panics, naming what the provider did, when the
//! provider breaks the contract; it cleans up what it created on success.
//!
//! The contract (module [`super`] says it in prose):
//! - an instance whose process ended is listed and found, not running, with
//!   its exit code and OOM flag, until it is destroyed, and then it is gone;
//! - an instance removed out of band is absent from `find` and `list`, and
//!   destroying it is success;
//! - a missing image is [`ProviderError::ImageUnavailable`] from
//!   `check_image` and from `create`, which creates nothing;
//! - an engine with nothing listening fails every call with
//!   [`ProviderError::Unreachable`], and one that accepts and never answers
//!   fails every call with [`ProviderError::Timeout`] within the provider's
//!   bound: no call hangs.

use std::time::Duration;

use async_trait::async_trait;

use super::{Exit, Instance, InstanceSpec, InstanceState, Provider, ProviderError, Teardown, Work};
use crate::model::{InstanceName, LeaseId};

/// How long a check waits for an instance to reach a state.
pub(crate) const SETTLE_BOUND: Duration = Duration::from_secs(60);

/// What the runner inside an instance does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Behaviour {
    /// Works until it is stopped.
    Work,
    /// Exits on its own with this code.
    Exit(i64),
    /// Allocates memory until the OOM killer ends it under a 128 MiB limit.
    Allocate,
    /// Works on a job: the runner's job process
    /// ([`JOB_PROCESS`](super::JOB_PROCESS)) runs in it until it is stopped.
    Job,
}

/// Plays, for one provider, what the checks need.
#[async_trait]
pub(crate) trait Driver: Send + Sync {
    /// The provider under test.
    fn provider(&self) -> &dyn Provider;
    /// A spec for a new lease named from `tag` whose runner does
    /// `behaviour`.
    fn spec(&self, tag: &str, behaviour: Behaviour) -> InstanceSpec;
    /// Called once after a create: makes the instance do what its behaviour
    /// says, for an engine whose instances do not act on their own. A real
    /// engine's driver does nothing.
    async fn enact(&self, name: &InstanceName, behaviour: Behaviour);
    /// Kills the instance's process with SIGKILL behind the provider's back
    /// (`docker kill`).
    async fn kill(&self, name: &InstanceName);
    /// Removes the instance behind the provider's back (`docker rm -f`).
    async fn remove_out_of_band(&self, name: &InstanceName);
    /// A provider of the same kind whose engine has nothing listening.
    async fn unreachable(&self) -> Box<dyn Provider>;
    /// A provider of the same kind whose engine accepts and never answers,
    /// bounded by `bound` per call.
    async fn hanging(&self, bound: Duration) -> Box<dyn Provider>;
    /// An image reference the engine does not have.
    fn missing_image(&self) -> String;
}

/// Waits until `find` shows the instance in a state `until` accepts.
async fn settle(
    provider: &dyn Provider,
    name: &InstanceName,
    what: &str,
    until: impl Fn(&InstanceState) -> bool,
) -> Instance {
    let deadline = tokio::time::Instant::now() + SETTLE_BOUND;
    loop {
        let found = provider
            .find(name)
            .await
            .unwrap_or_else(|e| panic!("find {name} while waiting for {what}: {e}"));
        match found {
            Some(instance) if until(&instance.state) => return instance,
            other => assert!(
                tokio::time::Instant::now() < deadline,
                "{name} did not reach {what} within {SETTLE_BOUND:?}: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Checks that an exited instance reads the same through `list` and `find`,
/// not running, and that destroying it leaves nothing.
async fn exited_until_destroyed(provider: &dyn Provider, name: &InstanceName, exit: Exit) {
    let found = provider.find(name).await.expect("find").expect("present");
    assert_eq!(found.state, InstanceState::Exited(exit), "{found:?}");
    assert!(!found.may_run(), "{found:?}");
    let listed = provider.list().await.expect("list");
    let entry = listed
        .iter()
        .find(|i| i.name == name.as_str())
        .unwrap_or_else(|| panic!("an exited instance is still listed: {listed:?}"));
    assert_eq!(entry.state, InstanceState::Exited(exit), "{entry:?}");
    assert_eq!(
        entry.lease().as_ref(),
        InstanceName::lease(name.as_str()).as_ref()
    );
    assert_eq!(
        provider.destroy(name).await.expect("destroy"),
        Teardown::Stopped
    );
    assert_eq!(provider.find(name).await.expect("find"), None);
    assert!(
        !provider
            .list()
            .await
            .expect("list")
            .iter()
            .any(|i| i.name == name.as_str()),
        "destroyed and still listed"
    );
}

/// A runner that exits on its own leaves its instance present, exited with
/// its code and not OOM-killed, until it is destroyed.
///
/// # Panics
///
/// When the provider breaks the contract.
pub(crate) async fn an_exited_instance_is_present_with_its_code_until_destroyed(
    driver: &dyn Driver,
) {
    let provider = driver.provider();
    let spec = driver.spec("exit", Behaviour::Exit(3));
    let name = spec.name.clone();
    let created = provider.create(spec).await.expect("create");
    assert_eq!(created.name, name.as_str());
    driver.enact(&name, Behaviour::Exit(3)).await;
    settle(provider, &name, "exited", |s| s.exit().is_some()).await;
    exited_until_destroyed(
        provider,
        &name,
        Exit {
            code: 3,
            oom_killed: false,
        },
    )
    .await;
}

/// A runner that allocates past its 128 MiB limit is OOM-killed: exited
/// 137 with the OOM flag.
///
/// # Panics
///
/// When the provider breaks the contract.
pub(crate) async fn an_oom_killed_instance_says_so(driver: &dyn Driver) {
    let provider = driver.provider();
    let spec = driver.spec("oom", Behaviour::Allocate);
    assert_eq!(spec.memory.0, 128 << 20, "the check runs under 128 MiB");
    let name = spec.name.clone();
    provider.create(spec).await.expect("create");
    driver.enact(&name, Behaviour::Allocate).await;
    settle(provider, &name, "exited", |s| s.exit().is_some()).await;
    exited_until_destroyed(
        provider,
        &name,
        Exit {
            code: 137,
            oom_killed: true,
        },
    )
    .await;
}

/// A runner killed behind the provider's back (`docker kill`) is exited
/// 137, not OOM-killed.
///
/// # Panics
///
/// When the provider breaks the contract.
pub(crate) async fn a_killed_instance_is_exited_137_without_the_oom_flag(driver: &dyn Driver) {
    let provider = driver.provider();
    let spec = driver.spec("kill", Behaviour::Work);
    let name = spec.name.clone();
    provider.create(spec).await.expect("create");
    let running = provider.find(&name).await.expect("find").expect("present");
    assert!(running.may_run(), "{running:?}");
    driver.kill(&name).await;
    settle(provider, &name, "exited", |s| s.exit().is_some()).await;
    exited_until_destroyed(
        provider,
        &name,
        Exit {
            code: 137,
            oom_killed: false,
        },
    )
    .await;
}

/// An instance whose runner's job process runs is [`Work::Busy`]; one that
/// runs no job process, one that has exited and one that is gone are
/// [`Work::Idle`].
///
/// # Panics
///
/// When the provider breaks the contract.
pub(crate) async fn a_runner_is_busy_exactly_while_its_job_process_runs(driver: &dyn Driver) {
    let provider = driver.provider();
    let job = driver.spec("job", Behaviour::Job);
    let at_work = job.name.clone();
    let idle = driver.spec("idle", Behaviour::Work);
    let listening = idle.name.clone();
    provider.create(job).await.expect("create");
    driver.enact(&at_work, Behaviour::Job).await;
    provider.create(idle).await.expect("create");
    assert_eq!(provider.work(&at_work).await.expect("work"), Work::Busy);
    assert_eq!(provider.work(&listening).await.expect("work"), Work::Idle);
    driver.kill(&at_work).await;
    settle(provider, &at_work, "exited", |s| s.exit().is_some()).await;
    assert_eq!(provider.work(&at_work).await.expect("work"), Work::Idle);
    for name in [&at_work, &listening] {
        provider.destroy(name).await.expect("destroy");
        assert_eq!(provider.work(name).await.expect("work"), Work::Idle);
    }
}

/// An instance removed behind the provider's back is absent, and
/// destroying it is success.
///
/// # Panics
///
/// When the provider breaks the contract.
pub(crate) async fn an_instance_removed_out_of_band_is_absent(driver: &dyn Driver) {
    let provider = driver.provider();
    let spec = driver.spec("removed", Behaviour::Work);
    let name = spec.name.clone();
    let lease: LeaseId = spec.lease.clone();
    provider.create(spec).await.expect("create");
    driver.remove_out_of_band(&name).await;
    assert_eq!(provider.find(&name).await.expect("find"), None);
    let listed = provider.list().await.expect("list");
    assert!(
        !listed.iter().any(|i| i.lease().as_ref() == Some(&lease)),
        "{listed:?}"
    );
    assert_eq!(
        provider.destroy(&name).await.expect("destroy"),
        Teardown::Stopped
    );
}

/// A create whose start is withheld (a launch that created beside its
/// bind, whose bind was then refused) tells the caller the instance
/// exists, waits for the gate, then answers
/// [`ProviderError::StartWithheld`] and leaves the instance `created`,
/// never started, until destroyed; a create whose gate opens runs it.
///
/// # Panics
///
/// When the provider breaks the contract.
pub(crate) async fn a_create_whose_start_is_withheld_leaves_the_instance_created_until_destroyed(
    driver: &dyn Driver,
) {
    let provider = driver.provider();
    let spec = driver.spec("withheld", Behaviour::Work);
    let name = spec.name.clone();
    let (created, exists) = tokio::sync::oneshot::channel();
    let (open, gate) = tokio::sync::oneshot::channel();
    let create = provider.create_then_start(spec, created, gate);
    let decide = async {
        exists.await.expect("the provider said the instance exists");
        let found = provider.find(&name).await.expect("find").expect("created");
        assert_eq!(found.state, InstanceState::Created, "{found:?}");
        let _ = open.send(false);
    };
    let (created, ()) = tokio::join!(create, decide);
    assert!(
        matches!(created, Err(ProviderError::StartWithheld { .. })),
        "a withheld start answered {created:?}"
    );
    let left = provider
        .find(&name)
        .await
        .expect("find")
        .expect("still there");
    assert_eq!(left.state, InstanceState::Created, "{left:?}");
    assert!(!left.may_run(), "{left:?}");
    assert_eq!(
        provider.destroy(&name).await.expect("destroy"),
        Teardown::Stopped
    );
    assert_eq!(provider.find(&name).await.expect("find"), None);

    let spec = driver.spec("opened", Behaviour::Work);
    let name = spec.name.clone();
    let (created, _) = tokio::sync::oneshot::channel();
    let (open, gate) = tokio::sync::oneshot::channel();
    let _ = open.send(true);
    let started = provider
        .create_then_start(spec, created, gate)
        .await
        .expect("a create whose gate opened");
    assert_eq!(started.state, InstanceState::Running, "{started:?}");
    provider.destroy(&name).await.expect("destroy");
}

/// A missing image is [`ProviderError::ImageUnavailable`] before and at
/// create, and nothing is created.
///
/// # Panics
///
/// When the provider breaks the contract.
pub(crate) async fn a_missing_image_is_unavailable_and_creates_nothing(driver: &dyn Driver) {
    let provider = driver.provider();
    let image = driver.missing_image();
    match provider.check_image(&image).await {
        Err(ProviderError::ImageUnavailable { image: named }) => assert_eq!(named, image),
        other => panic!("check_image of a missing image answered {other:?}"),
    }
    let mut spec = driver.spec("noimage", Behaviour::Work);
    spec.image.clone_from(&image);
    let name = spec.name.clone();
    match provider.create(spec).await {
        Err(ProviderError::ImageUnavailable { image: named }) => assert_eq!(named, image),
        other => panic!("create from a missing image answered {other:?}"),
    }
    assert_eq!(provider.find(&name).await.expect("find"), None);
    let present = driver.spec("image", Behaviour::Work).image;
    provider
        .check_image(&present)
        .await
        .unwrap_or_else(|e| panic!("check_image of the image in use: {e}"));
}

/// Calls every operation on `provider` and checks each fails as `expected`
/// says, within `bound`.
async fn every_call_fails(
    driver: &dyn Driver,
    provider: &dyn Provider,
    bound: Duration,
    expected: fn(&ProviderError) -> bool,
) {
    let spec = driver.spec("down", Behaviour::Work);
    let name = spec.name.clone();
    let image = spec.image.clone();
    let started = tokio::time::Instant::now();
    let limit = bound + Duration::from_secs(5);
    macro_rules! check {
        ($what:literal, $call:expr) => {
            match tokio::time::timeout(limit, $call).await {
                Err(_) => panic!("{} did not return within {limit:?}", $what),
                Ok(Ok(answer)) => panic!("{} succeeded on a broken engine: {answer:?}", $what),
                Ok(Err(e)) => assert!(expected(&e), "{} failed untyped: {e:?}", $what),
            }
        };
    }
    check!("list", provider.list());
    check!("find", provider.find(&name));
    check!("work", provider.work(&name));
    check!("destroy", provider.destroy(&name));
    check!("check_image", provider.check_image(&image));
    check!("create", provider.create(spec));
    assert!(
        started.elapsed() < limit * 5,
        "the calls took {:?}",
        started.elapsed()
    );
}

/// An engine with nothing listening fails every call at once with
/// [`ProviderError::Unreachable`].
///
/// # Panics
///
/// When the provider breaks the contract.
pub(crate) async fn an_unreachable_engine_fails_every_call_typed(driver: &dyn Driver) {
    let provider = driver.unreachable().await;
    every_call_fails(driver, provider.as_ref(), Duration::from_secs(5), |e| {
        matches!(e, ProviderError::Unreachable { .. })
    })
    .await;
}

/// An engine that accepts and never answers fails every call with
/// [`ProviderError::Timeout`] within the provider's bound.
///
/// # Panics
///
/// When the provider breaks the contract.
pub(crate) async fn a_hanging_engine_fails_every_call_typed_within_its_bound(driver: &dyn Driver) {
    let bound = Duration::from_secs(1);
    let provider = driver.hanging(bound).await;
    every_call_fails(driver, provider.as_ref(), bound, |e| {
        matches!(e, ProviderError::Timeout { .. })
    })
    .await;
}
