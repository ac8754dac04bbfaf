//! The real `billet host-upgrade`, exec'd the way `billet node` execs it on
//! `StartUpgrade`: its answer travels back on file descriptor 3. And the
//! `systemd-run` dispatch as a node under systemd runs it, with a real
//! environment.

use std::io::Read;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use billet_agent::model::UpgradeSpec;
use billet_agent::upgrade::dispatch::{
    ACK_REFUSED, AckWriter, Dispatch, ExecUpgrader, NO_RELEASE_SOURCE, Refusal, SYSTEMD_RUN,
    UPDATER_ENVIRONMENT, UpgradeError, Upgrader,
};
use command_fds::{CommandFdExt, FdMapping};

const BILLET: &str = env!("CARGO_BIN_EXE_billet");

fn spec() -> UpgradeSpec {
    UpgradeSpec {
        version: "1.2.3".into(),
        manifest_sha256: Some("ab".repeat(32)),
        rollout_id: Some("rollout-7".into()),
        generation: 4,
    }
}

#[tokio::test]
async fn the_real_updater_refuses_through_fd_3_because_it_has_no_release_source() {
    // No `--config`: the updater has nowhere to take a release from.
    let mut upgrader = ExecUpgrader::new(BILLET);
    upgrader.ack_wait = Duration::from_secs(30);
    let started = std::time::Instant::now();
    let e = upgrader
        .start_upgrade(&spec())
        .await
        .expect_err("no release source, so refused");
    assert!(started.elapsed() < Duration::from_secs(30));
    let message = e.to_string();
    let UpgradeError::Refused { version, refusal } = e else {
        panic!("expected a refusal, got {e:?}");
    };
    assert_eq!(version, "1.2.3");
    assert_eq!(refusal, Refusal::Said(NO_RELEASE_SOURCE.into()));
    assert_eq!(
        message,
        format!("the updater refused to install 1.2.3: {NO_RELEASE_SOURCE}")
    );
}

