//! The Debian package (README "Packaging"): built by `scripts/deb` from the
//! build these tests already made (`--profile` of this test binary, so no
//! second build), installed with `dpkg -i` in a container booted from this
//! machine's systemd (`tests/src/systemd.rs`). Its postinst makes the
//! `billet` system user, in the docker group; `billet --version` is this
//! build's; the man page and the completions generated from the clap
//! definitions are where `man` and the shells look; and, once the operator
//! has put TLS material in `/etc/billet/tls` and edited the conffile
//! `/etc/billet/node.env`, the packaged unit starts, ready, as `billet`.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, ensure};
use billet_tests::cluster::{NODE_UNIT, free_port};
use billet_tests::image::{binary_path, build_process_binaries, profile_dir};
use billet_tests::systemd::SystemdHost;

/// The package's files an operator relies on, beside the binary.
const INSTALLED: [&str; 9] = [
    "/usr/bin/billet",
    "/lib/systemd/system/billet-node.service",
    "/lib/systemd/system/billet-node.service.d/package.conf",
    "/etc/billet/node.env",
    "/usr/share/man/man1/billet.1.gz",
    "/usr/share/man/man1/billet-node.1.gz",
    "/usr/share/bash-completion/completions/billet",
    "/usr/share/zsh/vendor-completions/_billet",
    "/usr/share/fish/vendor_completions.d/billet.fish",
];

/// The cargo profile this test was built with, as `cargo --profile` names it.
fn profile() -> String {
    match profile_dir().file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev".to_owned(),
        Some(other) => other.to_owned(),
    }
}

