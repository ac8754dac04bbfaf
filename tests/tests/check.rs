//! `billet check`: what `billet node` checks before serving, with the same
//! exit codes (README "Exit codes"), holding and creating nothing; and a
//! configuration file's relative paths resolve against its own directory.

use std::path::{Path, PathBuf};
use std::process::Output;

use anyhow::Result;
use billet_tests::cluster::scratch_dir;
use billet_tests::image::{binary_path, build_process_binaries};

struct Setup {
    certs: billet_certs_dev::DevCerts,
    dir: PathBuf,
    state: PathBuf,
}

fn setup() -> Result<Setup> {
    let dir = scratch_dir("check")?;
    let certs = billet_certs_dev::generate(&dir.join("certs"), "plane", &["node-1"])?;
    Ok(Setup {
        certs,
        state: dir.join("state"),
        dir,
    })
}

impl Setup {
    /// `billet <sub>` with a whole node configuration on the command line,
    /// `extra` flag/value pairs replacing or adding to it.
    fn run(&self, sub: &str, listen: &str, extra: &[&str]) -> Result<Output> {
        build_process_binaries()?;
        let files = self.certs.node("node-1").expect("node files");
        let mut flags: Vec<(String, String)> = vec![
            ("--listen".into(), listen.into()),
            ("--cert".into(), files.cert.display().to_string()),
            ("--key".into(), files.key.display().to_string()),
            ("--ca".into(), self.certs.ca.cert.display().to_string()),
            ("--state-dir".into(), self.state.display().to_string()),
            ("--docker-socket".into(), "/var/run/docker.sock".into()),
        ];
        for pair in extra.chunks(2) {
            match flags.iter_mut().find(|(f, _)| f == pair[0]) {
                Some(slot) => slot.1 = pair[1].to_owned(),
                None => flags.push((pair[0].to_owned(), pair[1].to_owned())),
            }
        }
        let mut command = std::process::Command::new(binary_path("billet")?);
        command.arg(sub);
        for (flag, value) in flags {
            command.args([flag, value]);
        }
        Ok(command.env("BILLET_LOG", "info").output()?)
    }
}

fn assert_exit(out: &Output, code: i32, mentions: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(code),
        "stdout:\n{stdout}\nstderr:\n{stderr}"
    );
    assert!(
        stderr.contains(mentions) || stdout.contains(mentions),
        "the output should mention {mentions:?}:\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
}

#[test]
fn check_accepts_a_good_configuration_releasing_its_ports_and_creating_no_state_directory()
-> Result<()> {
    let s = setup()?;
    let listen = billet_tests::cluster::free_port()?;
    let metrics = billet_tests::cluster::free_port()?;
    let out = s.run(
        "check",
        &listen.to_string(),
        &["--metrics-listen", &metrics.to_string()],
    )?;
    assert_exit(&out, 0, "ok: billet node would start");
    assert_exit(&out, 0, "node node-1");
    assert_exit(
        &out,
        0,
        &format!("--metrics-listen: {metrics} can be bound"),
    );
    assert!(
        !s.state.exists(),
        "check created the state directory {}",
        s.state.display()
    );
    // Released: the node can have them.
    drop(std::net::TcpListener::bind(listen)?);
    drop(std::net::TcpListener::bind(metrics)?);
    Ok(())
}

/// A taken port is found by the check, not by the node's start (exit 4,
/// naming the flag and the address).
#[test]
fn check_exits_4_naming_the_flag_when_an_address_the_node_would_bind_is_taken() -> Result<()> {
    let s = setup()?;
    let held = std::net::TcpListener::bind("127.0.0.1:0")?;
    let taken = held.local_addr()?.to_string();
    let free = billet_tests::cluster::free_port()?.to_string();
    let out = s.run("check", &taken, &[])?;
    assert_exit(&out, 4, &format!("cannot listen on {taken} (--listen)"));
    let out = s.run("check", &free, &["--metrics-listen", &taken])?;
    assert_exit(
        &out,
        4,
        &format!("cannot listen on {taken} (--metrics-listen)"),
    );
    let out = s.run("check", &free, &["--cache-proxy-listen", &taken])?;
    assert_exit(
        &out,
        4,
        &format!("cannot listen on {taken} (--cache-proxy-listen)"),
    );
    assert!(!String::from_utf8_lossy(&out.stdout).contains("would start"));
    Ok(())
}

