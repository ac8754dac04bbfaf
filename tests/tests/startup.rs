//! Start-up refuses bad configuration with a message naming what to fix and
//! the documented exit code (README "Exit codes").

use std::path::{Path, PathBuf};
use std::process::Output;

use anyhow::{Context, Result};
use billet_tests::cluster::{free_port, scratch_dir};
use billet_tests::image::{binary_path, build_process_binaries};

fn node(
    args: &[&str],
    certs: &billet_certs_dev::DevCerts,
    state: &Path,
    socket: &str,
) -> Result<Output> {
    build_process_binaries()?;
    let files = certs.node("node-1").expect("node files");
    let listen = free_port()?.to_string();
    let mut flags: Vec<(String, String)> = vec![
        ("--listen".into(), listen),
        ("--cert".into(), files.cert.display().to_string()),
        ("--key".into(), files.key.display().to_string()),
        ("--ca".into(), certs.ca.cert.display().to_string()),
        ("--state-dir".into(), state.display().to_string()),
        ("--docker-socket".into(), socket.into()),
    ];
    // `args` are flag/value pairs that replace or add to the defaults above.
    for pair in args.chunks(2) {
        let (flag, value) = (pair[0].to_owned(), pair[1].to_owned());
        match flags.iter_mut().find(|(f, _)| *f == flag) {
            Some(slot) => slot.1 = value,
            None => flags.push((flag, value)),
        }
    }
    let mut all = vec!["node".to_owned()];
    for (flag, value) in flags {
        all.push(flag);
        all.push(value);
    }
    // A valid configuration would serve forever; every case here must exit.
    let child = std::process::Command::new(binary_path("billet")?)
        .args(&all)
        .env("BILLET_LOG", "info")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let pid = child.id();
    let watchdog = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_secs(20));
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    });
    let out = child.wait_with_output()?;
    drop(watchdog);
    Ok(out)
}

fn setup() -> Result<(billet_certs_dev::DevCerts, std::path::PathBuf)> {
    let dir = scratch_dir("startup")?;
    let certs = billet_certs_dev::generate(&dir.join("certs"), "plane", &["node-1"])?;
    Ok((certs, dir.join("state")))
}

fn assert_exit(out: &Output, code: i32, mentions: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "stderr:\n{stderr}");
    assert!(
        stderr.contains(mentions),
        "stderr should mention {mentions:?}:\n{stderr}"
    );
}

#[test]
fn an_unreadable_certificate_exits_3_naming_the_file() -> Result<()> {
    let (certs, state) = setup()?;
    let out = node(
        &["--cert", "/nonexistent/node.pem"],
        &certs,
        &state,
        "/var/run/docker.sock",
    )?;
    assert_exit(&out, 3, "/nonexistent/node.pem");
    Ok(())
}

/// Starts a node on a certificate for node-1 with `validity`, signed by
/// `ca_dir`'s CA (a fresh CA when `None`), against the engine at `docker`;
/// answers what it printed and the certificate's path.
fn node_with_dates(
    certs: &billet_certs_dev::DevCerts,
    state: &Path,
    validity: billet_certs_dev::Validity,
    ca_dir: Option<PathBuf>,
    docker: &str,
) -> Result<(Output, String)> {
    let made = billet_certs_dev::generate_with(
        &scratch_dir("dates")?,
        "plane",
        &["node-1"],
        &billet_certs_dev::Options { validity, ca_dir },
    )?;
    let files = made.node("node-1").expect("files");
    let cert = files.cert.display().to_string();
    let key = files.key.display().to_string();
    let out = node(&["--cert", &cert, "--key", &key], certs, state, docker)?;
    Ok((out, cert))
}

/// A certificate of this deployment's CA that has expired does not stop
/// start-up: the node keeps what it holds and waits to be re-enrolled, with
/// a warning saying so. Here start-up goes on past the TLS material and
/// stops at the missing engine (exit 5).
#[test]
fn an_expired_node_certificate_of_the_ca_starts_with_a_warning() -> Result<()> {
    let (certs, state) = setup()?;
    let (out, _) = node_with_dates(
        &certs,
        &state,
        billet_certs_dev::Validity::expired(),
        Some(certs.dir.clone()),
        "/nonexistent/docker.sock",
    )?;
    assert_exit(&out, 5, "/nonexistent/docker.sock");
    assert_exit(&out, 5, "the node's certificate has expired");
    Ok(())
}

