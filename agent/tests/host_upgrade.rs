//! `billet host-upgrade` refuses, with nothing touched, every instruction it
//! cannot carry out: the real binary, exec'd the way `billet node` execs it
//! on `StartUpgrade`, answering on file descriptor 3. "Nothing touched"
//! means: the service's stop command never ran, the installed binary is
//! byte for byte what it was, and nothing was left staged beside it.
//! (tests/tests/upgrade.rs drives accepted upgrades end to end.)

use std::path::PathBuf;
use std::time::Duration;

use billet_agent::model::UpgradeSpec;
use billet_agent::upgrade::dispatch::{ExecUpgrader, Refusal, UpgradeError, Upgrader};
use billet_agent::upgrade::release;
use billet_agent::upgrade::updater::{DIR, JOURNAL_FILE, LOCK_FILE, Record, Step};

const BILLET: &str = env!("CARGO_BIN_EXE_billet");

/// A host with billet installed, a release source holding `next`, and
/// service commands that leave a mark when run.
struct Host {
    dir: PathBuf,
    install: PathBuf,
    state: PathBuf,
    config: PathBuf,
    digest: String,
    installed_bytes: Vec<u8>,
    /// What the test wrote as `fence.json`, if anything.
    fence: std::cell::RefCell<Option<String>>,
}

const NEXT: &str = "7.0.0-next";