#[tokio::test]
async fn the_real_updater_refuses_a_fence_passed_empty() {
    // The node never does this (it omits empty fences); the updater still
    // says so rather than act on it.
    let dir = std::env::temp_dir().join(format!("billet-upgrade-it-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let wrapper = dir.join("billet-empty-rollout");
    std::fs::write(
        &wrapper,
        format!("#!/bin/sh\nexec '{BILLET}' \"$@\" --rollout ''\n"),
    )
    .expect("wrapper");
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    // A configuration it can load, so that it gets as far as reading the
    // instruction (which it checks before touching anything).
    let config = dir.join("upgrade.toml");
    std::fs::write(
        &config,
        "release_source = \"/nonexistent/releases\"\nsystemd_unit = \"billet-node.service\"\n",
    )
    .expect("config");
    let mut upgrader = ExecUpgrader::new(&wrapper);
    upgrader.config = Some(config);
    let mut s = spec();
    s.rollout_id = None;
    let mut tries = 0;
    let e = loop {
        match upgrader.start_upgrade(&s).await {
            // A script just written can be briefly busy while another test
            // thread forks; it clears at that child's exec.
            Err(UpgradeError::Spawn { source, .. })
                if source.raw_os_error() == Some(26) && tries < 50 =>
            {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => break other.expect_err("refused"),
        }
    };
    let _ = std::fs::remove_dir_all(&dir);
    let UpgradeError::Refused {
        refusal: Refusal::Said(reason),
        ..
    } = e
    else {
        panic!("expected a refusal with a reason, got {e:?}");
    };
    assert!(reason.contains("--rollout was passed empty"), "{reason}");
}

#[test]
fn run_by_hand_without_an_ack_fd_the_updater_writes_nothing_on_fd_3() {
    let (mut reader, writer) = std::io::pipe().expect("pipe");
    let mut command = Command::new(BILLET);
    command
        .args(["host-upgrade", "--version", "1.2.3"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .fd_mappings(vec![FdMapping {
            parent_fd: OwnedFd::from(writer),
            child_fd: 3,
        }])
        .expect("fd mapping");
    let output = command.output().expect("run billet host-upgrade");
    drop(command);
    assert_eq!(
        output.status.code(),
        Some(8),
        "host-upgrade exits 8 when it refuses; stderr: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.stdout.is_empty());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains(NO_RELEASE_SOURCE), "{stderr}");
    let mut written = Vec::new();
    reader.read_to_end(&mut written).expect("read fd 3");
    assert!(
        written.is_empty(),
        "wrote {:?} on fd 3 without --ack-fd",
        String::from_utf8_lossy(&written)
    );
}

#[test]
fn with_an_ack_fd_the_updater_answers_one_line_and_closes_it() {
    let (mut reader, writer) = std::io::pipe().expect("pipe");
    let mut command = Command::new(BILLET);
    command
        .args(["host-upgrade", "--version", "1.2.3", "--ack-fd", "3"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .fd_mappings(vec![FdMapping {
            parent_fd: OwnedFd::from(writer),
            child_fd: 3,
        }])
        .expect("fd mapping");
    let status = command.status().expect("run billet host-upgrade");
    drop(command);
    assert_eq!(status.code(), Some(8));
    let mut written = String::new();
    reader.read_to_string(&mut written).expect("read fd 3");
    assert_eq!(written, format!("{ACK_REFUSED}{NO_RELEASE_SOURCE}\n"));
}

/// Set in the child that the systemd environment test runs itself as:
/// where that child leaves its proof that it ran the test and it passed.
const CHILD_MARKER: &str = "BILLET_UPGRADE_TEST_CHILD_MARKER";
const SYSTEMD_ENV_TEST: &str =
    "under_systemd_the_updater_gets_the_nodes_environment_by_name_never_on_a_command_line";
const LOG_VALUE: &str = "info,billet_agent=debug";
const PROXY_VALUE: &str = "http://updater:s3cret-proxy-password@proxy.internal:3128";
const KEPT_BACK: &str = "BILLET_NOT_FOR_THE_UPDATER";
const KEPT_BACK_VALUE: &str = "kept-back-value";

/// A stand-in `systemd-run` (as in the unit tests): records its arguments,
/// starts the command after `--` without waiting for it, and gives it only
/// `PATH` and the variables named by `--setenv=NAME`, with the values from
/// its own environment. A `--setenv` carrying a value is refused.
const FAKE_SYSTEMD_RUN: &str = include_str!("fixtures/fake-systemd-run.sh");

/// An updater that records its arguments and what it found in its
/// environment; the test answers for it on its socket.
const RECORDING_UPDATER: &str = r#"for a in "$@"; do printf '%s\n' "$a"; done > updater.args
printf 'BILLET_LOG=%s\nHTTPS_PROXY=%s\nBILLET_NOT_FOR_THE_UPDATER=%s\n' \
    "$BILLET_LOG" "$HTTPS_PROXY" "$BILLET_NOT_FOR_THE_UPDATER" > updater.env.part
mv updater.env.part updater.env"#;

fn write_script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(
        &path,
        format!("#!/bin/sh\ncd '{}' || exit 1\n{body}\n", dir.display()),
    )
    .expect("write script");
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod script");
    path
}

/// A directory removed when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn temp_dir(name: &str) -> TempDir {
    // Short: the answer socket's whole path must fit in 107 bytes.
    let random = uuid::Uuid::new_v4().simple().to_string();
    let dir = std::env::temp_dir().join(format!("billet-up-{name}-{}", &random[..12]));
    std::fs::create_dir_all(&dir).expect("temp dir");
    TempDir(dir)
}

#[test]
fn under_systemd_the_updater_gets_the_nodes_environment_by_name_never_on_a_command_line() {
    // 7.R.23 and the choice of dispatch, with a real environment. The values
    // must be in this very process's environment, which a test cannot set
    // (no `unsafe`), so the test runs itself again as a child whose
    // environment carries them, as systemd would give them to a node.
    if let Some(marker) = std::env::var_os(CHILD_MARKER) {
        as_a_node_under_systemd(Path::new(&marker));
        return;
    }
    let dir = temp_dir("parent");
    let marker = dir.0.join("passed");
    let mut child = Command::new(std::env::current_exe().expect("this test's binary"));
    child.args([
        SYSTEMD_ENV_TEST,
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ]);
    for name in UPDATER_ENVIRONMENT {
        child.env_remove(name);
    }
    let output = child
        .env(CHILD_MARKER, &marker)
        .env("INVOCATION_ID", "5f2b1c0d9e8a4b7c93d1e6a0f4c2b8d7")
        .env("BILLET_LOG", LOG_VALUE)
        .env("HTTPS_PROXY", PROXY_VALUE)
        .env(KEPT_BACK, KEPT_BACK_VALUE)
        .stdin(Stdio::null())
        .output()
        .expect("run this test again as a child");
    let report = format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "the child failed: {report}");
    assert!(
        marker.exists(),
        "the child did not run the test, so it proves nothing: {report}"
    );
}

/// The child's half: a node with `INVOCATION_ID`, `BILLET_LOG`,
/// `HTTPS_PROXY` and one variable off the allow-list in its environment.
fn as_a_node_under_systemd(marker: &Path) {
    let dir = temp_dir("node");
    // This child runs this one test on one thread, so nothing forks while a
    // script is open for writing: no ETXTBSY to retry.
    let updater = write_script(&dir.0, "updater", RECORDING_UPDATER);
    let fake = write_script(&dir.0, "systemd-run", FAKE_SYSTEMD_RUN);
    let state = dir.0.join("state");
    std::fs::create_dir_all(&state).expect("state dir");

    let mut upgrader = ExecUpgrader::new(&updater);
    upgrader.dispatch = Dispatch::from_environment(&state);
    let Dispatch::SystemdRun {
        systemd_run,
        state_dir,
    } = &mut upgrader.dispatch
    else {
        panic!(
            "INVOCATION_ID is set, yet the dispatch is {:?}",
            upgrader.dispatch
        );
    };
    assert_eq!(systemd_run, Path::new(SYSTEMD_RUN));
    assert_eq!(state_dir, &state);
    *systemd_run = fake;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let task = tokio::spawn({
            let upgrader = upgrader.clone();
            async move { upgrader.start_upgrade(&spec()).await }
        });
        let env_file = dir.0.join("updater.env");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !env_file.exists() {
            if task.is_finished() {
                panic!("the upgrade ended before the updater ran: {:?}", task.await);
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the updater did not run within 10s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let args = std::fs::read_to_string(dir.0.join("updater.args")).expect("updater args");
        let args: Vec<&str> = args.lines().collect();
        let at = args
            .iter()
            .position(|a| *a == "--ack-path")
            .expect("--ack-path");
        AckWriter::connect(Path::new(args[at + 1]))
            .expect("connect")
            .accept();
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("answered")
            .expect("task")
            .expect("accepted");
    });

    let run_args = std::fs::read_to_string(dir.0.join("systemd-run.args")).expect("args");
    let updater_args = std::fs::read_to_string(dir.0.join("updater.args")).expect("args");
    for value in [LOG_VALUE, PROXY_VALUE, KEPT_BACK_VALUE] {
        assert!(!run_args.contains(value), "{value:?} in {run_args}");
        assert!(!updater_args.contains(value), "{value:?} in {updater_args}");
    }
    let setenv: Vec<&str> = run_args
        .lines()
        .filter_map(|a| a.strip_prefix("--setenv="))
        .collect();
    assert_eq!(setenv, ["BILLET_LOG", "HTTPS_PROXY"], "{run_args}");
    let env = std::fs::read_to_string(dir.0.join("updater.env")).expect("env");
    assert_eq!(
        env.lines().collect::<Vec<_>>(),
        [
            format!("BILLET_LOG={LOG_VALUE}"),
            format!("HTTPS_PROXY={PROXY_VALUE}"),
            format!("{KEPT_BACK}="),
        ],
        "what the updater found in its environment"
    );
    std::fs::write(marker, "passed").expect("marker");
}

#[tokio::test]
async fn under_systemd_the_real_updater_refuses_over_its_socket() {
    // `billet host-upgrade --ack-path` through a stand-in `systemd-run`: with
    // no updater configuration it refuses, and the refusal comes back over
    // the node's socket, which is gone afterwards.
    let dir = temp_dir("real");
    let systemd_run = write_script(&dir.0, "systemd-run", FAKE_SYSTEMD_RUN);
    let state_dir = dir.0.join("state");
    std::fs::create_dir_all(&state_dir).expect("state dir");
    let mut upgrader = ExecUpgrader::new(BILLET);
    upgrader.ack_wait = Duration::from_secs(30);
    upgrader.dispatch = Dispatch::SystemdRun {
        systemd_run,
        state_dir: state_dir.clone(),
    };
    let started = std::time::Instant::now();
    let mut tries = 0;
    let e = loop {
        match upgrader.start_upgrade(&spec()).await {
            // A script just written can be briefly busy while another test
            // thread forks; it clears at that child's exec.
            Err(UpgradeError::Spawn { source, .. })
                if source.kind() == std::io::ErrorKind::ExecutableFileBusy && tries < 50 =>
            {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => break other.expect_err("no release source, so refused"),
        }
    };
    assert!(started.elapsed() < Duration::from_secs(30));
    let UpgradeError::Refused { refusal, .. } = e else {
        panic!("expected a refusal, got {e:?}");
    };
    assert_eq!(refusal, Refusal::Said(NO_RELEASE_SOURCE.into()));
    let left: Vec<_> = std::fs::read_dir(&state_dir)
        .expect("state dir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert!(left.is_empty(), "left in the state directory: {left:?}");
}