/// A certificate the plane dated a moment ago, on a node whose clock is two
/// minutes behind, starts two minutes in the node's future: start-up serves
/// it (the plane judges it by its own clock and will accept it), with a
/// warning, and goes on to the missing engine (exit 5). Refusing to start
/// (exit 3) until its own clock caught up would keep a node behind the plane
/// from restarting soon after a renewal.
#[test]
fn a_certificate_starting_minutes_ahead_of_a_node_behind_the_plane_starts_with_a_warning()
-> Result<()> {
    let (certs, state) = setup()?;
    let now = std::time::SystemTime::now();
    let (out, _) = node_with_dates(
        &certs,
        &state,
        billet_certs_dev::Validity {
            not_before: now + std::time::Duration::from_secs(120),
            not_after: now + std::time::Duration::from_secs(86_400),
        },
        Some(certs.dir.clone()),
        "/nonexistent/docker.sock",
    )?;
    assert_exit(&out, 5, "/nonexistent/docker.sock");
    assert_exit(&out, 5, "not valid yet by this node's clock");
    Ok(())
}

/// Start-up tolerates expiry, and a start within the clock skew a healthy
/// node may have: an expired certificate of another CA, and one valid only
/// from tomorrow, still exit 3 naming the file.
#[test]
fn an_expired_certificate_of_another_ca_and_one_not_yet_valid_exit_3() -> Result<()> {
    let (certs, state) = setup()?;
    for (validity, ca_dir) in [
        (billet_certs_dev::Validity::expired(), None),
        (
            billet_certs_dev::Validity::not_yet_valid(),
            Some(certs.dir.clone()),
        ),
    ] {
        let (out, cert) =
            node_with_dates(&certs, &state, validity, ca_dir, "/var/run/docker.sock")?;
        assert_exit(&out, 3, &cert);
    }
    Ok(())
}

#[test]
fn a_key_that_does_not_match_the_certificate_exits_3() -> Result<()> {
    let (certs, state) = setup()?;
    let other = billet_certs_dev::generate(&scratch_dir("other")?, "plane", &["node-1"])?;
    let key = other
        .node("node-1")
        .expect("files")
        .key
        .display()
        .to_string();
    let out = node(&["--key", &key], &certs, &state, "/var/run/docker.sock")?;
    assert_exit(&out, 3, &key);
    Ok(())
}

#[test]
fn an_unreachable_docker_engine_exits_5_naming_the_socket() -> Result<()> {
    let (certs, state) = setup()?;
    let out = node(&[], &certs, &state, "/nonexistent/docker.sock")?;
    assert_exit(&out, 5, "/nonexistent/docker.sock");
    Ok(())
}

#[test]
fn a_corrupt_journal_exits_7_naming_the_file_and_is_not_recreated() -> Result<()> {
    let (certs, state) = setup()?;
    std::fs::create_dir_all(&state)?;
    let journal = state.join("journal.db");
    std::fs::write(&journal, b"not a journal ".repeat(300))?;
    let out = node(&[], &certs, &state, "/var/run/docker.sock")?;
    assert_exit(&out, 7, &journal.display().to_string());
    assert!(std::fs::read(&journal)?.starts_with(b"not a journal"));
    Ok(())
}

#[test]
fn a_state_directory_that_is_a_file_exits_6_saying_so() -> Result<()> {
    let (certs, state) = setup()?;
    std::fs::create_dir_all(state.parent().context("parent")?)?;
    std::fs::write(&state, b"not a directory")?;
    let out = node(&[], &certs, &state, "/var/run/docker.sock")?;
    assert_exit(&out, 6, "is not a directory");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&state.display().to_string()), "{stderr}");
    assert!(!stderr.contains("upgrade journal"), "{stderr}");
    Ok(())
}

#[test]
fn an_invalid_value_exits_2_naming_the_flag() -> Result<()> {
    let (certs, state) = setup()?;
    let out = node(&["--vcpu", "0"], &certs, &state, "/var/run/docker.sock")?;
    assert_exit(&out, 2, "--vcpu");
    Ok(())
}

