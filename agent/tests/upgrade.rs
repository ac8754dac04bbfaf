//! The real `billet host-upgrade`, exec'd the way `billet node` execs it on
//! `StartUpgrade`: its answer travels back on file descriptor 3.

use std::io::Read;
use std::os::fd::OwnedFd;
use std::process::{Command, Stdio};
use std::time::Duration;

use billet_agent::upgrade::{
    ACK_REFUSED, ExecUpgrader, NO_RELEASE_SOURCE, Refusal, UpgradeError, Upgrader,
};
use billet_agent::wire::UpgradeSpec;
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
    let mut upgrader = ExecUpgrader::new(BILLET);
    upgrader.config = Some("/etc/billet/upgrade.toml".into());
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
    let upgrader = ExecUpgrader::new(&wrapper);
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