/// Runs `scripts/deb` for this profile, writing the package to `deb`.
fn build_package(deb: &Path) -> Result<()> {
    let have = Command::new("cargo")
        .args(["deb", "--version"])
        .output()
        .context("run cargo")?;
    ensure!(
        have.status.success(),
        "cargo-deb is missing: `cargo install cargo-deb --locked` (scripts/test installs it)"
    );
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/deb");
    let out = Command::new(&script)
        .args(["--profile", &profile(), "--fast", "-o"])
        .arg(deb)
        .output()
        .with_context(|| format!("run {}", script.display()))?;
    ensure!(
        out.status.success() && deb.is_file(),
        "scripts/deb failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_debian_package_installs_a_billet_user_the_docs_and_a_unit_that_starts_as_that_user()
-> Result<()> {
    build_process_binaries()?;
    let host = SystemdHost::start(Path::new("/var/run/docker.sock"))?;
    let deb = host.shared.join("billet.deb");
    build_package(&deb)?;
    let deb = deb.display().to_string();

    host.run(&["dpkg", "-i", &deb])?;
    let listed = host.run(&["dpkg", "-L", "billet"])?;
    for path in INSTALLED {
        assert!(
            listed.lines().any(|l| l == path),
            "the package lacks {path}: {listed}"
        );
        host.run(&["test", "-s", path])
            .with_context(|| format!("{path} is not installed"))?;
    }
    let conffiles = host.run(&["dpkg-query", "-W", "-f", "${Conffiles}", "billet"])?;
    assert!(
        conffiles.contains("/etc/billet/node.env"),
        "node.env is not a conffile: {conffiles}"
    );

    // The system user, and the group that opens Docker's socket.
    let user = host.run(&["getent", "passwd", "billet"])?;
    let fields: Vec<&str> = user.trim().split(':').collect();
    assert_eq!(fields.get(5), Some(&"/var/lib/billet"), "{user}");
    assert_eq!(fields.get(6), Some(&"/usr/sbin/nologin"), "{user}");
    let uid: u32 = fields.get(2).context("a uid")?.parse()?;
    assert!(uid < 1000, "billet is not a system user: {user}");
    let groups = host.run(&["id", "-nG", "billet"])?;
    assert!(
        groups.split_whitespace().any(|g| g == "docker"),
        "billet is not in the docker group: {groups}"
    );
    let tls = host.run(&["stat", "-c", "%a %U %G", "/etc/billet/tls"])?;
    assert_eq!(tls.trim(), "750 billet billet");

    // The packaged binary is this build, and says its commit.
    let version = host.run(&["billet", "--version"])?;
    let here = Command::new(binary_path("billet")?)
        .arg("--version")
        .output()?;
    assert_eq!(version, String::from_utf8_lossy(&here.stdout));
    assert!(
        version.contains("(commit ") && !version.contains("unknown"),
        "{version}"
    );

    // The documentation generated from the clap definitions.
    let man = host.run(&["gzip", "-dc", "/usr/share/man/man1/billet.1.gz"])?;
    assert!(man.contains(".TH billet"), "{man}");
    for needle in ["billet\\-node", "billet\\-check", "\\-\\-state\\-dir"] {
        assert!(man.contains(needle), "the man page lacks {needle}");
    }
    let node_man = host.run(&["gzip", "-dc", "/usr/share/man/man1/billet-node.1.gz"])?;
    for needle in [
        ".SH ENVIRONMENT",
        ".SH FILES",
        ".SH EXIT STATUS",
        "BILLET_LISTEN",
    ] {
        assert!(node_man.contains(needle), "billet-node(1) lacks {needle}");
    }
    let bash = host.run(&["cat", "/usr/share/bash-completion/completions/billet"])?;
    assert!(bash.contains("--metrics-listen") && bash.contains("host-upgrade"));

    // Installed, not enabled: the node needs its TLS material first.
    let enabled = host.exec(&["systemctl", "is-enabled", NODE_UNIT])?;
    assert_eq!(String::from_utf8_lossy(&enabled.stdout).trim(), "disabled");
    assert_eq!(host.property(NODE_UNIT, "User")?, "billet");
    assert_eq!(
        host.property(NODE_UNIT, "ExecStart")?
            .split_whitespace()
            .find(|w| w.starts_with("path="))
            .unwrap_or_default(),
        "path=/usr/bin/billet"
    );

    // What the operator does: certificates into /etc/billet/tls, readable
    // by the node's group; the conffile edited; the unit started. The
    // node's certificate has expired (it was down past its end): the node
    // starts on it all the same and is re-enrolled below.
    let certs = billet_certs_dev::generate_with_nodes(
        &host.shared.join("certs"),
        "plane",
        &["node-1"],
        &billet_certs_dev::Options::default(),
        &billet_certs_dev::NodeOptions {
            validity: Some(billet_certs_dev::Validity::expired()),
            ..Default::default()
        },
    )?;
    let node = certs.node("node-1").context("node-1's certificate")?;
    for (from, to) in [
        (&certs.ca.cert, "ca.pem"),
        (&node.cert, "node.pem"),
        (&node.key, "node.key"),
    ] {
        let to = format!("/etc/billet/tls/{to}");
        host.run(&[
            "install",
            "-m",
            "0640",
            "-o",
            "root",
            "-g",
            "billet",
            &from.display().to_string(),
            &to,
        ])?;
    }
    let listen = free_port()?;
    let deployment = format!("pkg-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let env = host.run(&["cat", "/etc/billet/node.env"])?;
    let edited: String = env
        .lines()
        .map(|l| match l.split_once('=') {
            Some(("BILLET_LISTEN", _)) => format!("BILLET_LISTEN={listen}"),
            Some(("BILLET_DEPLOYMENT", _)) => format!("BILLET_DEPLOYMENT={deployment}"),
            _ => l.to_owned(),
        })
        .chain([
            "BILLET_VCPU=2".to_owned(),
            "BILLET_MEMORY_BYTES=1073741824".to_owned(),
        ])
        .map(|l| l + "\n")
        .collect();
    host.write_file("/etc/billet/node.env", &edited)?;
    // Type=notify: this returns once the node is ready (journal read,
    // Docker answered, both listeners up), or fails.
    host.run(&["systemctl", "start", NODE_UNIT])
        .with_context(|| journal(&host))?;
    assert_eq!(host.property(NODE_UNIT, "ActiveState")?, "active");
    let pid = host.property(NODE_UNIT, "MainPID")?;
    let status = host.run(&["cat", &format!("/proc/{pid}/status")])?;
    let running_as = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next())
        .context("the node's uid")?;
    assert_eq!(
        running_as,
        uid.to_string(),
        "the node does not run as billet"
    );
    let state = host.run(&["stat", "-c", "%a %U", "/var/lib/billet"])?;
    assert_eq!(state.trim(), "700 billet");
    let said = host.run(&["billet", "node", "status", "--state-dir", "/var/lib/billet"])?;
    assert!(
        said.lines().any(|l| l.starts_with("version")
            && version.contains(l.split_whitespace().last().unwrap_or("?"))),
        "{said}"
    );

    // The installed service writes its TLS directory: a plane attached to
    // nothing yet (the node's certificate has expired) enrols it with a
    // join token, and the node writes the new key and certificate there
    // itself, as billet, the key private; the plane then attaches.
    let (plane, enroll_addr, shutdown, _github) =
        plane_for(&certs, &host, listen, &deployment).await?;
    let token = plane
        .issue_join_token("node-1", std::time::Duration::from_secs(600))
        .await?;
    let token_file = host.shared.join("join-token");
    std::fs::write(&token_file, format!("{token}\n"))?;
    let enrolled = host.exec(&[
        "billet",
        "node",
        "enroll",
        "--state-dir",
        "/var/lib/billet",
        "--plane",
        &enroll_addr.to_string(),
        "--token-file",
        &token_file.display().to_string(),
    ])?;
    ensure!(
        enrolled.status.success(),
        "billet node enroll in the packaged service failed: {}{}\n{}",
        String::from_utf8_lossy(&enrolled.stdout),
        String::from_utf8_lossy(&enrolled.stderr),
        journal(&host)
    );
    let key = host.run(&["stat", "-c", "%a %U", "/etc/billet/tls/node.key"])?;
    assert_eq!(
        key.trim(),
        "600 billet",
        "the new key is not the node's alone"
    );
    let cert = host.run(&["stat", "-c", "%U", "/etc/billet/tls/node.pem"])?;
    assert_eq!(
        cert.trim(),
        "billet",
        "the node did not write its certificate"
    );
    let written = host.run(&["cat", "/etc/billet/tls/node.pem"])?;
    ensure!(
        written != std::fs::read_to_string(&node.cert)?,
        "the certificate on disk is still the expired one"
    );
    let link = plane.node("node-1").context("node-1's link")?;
    let mut attached = link.status();
    tokio::time::timeout(
        std::time::Duration::from_secs(30),
        attached.wait_for(Option::is_some),
    )
    .await
    .with_context(|| {
        format!(
            "the plane did not attach after the enrolment: {}",
            journal(&host)
        )
    })??;
    shutdown.cancel();

    // Stopping drains nothing (nothing is held); removing keeps the user
    // and the operator's configuration.
    host.run(&["systemctl", "stop", NODE_UNIT])?;
    host.run(&["dpkg", "-r", "billet"])?;
    host.run(&["getent", "passwd", "billet"])?;
    let gone = host.exec(&["test", "-e", "/usr/bin/billet"])?;
    assert!(!gone.status.success(), "dpkg -r left /usr/bin/billet");
    host.run(&["test", "-s", "/etc/billet/node.env"])?;
    Ok(())
}

/// A plane of `deployment` that dials the packaged node at `listen` and serves its
/// enrolment endpoint, signing with the certificates' CA; GitHub is the
/// emulator (returned, to be kept alive), and no job is queued.
async fn plane_for(
    certs: &billet_certs_dev::DevCerts,
    host: &SystemdHost,
    listen: std::net::SocketAddr,
    deployment: &str,
) -> Result<(
    std::sync::Arc<billet_controlplane_stub::plane::Plane>,
    std::net::SocketAddr,
    tokio_util::sync::CancellationToken,
    scaleset::testing::Emulator,
)> {
    use billet_controlplane_stub::node_link::{NodeTarget, PlaneTls};
    use billet_controlplane_stub::plane::{Plane, PlaneConfig, Tier};
    use std::time::Duration;
    let read = |p: &Path| std::fs::read(p).with_context(|| format!("read {}", p.display()));
    let github = scaleset::testing::Emulator::builder().start().await;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let config = PlaneConfig {
        deployment: deployment.to_owned(),
        lease_ttl: Duration::from_secs(15),
        ledger: host.shared.join("ledger.db").into(),
        tls: PlaneTls {
            ca_pem: read(&certs.ca.cert)?,
            cert_pem: read(&certs.plane.cert)?,
            key_pem: read(&certs.plane.key)?,
        },
        nodes: vec![NodeTarget {
            name: "node-1".into(),
            addr: listen,
        }],
        tier: Tier {
            label: "billet-package".into(),
            image: "unused:never-launched".into(),
            command: Vec::new(),
            trust: "trusted".into(),
            vcpu: 1,
            memory_bytes: 256 << 20,
            network: "host".into(),
            env: Vec::new(),
            sticky_disks: Vec::new(),
            actions_cache: None,
            docker_image_store: false,
            min_runner_version: String::new(),
        },
        launch_timeout: Duration::from_secs(60),
        mint_before_dispatch: true,
        destroy_timeout: Duration::from_secs(60),
        reap_interval: Duration::from_secs(1),
        max_runners: 1,
        maintenance_interval: Duration::from_secs(2),
        quarantine_grace: Duration::from_secs(300),
        renewal_grace: billet_controlplane_stub::plane::RENEWAL_GRACE,
        scale_set_retry: billet_controlplane_stub::github::SCALE_SET_RETRY,
        registration_interval: Duration::from_secs(60),
        registration_grace: Duration::from_secs(120),
        node_ca: Some(std::sync::Arc::new(
            billet_controlplane_stub::identity::NodeCa::from_pem(
                &std::fs::read_to_string(&certs.ca.cert)?,
                &std::fs::read_to_string(&certs.ca.key)?,
                Duration::from_secs(3600),
            )?,
        )),
        node_keepalive: billet_controlplane_stub::node_link::Keepalive::default(),
        warm: billet_controlplane_stub::plane::WarmConfig::default(),
        jobs: billet_controlplane_stub::plane::JobsConfig::default(),
    };
    let plane = Plane::start(config, github.client(), shutdown.clone())
        .await
        .context("start the plane")?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    plane.serve_enrollment(listener, shutdown.clone());
    Ok((plane, addr, shutdown, github))
}

/// The unit's journal, for a failure's context.
fn journal(host: &SystemdHost) -> String {
    host.exec(&["journalctl", "-u", NODE_UNIT, "--no-pager", "-n", "50"])
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}