/// A duration past its flag's bound is refused where it is parsed, by
/// `billet node` and `billet check`, whether it came from the command line,
/// the environment or the configuration file: exit 2, naming the flag and
/// the largest value allowed. Taken, such a value would reach a deadline the
/// node computes long after start-up (the drain's, at SIGTERM) and panic.
#[test]
fn a_duration_too_large_for_its_flag_exits_2_naming_the_flag_and_the_largest_value() -> Result<()> {
    const HUGE: &str = "18446744073709551615";
    const LARGEST: &str = "the largest value allowed is 315360000";
    let (certs, state) = setup()?;
    let socket = "/nonexistent/docker.sock";
    for flag in [
        "--drain-timeout-secs",
        "--post-job-grace-secs",
        "--max-lease-life-secs",
        "--ack-timeout-secs",
    ] {
        let out = node(&[flag, HUGE], &certs, &state, socket)?;
        assert_exit(&out, 2, flag);
        assert_exit(&out, 2, LARGEST);
    }

    let files = certs.node("node-1").expect("node files");
    let run = |sub: &str, env: Option<(&str, &str)>, config: Option<&Path>| -> Result<Output> {
        let mut command = std::process::Command::new(binary_path("billet")?);
        command.arg(sub);
        match config {
            Some(file) => {
                command.arg("--config").arg(file);
            }
            None => {
                command
                    .args(["--listen", &free_port()?.to_string()])
                    .arg("--cert")
                    .arg(&files.cert)
                    .arg("--key")
                    .arg(&files.key)
                    .arg("--ca")
                    .arg(&certs.ca.cert)
                    .arg("--state-dir")
                    .arg(&state)
                    .args(["--docker-socket", socket]);
            }
        }
        if let Some((name, value)) = env {
            command.env(name, value);
        }
        Ok(command.env("BILLET_LOG", "info").output()?)
    };
    let out = run("check", None, None)?;
    assert_exit(&out, 5, socket);
    let out = run("check", Some(("BILLET_DRAIN_TIMEOUT_SECS", HUGE)), None)?;
    assert_exit(&out, 2, "--drain-timeout-secs");
    assert_exit(&out, 2, LARGEST);
    let out = run("node", Some(("BILLET_DRAIN_TIMEOUT_SECS", HUGE)), None)?;
    assert_exit(&out, 2, "--drain-timeout-secs");
    assert_exit(&out, 2, LARGEST);

    let file = scratch_dir("duration-bound")?.join("node.toml");
    std::fs::write(
        &file,
        format!(
            "listen = \"{}\"\ncert = \"{}\"\nkey = \"{}\"\nca = \"{}\"\nstate_dir = \"{}\"\ndocker_socket = \"{socket}\"\ncert_expiry_warning_days = 9223372036854775807\n",
            free_port()?,
            files.cert.display(),
            files.key.display(),
            certs.ca.cert.display(),
            state.display()
        ),
    )?;
    for sub in ["node", "check"] {
        let out = run(sub, None, Some(&file))?;
        assert_exit(&out, 2, "`cert_expiry_warning_days`");
        assert_exit(&out, 2, "the largest value allowed is 3650");
    }
    Ok(())
}

#[test]
fn a_registry_mirror_that_is_not_an_http_url_exits_2_naming_the_flag() -> Result<()> {
    let (certs, state) = setup()?;
    let out = node(
        &["--registry-mirror", "mirror.example:5000"],
        &certs,
        &state,
        "/var/run/docker.sock",
    )?;
    assert_exit(&out, 2, "--registry-mirror");
    assert_exit(&out, 2, "give a registry mirror such as https://");
    Ok(())
}

#[test]
fn the_state_directory_is_made_private() -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let (certs, state) = setup()?;
    std::fs::create_dir_all(&state)?;
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755))?;
    // Fails later on the engine, after the state directory is prepared.
    let out = node(&[], &certs, &state, "/nonexistent/docker.sock")?;
    assert_eq!(out.status.code(), Some(5));
    assert_eq!(
        std::fs::metadata(&state)?.permissions().mode() & 0o777,
        0o700
    );
    Ok(())
}