#[test]
fn check_exits_with_the_code_billet_node_would_for_each_fault() -> Result<()> {
    let s = setup()?;
    // A port of its own: the check binds it, beside other tests' checks.
    let listen = &billet_tests::cluster::free_port()?.to_string();
    // 2: a bad value, naming the flag.
    assert_exit(&s.run("check", listen, &["--vcpu", "0"])?, 2, "--vcpu");
    // 3: a certificate that cannot be read, naming it.
    assert_exit(
        &s.run("check", listen, &["--cert", "/nonexistent/node.pem"])?,
        3,
        "/nonexistent/node.pem",
    );
    // 3: the plane's certificate as the node's.
    let (plane_cert, plane_key) = (
        s.certs.plane.cert.display().to_string(),
        s.certs.plane.key.display().to_string(),
    );
    assert_exit(
        &s.run(
            "check",
            listen,
            &["--cert", &plane_cert, "--key", &plane_key],
        )?,
        3,
        "plane's name",
    );
    // 5: no engine on the socket, naming it.
    assert_exit(
        &s.run(
            "check",
            listen,
            &["--docker-socket", "/nonexistent/docker.sock"],
        )?,
        5,
        "/nonexistent/docker.sock",
    );
    // 6: a state directory that is a file.
    let file = s.dir.join("a-file");
    std::fs::write(&file, b"not a directory")?;
    let shown = file.display().to_string();
    assert_exit(
        &s.run("check", listen, &["--state-dir", &shown])?,
        6,
        "is not a directory",
    );
    // 7: a journal that is not one, left as it was.
    std::fs::create_dir_all(&s.state)?;
    let journal = s.state.join("journal.db");
    std::fs::write(&journal, b"not a journal ".repeat(300))?;
    assert_exit(
        &s.run("check", listen, &[])?,
        7,
        &journal.display().to_string(),
    );
    assert!(std::fs::read(&journal)?.starts_with(b"not a journal"));
    Ok(())
}