impl Host {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "billet-host-upgrade-{}",
            uuid::Uuid::new_v4().simple()
        ));
        let install = dir.join("bin/billet");
        std::fs::create_dir_all(install.parent().expect("parent")).expect("bin dir");
        let bytes = std::fs::read(BILLET).expect("billet");
        std::fs::write(&install, &bytes).expect("install");
        std::fs::set_permissions(
            &install,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .expect("chmod");
        let releases = dir.join("releases");
        let digest = release::write(&releases, NEXT, bytes.clone()).expect("release");
        let state = dir.join("state");
        let config = dir.join("upgrade.toml");
        std::fs::write(
            &config,
            format!(
                "release_source = {:?}\ninstall_path = {:?}\nstate_dir = {:?}\nstop_command = [\"/bin/sh\", \"-c\", \"touch {}\"]\nstart_command = [\"/bin/sh\", \"-c\", \"touch {}\"]\nhealth_timeout_secs = 5\n",
                releases.display().to_string(),
                install.display().to_string(),
                state.display().to_string(),
                dir.join("stopped").display(),
                dir.join("started").display(),
            ),
        )
        .expect("config");
        Self {
            dir,
            install,
            state,
            config,
            digest,
            installed_bytes: bytes,
            fence: std::cell::RefCell::new(None),
        }
    }

    /// Replaces the service's stop and start commands with shell lines.
    fn set_service(&self, stop: &str, start: &str) {
        let config: String = std::fs::read_to_string(&self.config)
            .expect("config")
            .lines()
            .filter(|l| !l.starts_with("stop_command") && !l.starts_with("start_command"))
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(
            &self.config,
            format!(
                "{config}stop_command = [\"/bin/sh\", \"-c\", {stop:?}]\nstart_command = [\"/bin/sh\", \"-c\", {start:?}]\n"
            ),
        )
        .expect("config");
    }

    fn spec(&self, generation: u64) -> UpgradeSpec {
        UpgradeSpec {
            version: NEXT.into(),
            manifest_sha256: Some(self.digest.clone()),
            rollout_id: Some("rollout-1".into()),
            generation,
        }
    }

    async fn upgrade(&self, spec: &UpgradeSpec) -> Result<(), UpgradeError> {
        let mut upgrader = ExecUpgrader::new(BILLET);
        upgrader.config = Some(self.config.clone());
        upgrader.ack_wait = Duration::from_secs(60);
        let mut tries = 0;
        loop {
            match upgrader.start_upgrade(spec).await {
                // ETXTBSY while another test thread forks; it clears.
                Err(UpgradeError::Spawn { source, .. })
                    if source.raw_os_error() == Some(26) && tries < 50 =>
                {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                other => return other,
            }
        }
    }

    async fn refused(&self, spec: &UpgradeSpec) -> String {
        match self.upgrade(spec).await {
            Err(UpgradeError::Refused {
                refusal: Refusal::Said(reason),
                ..
            }) => reason,
            other => panic!("expected a refusal with a reason, got {other:?}"),
        }
    }

    fn assert_untouched(&self) {
        assert!(
            !self.dir.join("stopped").exists(),
            "the node was stopped for a refused upgrade"
        );
        self.assert_binary_untouched();
        let dir = self.state.join(DIR);
        assert!(
            !dir.join(JOURNAL_FILE).exists(),
            "a refused upgrade was journalled"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join(billet_agent::upgrade::updater::FENCE_FILE)).ok(),
            *self.fence.borrow(),
            "a refused upgrade moved the fence"
        );
    }

    /// Writes `fence.json` as an earlier accepted upgrade would have.
    fn write_fence(&self, text: &str) {
        let dir = self.state.join(DIR);
        std::fs::create_dir_all(&dir).expect("upgrade dir");
        std::fs::write(dir.join(billet_agent::upgrade::updater::FENCE_FILE), text).expect("fence");
        *self.fence.borrow_mut() = Some(text.to_owned());
    }

    fn fence_json(&self) -> serde_json::Value {
        let path = self
            .state
            .join(DIR)
            .join(billet_agent::upgrade::updater::FENCE_FILE);
        serde_json::from_slice(&std::fs::read(&path).expect("fence.json")).expect("json")
    }

    fn assert_binary_untouched(&self) {
        assert_eq!(
            std::fs::read(&self.install).expect("installed"),
            self.installed_bytes,
            "the installed binary changed"
        );
        let staged: Vec<_> = std::fs::read_dir(self.install.parent().expect("bin"))
            .expect("bin dir")
            .filter_map(Result::ok)
            .map(|e| e.file_name())
            .filter(|n| n != "billet")
            .collect();
        assert!(staged.is_empty(), "left beside the binary: {staged:?}");
    }

    /// The journal a killed updater leaves for this host's upgrade to
    /// [`NEXT`], stopped at `step`.
    fn interrupted_at(&self, step: Step) -> Record {
        Record {
            version: NEXT.into(),
            from: env!("CARGO_PKG_VERSION").into(),
            rollout: Some("rollout-1".into()),
            generation: Some(1),
            install_path: self.install.clone(),
            previous_path: billet_agent::upgrade::updater::previous_path(&self.install),
            staged_path: self.dir.join("none"),
            updater_pid: 1,
            step,
            at: 0,
        }
    }

    fn journal(&self, record: &Record) {
        let dir = self.state.join(DIR);
        std::fs::create_dir_all(&dir).expect("upgrade dir");
        std::fs::write(
            dir.join(JOURNAL_FILE),
            serde_json::to_vec(record).expect("json"),
        )
        .expect("journal");
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        // A copy of the binary and a release: about 100 MB a host.
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Waits (at most 30 s) until the updater this host spawned has exited:
/// no process is left whose command line names this host's configuration.
/// The updater answers and then exits; one still lingering could run the
/// stop command after the assertion that nothing was touched.
fn wait_for_exit_of_updater(host: &Host) {
    let needle = host.config.as_os_str().as_encoded_bytes().to_vec();
    let lingering = || {
        std::fs::read_dir("/proc")
            .expect("/proc")
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
            .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
            .filter(|cmdline| {
                cmdline
                    .windows(needle.len())
                    .any(|w| w == needle.as_slice())
            })
            .count()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while lingering() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the updater for {} did not exit within 30s",
            host.config.display()
        );
        // A polling interval, not a wait for something to have happened.
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test]
async fn a_manifest_that_is_not_the_pinned_one_is_refused_before_anything_is_touched() {
    let host = Host::new();
    let mut spec = host.spec(1);
    spec.manifest_sha256 = Some("0".repeat(64));
    let reason = host.refused(&spec).await;
    assert!(reason.contains("the rollout pinned"), "{reason}");
    wait_for_exit_of_updater(&host);
    host.assert_untouched();
}

#[tokio::test]
async fn a_binary_that_is_not_the_manifests_is_refused_before_anything_is_touched() {
    let host = Host::new();
    let binary = host.dir.join("releases").join(NEXT).join("billet");
    let mut bytes = std::fs::read(&binary).expect("release binary");
    bytes.extend_from_slice(b"tampered");
    std::fs::write(&binary, bytes).expect("tamper");
    let reason = host.refused(&host.spec(1)).await;
    assert!(reason.contains("the manifest says"), "{reason}");
    wait_for_exit_of_updater(&host);
    host.assert_untouched();
}

#[tokio::test]
async fn a_stale_generation_is_refused_before_anything_is_touched() {
    let host = Host::new();
    // Generation 5 of this rollout was accepted, and another rollout since.
    host.write_fence(r#"{"rollout-1": 5, "rollout-2": 1}"#);
    let reason = host.refused(&host.spec(4)).await;
    assert!(
        reason.contains("generation 4 of rollout rollout-1 is stale"),
        "{reason}"
    );
    wait_for_exit_of_updater(&host);
    host.assert_untouched();
}

#[tokio::test]
async fn a_second_upgrade_while_one_holds_the_host_is_refused_before_anything_is_touched() {
    let host = Host::new();
    let dir = host.state.join(DIR);
    std::fs::create_dir_all(&dir).expect("upgrade dir");
    let claim = std::fs::File::create(dir.join(LOCK_FILE)).expect("lock file");
    claim.try_lock().expect("the test holds the host claim");
    let reason = host.refused(&host.spec(1)).await;
    assert!(
        reason.contains("another upgrade is in progress"),
        "{reason}"
    );
    wait_for_exit_of_updater(&host);
    host.assert_untouched();
    drop(claim);
}

#[tokio::test]
async fn a_release_missing_from_the_source_is_refused_naming_where_it_looked() {
    let host = Host::new();
    let mut spec = host.spec(1);
    spec.version = "8.0.0".into();
    spec.manifest_sha256 = None;
    let reason = host.refused(&spec).await;
    assert!(
        reason.contains(&format!("releases/8.0.0/{}", release::MANIFEST_FILE)),
        "{reason}"
    );
    wait_for_exit_of_updater(&host);
    host.assert_untouched();
}

#[tokio::test]
async fn an_instruction_for_the_installed_version_is_accepted_and_changes_nothing() {
    let host = Host::new();
    let mut spec = host.spec(1);
    spec.version = env!("CARGO_PKG_VERSION").into();
    spec.manifest_sha256 = None;
    spec.rollout_id = None;
    spec.generation = 0;
    host.upgrade(&spec).await.expect("accepted: nothing to do");
    wait_for_exit_of_updater(&host);
    host.assert_untouched();
}

#[tokio::test]
async fn an_instruction_for_the_installed_version_still_advances_the_fence() {
    let host = Host::new();
    let mut spec = host.spec(3);
    spec.version = env!("CARGO_PKG_VERSION").into();
    spec.manifest_sha256 = None;
    host.upgrade(&spec).await.expect("accepted: nothing to do");
    wait_for_exit_of_updater(&host);
    assert_eq!(host.fence_json(), serde_json::json!({"rollout-1": 3}));
    // A delayed, older instruction of the same rollout is now stale.
    let reason = host.refused(&host.spec(2)).await;
    assert!(
        reason.contains("generation 2 of rollout rollout-1 is stale"),
        "{reason}"
    );
    wait_for_exit_of_updater(&host);
    assert!(!host.dir.join("stopped").exists());
    host.assert_binary_untouched();
}

#[tokio::test]
async fn an_instruction_for_the_installed_version_pinning_another_binary_is_refused() {
    let host = Host::new();
    let version = env!("CARGO_PKG_VERSION");
    let mut spec = host.spec(1);
    spec.version = version.into();
    // No such release in the source: the pin cannot be checked.
    spec.manifest_sha256 = Some("ab".repeat(32));
    let reason = host.refused(&spec).await;
    assert!(
        reason.contains(&format!("{version}/manifest.json")),
        "{reason}"
    );
    // A release of this version whose binary is not the installed one
    // (stamped, so its bytes differ).
    let digest = release::write(
        &host.dir.join("releases"),
        version,
        host.installed_bytes.clone(),
    )
    .expect("release");
    spec.manifest_sha256 = Some(digest);
    let reason = host.refused(&spec).await;
    assert!(reason.contains("is not that release's binary"), "{reason}");
    wait_for_exit_of_updater(&host);
    host.assert_untouched();
}

#[tokio::test]
async fn an_accepted_upgrade_advances_the_fence_for_its_rollout_only() {
    let host = Host::new();
    host.write_fence(r#"{"rollout-2": 9}"#);
    host.upgrade(&host.spec(5)).await.expect("accepted");
    // No node answers here, so it rolls back; the fence stays advanced.
    wait_for_step(&host, |s| matches!(s, Step::RolledBack { .. }));
    assert_eq!(
        host.fence_json(),
        serde_json::json!({"rollout-1": 5, "rollout-2": 9})
    );
    let reason = host.refused(&host.spec(4)).await;
    assert!(
        reason.contains("generation 4 of rollout rollout-1 is stale"),
        "{reason}"
    );
}

#[tokio::test]
async fn an_updater_without_a_service_manager_configured_refuses_naming_the_keys() {
    let host = Host::new();
    std::fs::write(
        &host.config,
        format!(
            "release_source = {:?}\n",
            host.dir.join("releases").display().to_string()
        ),
    )
    .expect("config");
    let reason = host.refused(&host.spec(1)).await;
    assert!(
        reason.contains("systemd_unit") && reason.contains("stop_command"),
        "{reason}"
    );
    host.assert_untouched();
}

#[tokio::test]
async fn an_upgrade_interrupted_after_its_swap_is_rolled_back_by_the_next_updater() {
    let host = Host::new();
    // The state a killed updater leaves: the release swapped in, the
    // previous binary kept, the journal at `swapped`, the claim free.
    let previous = billet_agent::upgrade::updater::previous_path(&host.install);
    std::fs::write(&previous, &host.installed_bytes).expect("previous");
    let release =
        std::fs::read(host.dir.join("releases").join(NEXT).join("billet")).expect("release binary");
    std::fs::write(&host.install, &release).expect("swapped in");
    host.journal(&host.interrupted_at(Step::Swapped));

    let reason = host.refused(&host.spec(2)).await;
    assert!(
        reason.contains("was interrupted") && reason.contains("send the instruction again"),
        "{reason}"
    );
    // After answering, it rolls the interrupted upgrade back: stop,
    // restore, start (and a health check, which fails here: no node runs).
    let journal = host.state.join(DIR).join(JOURNAL_FILE);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let record: Record = loop {
        let record: Record =
            serde_json::from_slice(&std::fs::read(&journal).expect("journal")).expect("record");
        if matches!(record.step, Step::RolledBack { .. }) {
            break record;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not settled: {record:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        std::fs::read(&host.install).expect("installed"),
        host.installed_bytes,
        "the previous release is back: {record:?}"
    );
    assert!(
        host.dir.join("stopped").exists(),
        "the node was stopped first"
    );
    assert!(
        host.dir.join("started").exists(),
        "and started again on the previous release"
    );
}

fn wait_for_step(host: &Host, done: impl Fn(&Step) -> bool) -> Record {
    let journal = host.state.join(DIR).join(JOURNAL_FILE);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(bytes) = std::fs::read(&journal)
            && let Ok(record) = serde_json::from_slice::<Record>(&bytes)
            && done(&record.step)
        {
            return record;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the journal never reached the step: {:?}",
            std::fs::read_to_string(&journal)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test]
async fn an_updater_stopped_by_sigterm_while_the_node_drains_starts_the_node_again() {
    let host = Host::new();
    // A drain that takes a while; the service log shows the order in
    // which the node was stopped and started.
    let log = host.dir.join("service.log");
    let running = host.dir.join("running");
    std::fs::write(&running, b"").expect("running");
    host.set_service(
        &format!(
            "echo stop-begin >> {log}; sleep 4; echo stop-end >> {log}; rm -f {running}",
            log = log.display(),
            running = running.display()
        ),
        &format!(
            "echo start >> {log}; touch {running}",
            log = log.display(),
            running = running.display()
        ),
    );
    host.upgrade(&host.spec(1)).await.expect("accepted");
    let record = wait_for_step(&host, |s| *s == Step::Accepted);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("stop-begin")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the drain never began"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let term = std::process::Command::new("kill")
        .args(["-TERM", &record.updater_pid.to_string()])
        .status()
        .expect("kill");
    assert!(term.success());
    let record = wait_for_step(&host, |s| *s == Step::Abandoned);
    // The settle waited for the drain it interrupted to end, then started
    // the node: it is not left stopped by a stop that finished last.
    assert_eq!(
        std::fs::read_to_string(&log).expect("service log"),
        "stop-begin\nstop-end\nstart\n",
        "{record:?}"
    );
    assert!(running.exists(), "the node runs: {record:?}");
    host.assert_binary_untouched();
}

#[tokio::test]
async fn settle_starts_a_node_an_updater_left_stopped_and_does_nothing_twice() {
    let host = Host::new();
    host.journal(&host.interrupted_at(Step::Stopped));
    let settle = || {
        std::process::Command::new(BILLET)
            .args(["host-upgrade", "--settle", "--config"])
            .arg(&host.config)
            .status()
            .expect("run --settle")
    };
    assert!(settle().success());
    let record = wait_for_step(&host, |s| *s == Step::Abandoned);
    assert!(host.dir.join("started").exists(), "{record:?}");
    std::fs::remove_file(host.dir.join("started")).expect("rm");
    assert!(settle().success());
    assert!(
        !host.dir.join("started").exists(),
        "a settled upgrade is left alone"
    );
    host.assert_binary_untouched();
}

#[tokio::test]
async fn a_rollback_that_cannot_restore_starts_the_node_anyway_and_says_so() {
    let host = Host::new();
    // The new release never proves healthy (no node answers here), and by
    // the time it is rolled back the previous binary is gone.
    let previous = billet_agent::upgrade::updater::previous_path(&host.install);
    let config = std::fs::read_to_string(&host.config).expect("config");
    std::fs::write(
        &host.config,
        config.replace(
            "start_command = [\"/bin/sh\", \"-c\", \"touch",
            &format!(
                "start_command = [\"/bin/sh\", \"-c\", \"rm -f {}; touch",
                previous.display()
            ),
        ),
    )
    .expect("config");
    host.upgrade(&host.spec(1)).await.expect("accepted");
    let record = wait_for_step(&host, |s| {
        matches!(s, Step::Unrecovered { .. } | Step::RolledBack { .. })
    });
    let Step::Unrecovered { reason } = &record.step else {
        panic!("a rollback without a previous binary claimed success: {record:?}");
    };
    assert!(
        reason.contains("could not be put back") && reason.contains("was started again"),
        "{reason}"
    );
    assert_eq!(
        billet_agent::upgrade::updater::binary_version(&host.install).expect("version"),
        NEXT,
        "the new release stays installed: there is nothing else to run"
    );
}

/// A stand-in for a node that is draining: it answers on the local socket,
/// serving, with `draining` set, and counts how often it was asked.
#[derive(Clone)]
struct DrainingNode {
    asked: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

#[tonic::async_trait]
impl billet_proto::v1::local_server::Local for DrainingNode {
    async fn status(
        &self,
        _: tonic::Request<billet_proto::v1::StatusRequest>,
    ) -> Result<tonic::Response<billet_proto::v1::LocalStatus>, tonic::Status> {
        self.asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(tonic::Response::new(billet_proto::v1::LocalStatus {
            version: env!("CARGO_PKG_VERSION").into(),
            pid: 1,
            incarnation: "draining".into(),
            recovered: true,
            draining: true,
            ..Default::default()
        }))
    }

    async fn enroll(
        &self,
        _: tonic::Request<billet_proto::v1::EnrollRequest>,
    ) -> Result<tonic::Response<billet_proto::v1::EnrollResult>, tonic::Status> {
        Err(tonic::Status::unimplemented(
            "a draining node enrols nothing",
        ))
    }
}

#[tokio::test]
async fn a_settle_waits_for_a_draining_node_to_exit_before_starting_it() {
    let host = Host::new();
    // The updater died while the node drained for it: the stop it began
    // goes on without it.
    host.journal(&host.interrupted_at(Step::Accepted));
    let socket = billet_agent::local::socket_path(&host.state);
    let listener = tokio::net::UnixListener::bind(&socket).expect("bind");
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_service_status("billet.node.v1.Node", tonic_health::ServingStatus::Serving)
        .await;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let draining = DrainingNode {
        asked: Default::default(),
    };
    let node = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health_service)
            .add_service(billet_proto::v1::local_server::LocalServer::new(
                draining.clone(),
            ))
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::UnixListenerStream::new(listener),
                async {
                    let _ = stopped.await;
                },
            ),
    );

    let config = billet_agent::upgrade::updater::UpgradeConfig::load(&host.config).expect("config");
    let settle =
        tokio::spawn(
            async move { billet_agent::upgrade::updater::settle_interrupted(&config).await },
        );
    // The settle has asked twice and found the node draining both times:
    // it has decided at least once to go on waiting.
    tokio::time::timeout(Duration::from_secs(30), async {
        while draining.asked.load(std::sync::atomic::Ordering::SeqCst) < 2 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the settle asked the draining node twice within 30 s");
    assert!(
        !host.dir.join("started").exists(),
        "a node still draining was started over"
    );
    assert!(!settle.is_finished(), "the settle waits for the drain");

    // The drain ends: the node exits and its socket goes.
    let _ = stop.send(());
    node.await.expect("join").expect("serve");
    std::fs::remove_file(&socket).expect("rm socket");
    tokio::time::timeout(Duration::from_secs(30), settle)
        .await
        .expect("settled within 30 s")
        .expect("join")
        .expect("settle");
    assert!(
        host.dir.join("started").exists(),
        "started once it had stopped"
    );
    let record = wait_for_step(&host, |s| *s == Step::Abandoned);
    assert_eq!(record.version, NEXT);
    host.assert_binary_untouched();
}

#[tokio::test]
async fn settle_by_hand_exits_9_when_the_host_is_left_for_an_operator() {
    let settle = |host: &Host| {
        std::process::Command::new(BILLET)
            .args(["host-upgrade", "--settle", "--config"])
            .arg(&host.config)
            .output()
            .expect("run --settle")
    };
    // Swapped, and the previous binary is gone: nothing to roll back to.
    let host = Host::new();
    let release =
        std::fs::read(host.dir.join("releases").join(NEXT).join("billet")).expect("release binary");
    std::fs::write(&host.install, &release).expect("swapped in");
    host.journal(&host.interrupted_at(Step::Swapped));
    let out = settle(&host);
    assert_eq!(
        out.status.code(),
        Some(9),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let record = wait_for_step(&host, |s| matches!(s, Step::Unrecovered { .. }));
    assert!(host.dir.join("started").exists(), "{record:?}");
    // Asked again, it still says an operator must look.
    let out = settle(&host);
    assert_eq!(
        out.status.code(),
        Some(9),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("unrecovered"));

    // A binary that is neither release: not guessed at.
    let host = Host::new();
    std::fs::write(&host.install, "#!/bin/sh\necho 'billet 3.3.3'\n").expect("other");
    host.journal(&host.interrupted_at(Step::Swapped));
    let out = settle(&host);
    assert_eq!(
        out.status.code(),
        Some(9),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("neither"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A configuration it cannot use.
    let host = Host::new();
    std::fs::write(&host.config, "release_source = \"relative\"\n").expect("config");
    let out = settle(&host);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