/// A start that fails once the state directory is made (a taken port, an
/// unreachable engine) leaves nothing behind: not the directory it made,
/// nor, in one that was there, the socket, the journal or the cache
/// directory it made.
#[test]
fn a_start_that_fails_after_making_its_state_removes_what_it_made() -> Result<()> {
    let (certs, state) = setup()?;
    let held = std::net::TcpListener::bind("127.0.0.1:0")?;
    let taken = held.local_addr()?.to_string();
    // A state directory it made.
    let out = node(
        &["--listen", &taken],
        &certs,
        &state,
        "/var/run/docker.sock",
    )?;
    assert_exit(&out, 4, &format!("cannot listen on {taken}"));
    assert!(!state.exists(), "{} is left", state.display());
    let out = node(&[], &certs, &state, "/nonexistent/docker.sock")?;
    assert_exit(&out, 5, "/nonexistent/docker.sock");
    assert!(!state.exists(), "{} is left", state.display());
    // An unusable cache directory, found after the journal is made.
    let not_a_dir = state.parent().context("parent")?.join("cache-file");
    std::fs::write(&not_a_dir, b"not a directory")?;
    let shown = not_a_dir.display().to_string();
    let out = node(
        &["--cache-dir", &shown],
        &certs,
        &state,
        "/var/run/docker.sock",
    )?;
    assert_eq!(
        out.status.code(),
        Some(6),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!state.exists(), "{} is left", state.display());
    // One that was there, empty, and stays so.
    std::fs::create_dir_all(&state)?;
    let out = node(
        &["--metrics-listen", &taken],
        &certs,
        &state,
        "/var/run/docker.sock",
    )?;
    assert_exit(&out, 4, "--metrics-listen");
    let left: Vec<_> = std::fs::read_dir(&state)?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()?;
    for made in ["node.sock", "journal.db", "cache"] {
        assert!(
            !left.iter().any(|n| n == made),
            "{made} is left in {}: {left:?}",
            state.display()
        );
    }
    Ok(())
}

/// A node whose state directory is another user's says whose, its mode,
/// who the node runs as and what to change, not the bare "Operation not
/// permitted".
#[test]
fn a_state_directory_owned_by_another_user_exits_6_naming_its_owner_mode_and_what_to_change()
-> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let (uid, gid) = billet_tests::cluster::other_user()?;
    let (certs, state) = setup()?;
    // The node runs as the other user and may read its TLS material; the
    // state directory is root's, and open to all, so only its mode cannot
    // be set.
    let root = state.parent().context("parent")?;
    for entry in walk(root)? {
        std::os::unix::fs::chown(&entry, Some(uid), Some(gid))?;
    }
    std::fs::set_permissions(root, std::fs::Permissions::from_mode(0o755))?;
    std::fs::create_dir_all(&state)?;
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o777))?;
    build_process_binaries()?;
    let files = certs.node("node-1").expect("node files");
    let out = std::process::Command::new(binary_path("billet")?)
        .arg("node")
        .args(["--listen", &free_port()?.to_string()])
        .arg("--cert")
        .arg(&files.cert)
        .arg("--key")
        .arg(&files.key)
        .arg("--ca")
        .arg(&certs.ca.cert)
        .arg("--state-dir")
        .arg(&state)
        .env("BILLET_LOG", "info")
        .uid(uid)
        .gid(gid)
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_exit(&out, 6, "cannot chmod 0700");
    for said in [
        format!("{} is owned by root (uid 0)", state.display()),
        "mode 0777".to_owned(),
        "this process runs as billet-test-other".to_owned(),
        "chown it to the node's user".to_owned(),
    ] {
        assert!(stderr.contains(&said), "no {said:?} in:\n{stderr}");
    }
    Ok(())
}

/// Every path under `dir`, `dir` first.
fn walk(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut all = vec![dir.to_owned()];
    let mut i = 0;
    while i < all.len() {
        if all[i].is_dir() {
            for entry in std::fs::read_dir(&all[i])? {
                all.push(entry?.path());
            }
        }
        i += 1;
    }
    Ok(all)
}

