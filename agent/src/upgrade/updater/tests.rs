use super::*;

fn record(step: Step, rollout: &str, generation: u64) -> Record {
    Record {
        version: "2.0.0".into(),
        from: "1.0.0".into(),
        rollout: Some(rollout.into()),
        generation: Some(generation),
        install_path: "/b".into(),
        previous_path: "/b.previous".into(),
        staged_path: "/.b.staged".into(),
        updater_pid: 1,
        step,
        at: 0,
    }
}

fn request(rollout: &str, generation: u64) -> Request {
    Request {
        version: "2.0.1".into(),
        manifest_sha256: None,
        rollout: Some(rollout.into()),
        generation: Some(generation),
    }
}

#[test]
fn the_fence_refuses_a_rollouts_older_generation_whatever_came_since() {
    let mut seen = Fence::new();
    seen.insert("r1".into(), 5);
    seen.insert("r2".into(), 1);
    let e = fence(&seen, &request("r1", 3)).expect_err("stale, though r2 came since");
    assert!(e.contains("generation 3 of rollout r1 is stale"), "{e}");
    fence(&seen, &request("r1", 5)).expect("the same generation again (a retry)");
    fence(&seen, &request("r1", 6)).expect("newer");
    fence(&seen, &request("r3", 1)).expect("another rollout");
    fence(&Fence::new(), &request("r1", 1)).expect("first ever");
    let unfenced = Request {
        rollout: None,
        generation: None,
        ..request("r1", 1)
    };
    fence(&seen, &unfenced).expect("by hand, unfenced");
}