#[test]
fn check_reads_a_journal_a_node_wrote_and_notes_a_running_node() -> Result<()> {
    let s = setup()?;
    let port = billet_tests::cluster::free_port()?.to_string();
    let mut node = std::process::Command::new(binary_path("billet")?);
    build_process_binaries()?;
    let files = s.certs.node("node-1").expect("node files");
    node.arg("node")
        .args(["--listen", &port])
        .arg("--cert")
        .arg(&files.cert)
        .arg("--key")
        .arg(&files.key)
        .arg("--ca")
        .arg(&s.certs.ca.cert)
        .arg("--state-dir")
        .arg(&s.state)
        .stderr(std::process::Stdio::null());
    let mut child = node.spawn()?;
    let socket = s.state.join("node.sock");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !socket.exists() {
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the node never made its socket"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // Its port is bound after its socket.
    while std::net::TcpStream::connect(&port).is_err() {
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "the node never listened on {port}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = s.run("check", &port, &[]);
    let _ = child.kill();
    let _ = child.wait();
    let out = out?;
    assert_exit(&out, 0, "journal: readable");
    assert_exit(&out, 0, "a node is running on this state directory");
    assert_exit(
        &out,
        0,
        &format!("--listen {port} is in use, perhaps by the node running"),
    );
    Ok(())
}

#[test]
fn relative_paths_in_a_configuration_file_resolve_against_its_directory() -> Result<()> {
    let s = setup()?;
    let files = s.certs.node("node-1").expect("node files");
    let relative = |p: &Path| {
        p.strip_prefix(&s.dir)
            .expect("under the scratch directory")
            .display()
            .to_string()
    };
    let config = s.dir.join("node.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:1\"\ncert = \"{}\"\nkey = \"{}\"\nca = \"{}\"\nstate_dir = \"state\"\n",
            relative(&files.cert),
            relative(&files.key),
            relative(&s.certs.ca.cert),
        ),
    )?;
    build_process_binaries()?;
    // Run from `/`, as systemd runs the node.
    let out = std::process::Command::new(binary_path("billet")?)
        .args(["check", "--config"])
        .arg(&config)
        .current_dir("/")
        .output()?;
    assert_exit(&out, 0, &s.state.display().to_string());
    assert_exit(&out, 0, &files.cert.display().to_string());
    Ok(())
}

/// `billet check` says which file system the cache directory is on and what
/// a sticky-disk mount costs there: reflinks on an XFS made with
/// `reflink=1`, a copy (and how to do better) elsewhere; and the eviction
/// flags are checked, each error naming its flag.
#[test]
fn check_says_whether_the_cache_directory_has_reflinks_and_checks_the_eviction_flags() -> Result<()>
{
    let s = setup()?;
    // A port of its own: the check binds it, beside other tests' checks.
    let listen = &billet_tests::cluster::free_port()?.to_string();
    let plain = s.dir.join("cache-plain");
    std::fs::create_dir_all(&plain)?;
    let kind = billet_agent::cache::clone::filesystem_kind(&plain)?;
    let out = s.run(
        "check",
        listen,
        &["--cache-dir", &plain.display().to_string()],
    )?;
    if kind != "xfs" && kind != "btrfs" {
        assert_exit(&out, 0, &format!("on {kind}, no reflinks: a mount copies"));
    }
    assert_exit(
        &out,
        0,
        "kept 168 h after their last use, no byte bound (Docker image stores kept 192 h)",
    );
    let xfs = billet_tests::scratchfs::ScratchFs::xfs_reflink(&s.dir, 1)?;
    let out = s.run(
        "check",
        listen,
        &[
            "--cache-dir",
            &xfs.path.display().to_string(),
            "--cache-max-bytes",
            "1000000",
        ],
    )?;
    assert_exit(
        &out,
        0,
        "on xfs, reflinks: a mount clones each file's extents",
    );
    assert_exit(&out, 0, "at most 1000000 bytes");
    assert_eq!(
        std::fs::read_dir(&xfs.path)?.count(),
        0,
        "the probe left nothing behind"
    );
    assert_exit(
        &s.run("check", listen, &["--cache-max-bytes", "0"])?,
        2,
        "--cache-max-bytes",
    );
    assert_exit(
        &s.run("check", listen, &["--cache-retention-hours", "0"])?,
        2,
        "--cache-retention-hours",
    );
    assert_exit(
        &s.run(
            "check",
            listen,
            &["--cache-image-store-retention-hours", "0"],
        )?,
        2,
        "--cache-image-store-retention-hours",
    );
    Ok(())
}

/// `billet check` must not say ok for a state directory on a read-only
/// file system (a hardened unit without its `ReadWritePaths=`), absent or
/// present, where `billet node` then exits 6. Both exit 6 naming the
/// directory, and nothing is written.
#[test]
fn check_refuses_a_state_directory_it_could_not_write_as_the_node_would() -> Result<()> {
    let s = setup()?;
    // A port of its own: the check binds it, beside other tests' checks.
    let listen = &billet_tests::cluster::free_port()?.to_string();
    let ro = billet_tests::scratchfs::ScratchFs::tmpfs(1)?;
    std::fs::create_dir(ro.path.join("present"))?;
    let remounted = std::process::Command::new("mount")
        .args(["-o", "remount,ro"])
        .arg(&ro.path)
        .status()?;
    anyhow::ensure!(remounted.success(), "cannot remount the tmpfs read-only");
    for name in ["absent", "present"] {
        let state = ro.path.join(name).display().to_string();
        let out = s.run("check", listen, &["--state-dir", &state])?;
        assert_exit(&out, 6, &state);
        assert_exit(&out, 6, "read-only");
        let node = s.run("node", listen, &["--state-dir", &state])?;
        assert_eq!(
            node.status.code(),
            Some(6),
            "billet node with the same state directory: {}",
            String::from_utf8_lossy(&node.stderr)
        );
    }
    assert!(!ro.path.join("absent").exists());
    Ok(())
}

/// A `--cache-dir` too long for the guests' cache sockets
/// (`<dir>/guests/<8 hex>/cache.sock`, at most 107 bytes), with which the
/// node would give every job no cache API, is refused by `billet check`
/// and by the node, exit 6, saying how long it may be; one just short
/// enough is accepted.
#[test]
fn check_and_the_node_refuse_a_cache_directory_too_long_for_the_guests_sockets() -> Result<()> {
    let s = setup()?;
    // A port of its own: the check binds it, beside other tests' checks.
    let listen = &billet_tests::cluster::free_port()?.to_string();
    let suffix = "/guests/00000000/cache.sock".len();
    let base = s.dir.display().to_string();
    let pad = |total: usize| format!("{base}/{}", "c".repeat(total - base.len() - 1));
    let long = pad(108 - suffix);
    let out = s.run("check", listen, &["--cache-dir", &long])?;
    assert_exit(&out, 6, "too long for the guests' cache sockets");
    assert_exit(&out, 6, &format!("at most {}", 107 - suffix));
    let node = s.run("node", listen, &["--cache-dir", &long])?;
    assert_eq!(
        node.status.code(),
        Some(6),
        "billet node with the same cache directory: {}",
        String::from_utf8_lossy(&node.stderr)
    );
    let fits = pad(107 - suffix);
    assert_exit(
        &s.run("check", listen, &["--cache-dir", &fits])?,
        0,
        "ok: billet node would start",
    );
    Ok(())
}