#[test]
fn a_configuration_file_supplies_the_flags_and_its_errors_name_the_file_and_key() -> Result<()> {
    let (certs, state) = setup()?;
    let files = certs.node("node-1").expect("node files");
    let dir = scratch_dir("config-file")?;
    let good = dir.join("node.toml");
    std::fs::write(
        &good,
        format!(
            "listen = \"{}\"\ncert = \"{}\"\nkey = \"{}\"\nca = \"{}\"\nstate_dir = \"{}\"\ndocker_socket = \"/nonexistent/from-the-file.sock\"\nvcpu = 2\n",
            free_port()?,
            files.cert.display(),
            files.key.display(),
            certs.ca.cert.display(),
            state.display()
        ),
    )?;
    build_process_binaries()?;
    let run = |path: &Path| {
        std::process::Command::new(binary_path("billet").expect("billet"))
            .args(["node", "--config"])
            .arg(path)
            .output()
    };
    // Everything comes from the file: it gets as far as the engine it names.
    assert_exit(&run(&good)?, 5, "/nonexistent/from-the-file.sock");

    let bad = dir.join("bad.toml");
    std::fs::write(&bad, "vcpu = \"lots\"\n")?;
    let out = run(&bad)?;
    assert_exit(&out, 2, &bad.display().to_string());
    assert!(String::from_utf8_lossy(&out.stderr).contains("`vcpu`"));

    let unknown = dir.join("unknown.toml");
    std::fs::write(&unknown, "lisen = \"127.0.0.1:1\"\n")?;
    assert_exit(&run(&unknown)?, 2, "`lisen`");

    // A negative number is the key's value, judged by its parser, not a
    // flag; a float in an integer key says what it is.
    for (text, said) in [
        ("max_custody_secs = -5\n", "\"-5\" is not a whole number"),
        ("ack_timeout_secs = 1.5\n", "\"1.5\" is not a whole number"),
        (
            "memory_bytes = 1\n",
            "the smallest value allowed is 67108864",
        ),
    ] {
        let path = dir.join("number.toml");
        std::fs::write(&path, text)?;
        let out = run(&path)?;
        assert_exit(&out, 2, said);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let key = text.split(' ').next().unwrap_or_default();
        assert!(stderr.contains(&path.display().to_string()), "{stderr}");
        assert!(stderr.contains(&format!("`{key}`")), "{stderr}");
        assert!(!stderr.contains("unexpected argument"), "{stderr}");
    }
    Ok(())
}

/// Numbers out of their bounds, and a plane name no certificate can carry,
/// stop start-up naming the flag (exit 2), rather than a node that runs
/// wrong.
#[test]
fn a_number_out_of_bounds_or_a_plane_name_that_is_no_dns_name_exits_2_naming_the_flag() -> Result<()>
{
    let (certs, state) = setup()?;
    for (args, said) in [
        (
            ["--ack-timeout-secs", "0"],
            "the smallest value allowed is 1",
        ),
        (
            ["--memory-bytes", "1"],
            "the smallest value allowed is 67108864",
        ),
        (["--vcpu", "100000"], "the largest value allowed is 4096"),
        (
            ["--tls-reload-secs", "0"],
            "the smallest value allowed is 1",
        ),
        (["--plane-name", "not a dns name!"], "is not a DNS name"),
    ] {
        let out = node(&args, &certs, &state, "/var/run/docker.sock")?;
        assert_exit(&out, 2, said);
        assert_exit(&out, 2, args[0]);
    }
    Ok(())
}

/// A private key others may read, or its group when root does not own it,
/// is refused (exit 3, naming the file, its mode and the flag that takes
/// it anyway), as ssh refuses one; with the flag the start goes on, here
/// to the missing engine. A root-owned key its group may read is root
/// sharing it with the node's group, as PostgreSQL allows.
#[test]
fn a_private_key_readable_beyond_its_owner_exits_3_unless_the_operator_allows_it() -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let (uid, gid) = billet_tests::cluster::other_user()?;
    let (certs, state) = setup()?;
    let key = certs.node("node-1").expect("node files").key.clone();
    for (mode, owner) in [(0o640, Some((uid, gid))), (0o644, None)] {
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(mode))?;
        std::os::unix::fs::chown(&key, owner.map(|o| o.0), owner.map(|o| o.1))?;
        let out = node(&[], &certs, &state, "/nonexistent/docker.sock")?;
        assert_exit(&out, 3, &key.display().to_string());
        assert_exit(&out, 3, &format!("mode {mode:04o}"));
        assert_exit(&out, 3, "--allow-readable-key");
        let out = node(
            &["--allow-readable-key", "true"],
            &certs,
            &state,
            "/nonexistent/docker.sock",
        )?;
        assert_exit(&out, 5, "readable beyond its owner");
    }
    std::os::unix::fs::chown(&key, Some(0), Some(0))?;
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o640))?;
    let out = node(&[], &certs, &state, "/nonexistent/docker.sock")?;
    assert_exit(&out, 5, "/nonexistent/docker.sock");
    Ok(())
}