#[test]
fn a_malformed_configuration_says_where_without_quoting_the_line() {
    let dir = std::env::temp_dir().join(format!("billet-cfg-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("upgrade.toml");
    std::fs::write(
        &path,
        "install_path = \"/usr/local/bin/billet\"\nrelease_source = \"https://u:s3cret@host/r\n",
    )
    .expect("write");
    let e = UpgradeConfig::load(&path).expect_err("malformed");
    assert!(!e.contains("s3cret"), "{e}");
    assert!(
        e.contains("at line 2") && e.contains(&path.display().to_string()),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn half_a_fence_is_refused() {
    for (rollout, generation) in [(Some("r1".to_owned()), None), (None, Some(3))] {
        let half = Request {
            rollout,
            generation,
            ..request("r1", 1)
        };
        let e = check_request(&half).expect_err("half a fence");
        assert!(e.contains("pass both, or neither"), "{e}");
    }
    check_request(&request("r1", 1)).expect("both");
}

#[test]
fn a_config_must_say_how_the_node_is_stopped_and_started() {
    let base = "release_source = \"/srv/releases\"\n";
    let parse = |extra: &str| -> Result<UpgradeConfig, String> {
        let c: UpgradeConfig =
            toml::from_str(&format!("{base}{extra}")).map_err(|e| e.to_string())?;
        c.check().map(|()| c)
    };
    assert!(parse("").is_err());
    assert!(parse("stop_command = [\"x\"]\n").is_err());
    assert!(
        parse("systemd_unit = \"u\"\nstop_command = [\"x\"]\nstart_command = [\"y\"]\n").is_err()
    );
    let c = parse("systemd_unit = \"billet-node.service\"\n").expect("unit");
    assert_eq!(
        c.service(),
        Ok(Service::Systemd("billet-node.service".into()))
    );
    assert_eq!(c.install_path, PathBuf::from("/usr/local/bin/billet"));
    assert!(parse("systemd_unit = \"u\"\nstate_dir = \"relative\"\n").is_err());
    assert!(parse("systemd_unit = \"u\"\nsurprise = 1\n").is_err());
}

#[test]
fn the_deployed_example_configuration_loads() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/upgrade.toml.example");
    let c = UpgradeConfig::load(&path).expect("the example loads");
    assert_eq!(
        c.service(),
        Ok(Service::Systemd("billet-node.service".into()))
    );
    assert_eq!(c.state_dir, PathBuf::from("/var/lib/billet"));
}

#[test]
fn swap_and_restore_keep_one_whole_binary_at_the_install_path() {
    let dir = std::env::temp_dir().join(format!("billet-swap-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("dir");
    let install = dir.join("billet");
    let previous = previous_path(&install);
    let staged = dir.join(".billet-2.staged");
    std::fs::write(&install, b"old").expect("old");
    std::fs::write(&previous, b"older").expect("older");
    std::fs::write(&staged, b"new").expect("new");
    swap(&install, &previous, &staged).expect("swap");
    assert_eq!(std::fs::read(&install).expect("install"), b"new");
    assert_eq!(std::fs::read(&previous).expect("previous"), b"old");
    assert!(!staged.exists());
    restore(&install, &previous).expect("restore");
    restore(&install, &previous).expect("restore again");
    assert_eq!(std::fs::read(&install).expect("install"), b"old");
    assert_eq!(std::fs::read(&previous).expect("previous"), b"old");
}

/// A host with `install` reporting `installed` and `previous`
/// reporting 1.0.0, and a journal for 1.0.0 -> 2.0.0 at `step`.
fn host(step: Step, installed: &str) -> (PathBuf, Files, PathBuf) {
    let dir = std::env::temp_dir().join(format!("billet-settle-{}", uuid::Uuid::new_v4().simple()));
    let files = Files::new(&dir);
    files.create().expect("dir");
    let install = dir.join("billet");
    let fake = |path: &Path, version: &str| {
        std::fs::write(path, format!("#!/bin/sh\necho 'billet {version}'\n")).expect("fake");
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .expect("chmod");
    };
    fake(&install, installed);
    fake(&previous_path(&install), "1.0.0");
    let mut r = record(Step::Accepted, "r", 1);
    r.install_path = install.clone();
    r.previous_path = previous_path(&install);
    files.write(&mut r, step).expect("journal");
    (dir, files, install)
}

fn version_of(path: &Path) -> String {
    binary_version(path).expect("version")
}

#[test]
fn a_node_start_rolls_back_a_swap_its_dead_updater_never_proved() {
    let (dir, files, install) = host(Step::Swapped, "2.0.0");
    // While an updater holds the claim, the node leaves it alone.
    let held = files.claim(Duration::ZERO).expect("claim").expect("free");
    assert_eq!(settle_at_node_start(&dir), Ok(Settled::Nothing));
    assert_eq!(version_of(&install), "2.0.0");
    // The updater dies. A sibling test's thread that forked meanwhile
    // holds the dropped descriptor until its child execs (and the start
    // below would find the claim busy), so the death is complete once the
    // claim can be taken.
    drop(held);
    drop(
        files
            .claim(crate::claim::PATIENCE)
            .expect("claim")
            .expect("the updater's claim is let go"),
    );

    assert_eq!(
        settle_at_node_start(&dir),
        Ok(Settled::RolledBack(install.clone()))
    );
    assert_eq!(version_of(&install), "1.0.0");
    assert!(matches!(
        files.read().expect("read").expect("record").step,
        Step::RolledBack { .. }
    ));
    // Settled once: the next start finds nothing to do.
    assert_eq!(settle_at_node_start(&dir), Ok(Settled::Nothing));
}

#[test]
fn a_node_start_does_not_wait_for_a_busy_claim() {
    // Whoever holds the claim (here a child given the same open lock
    // file, as a forked child of the updater would hold it), the node's
    // start decides at once: an updater dying while the node waited
    // would have its swap undone under the node it started, which
    // `host-upgrade --settle` judges instead.
    let (dir, files, install) = host(Step::Swapped, "2.0.0");
    let held = files.claim(Duration::ZERO).expect("claim").expect("free");
    let mut child = std::process::Command::new("sleep")
        .arg("0.5")
        .stdin(held.try_clone().expect("dup"))
        .spawn()
        .expect("sleep");
    drop(held);
    let started = std::time::Instant::now();
    assert_eq!(settle_at_node_start(&dir), Ok(Settled::Nothing));
    assert!(started.elapsed() < crate::claim::PATIENCE, "it waited");
    assert_eq!(version_of(&install), "2.0.0");
    assert!(child.wait().expect("child").success());
}

#[test]
fn the_installed_binary_not_the_journal_decides_what_a_settle_undoes() {
    // Killed between the rename and journalling it: the journal says
    // `swapping`, the disk holds the new release. Rolled back.
    let (dir, _, install) = host(Step::Swapping, "2.0.0");
    assert_eq!(
        settle_at_node_start(&dir),
        Ok(Settled::RolledBack(install.clone()))
    );
    assert_eq!(version_of(&install), "1.0.0");
    // A rollback whose journal write was lost: the journal says
    // `started`, the disk already holds the old release. Only recorded.
    let (dir, files, install) = host(Step::Started, "1.0.0");
    assert_eq!(settle_at_node_start(&dir), Ok(Settled::Recorded));
    assert_eq!(version_of(&install), "1.0.0");
    assert!(matches!(
        files.read().expect("read").expect("record").step,
        Step::RolledBack { .. }
    ));
    // A binary that is neither release is not guessed at.
    let (dir, files, _) = host(Step::Swapped, "3.0.0");
    let e = settle_at_node_start(&dir).expect_err("neither release");
    assert!(e.contains("neither 2.0.0 nor 1.0.0"), "{e}");
    assert_eq!(
        files.read().expect("read").expect("record").step,
        Step::Swapped
    );
}

#[test]
fn a_second_node_start_leaves_a_swap_alone_while_a_node_serves_the_state_directory() {
    let (dir, files, install) = host(Step::Started, "2.0.0");
    let listener =
        std::os::unix::net::UnixListener::bind(crate::local::socket_path(&dir)).expect("bind");
    assert_eq!(settle_at_node_start(&dir), Ok(Settled::Nothing));
    assert_eq!(
        version_of(&install),
        "2.0.0",
        "not undone under a running node"
    );
    assert_eq!(
        files.read().expect("read").expect("record").step,
        Step::Started
    );
    // Once that node is gone, a start settles as before.
    drop(listener);
    assert_eq!(
        settle_at_node_start(&dir),
        Ok(Settled::RolledBack(install.clone()))
    );
    assert_eq!(version_of(&install), "1.0.0");
}

#[test]
fn a_node_start_marks_an_upgrade_that_died_before_the_swap_abandoned() {
    let (dir, files, install) = host(Step::Stopped, "1.0.0");
    assert_eq!(settle_at_node_start(&dir), Ok(Settled::Recorded));
    assert_eq!(version_of(&install), "1.0.0");
    assert_eq!(
        files.read().expect("read").expect("record").step,
        Step::Abandoned
    );
}