#[test]
fn a_node_started_with_the_planes_certificate_exits_3() -> Result<()> {
    let (certs, state) = setup()?;
    let cert = certs.plane.cert.display().to_string();
    let key = certs.plane.key.display().to_string();
    let out = node(
        &["--cert", &cert, "--key", &key],
        &certs,
        &state,
        "/var/run/docker.sock",
    )?;
    assert_exit(&out, 3, "plane's name");
    Ok(())
}

#[test]
fn an_updater_without_its_configuration_exits_2_naming_both_flags() -> Result<()> {
    let (certs, state) = setup()?;
    let billet = binary_path("billet")?.display().to_string();
    let out = node(
        &["--upgrader-binary", &billet],
        &certs,
        &state,
        "/var/run/docker.sock",
    )?;
    assert_exit(&out, 2, "--upgrader-binary");
    assert_exit(&out, 2, "set both or neither");
    Ok(())
}

/// A node started with systemd's default soft limit of 1,024 open files
/// (and a higher hard one) runs with the hard one, and says so once (a
/// flood of idle connections can run a node at 1,024 out of descriptors).
/// `BILLET_TEST_NODE_BINARY` runs another build (one that does not raise
/// it, to see it fail).
#[test]
fn the_node_raises_its_soft_open_files_limit_to_the_hard_one_and_logs_it() -> Result<()> {
    build_process_binaries()?;
    let (certs, state) = setup()?;
    let files = certs.node("node-1").context("node files")?;
    let binary = match std::env::var_os("BILLET_TEST_NODE_BINARY") {
        Some(path) => std::path::PathBuf::from(path),
        None => binary_path("billet")?,
    };
    let log = state.with_extension("log");
    let mut child = std::process::Command::new("prlimit")
        .arg("--nofile=1024:4096")
        .arg(binary)
        .args(["node", "--listen", &free_port()?.to_string()])
        .arg("--cert")
        .arg(&files.cert)
        .arg("--key")
        .arg(&files.key)
        .arg("--ca")
        .arg(&certs.ca.cert)
        .arg("--state-dir")
        .arg(&state)
        .args(["--docker-socket", "/var/run/docker.sock"])
        .env("BILLET_LOG", "info")
        .stdout(std::fs::File::create(&log)?)
        .stderr(std::fs::File::create(state.with_extension("err"))?)
        .spawn()
        .context("prlimit (util-linux) runs the node")?;
    // prlimit execs the node in place: the child is the node.
    let limits = format!("/proc/{}/limits", child.id());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let (mut seen, mut logged) = (String::new(), String::new());
    while std::time::Instant::now() < deadline {
        // The log first: the limit is raised before the line is written.
        logged = std::fs::read_to_string(&log)?;
        seen = std::fs::read_to_string(&limits)
            .unwrap_or_default()
            .lines()
            .find(|l| l.starts_with("Max open files"))
            .unwrap_or_default()
            .to_owned();
        if logged.contains("open files limit") || child.try_wait()?.is_some() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    let stderr = std::fs::read_to_string(state.with_extension("err")).unwrap_or_default();
    let fields: Vec<&str> = seen.split_whitespace().collect();
    assert_eq!(
        fields.get(3..5),
        Some(&["4096", "4096"][..]),
        "soft and hard limit of the running node: {seen:?}\nlog:\n{logged}{stderr}"
    );
    let line = logged
        .lines()
        .chain(stderr.lines())
        .find(|l| l.contains("open files limit"))
        .unwrap_or_default();
    assert!(
        line.contains("soft=4096") && line.contains("was=1024"),
        "the limit it runs with, logged once: {line:?}\nlog:\n{logged}{stderr}"
    );
    Ok(())
}
