//! What a service manager and the updater see of a starting node: systemd's
//! readiness protocol (`Type=notify`) and the local socket. Real `billet
//! node` processes on real Docker.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use billet_tests::cluster::{free_port, scratch_dir};
use billet_tests::image::{binary_path, build_process_binaries};

struct Node {
    child: Child,
    listen: std::net::SocketAddr,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(dir: &Path, state: &Path, notify: Option<&Path>) -> Result<Node> {
    build_process_binaries()?;
    let certs = billet_certs_dev::generate(&dir.join("certs"), "plane", &["node-1"])?;
    let files = certs.node("node-1").context("node files")?;
    let listen = free_port()?;
    let mut cmd = Command::new(binary_path("billet")?);
    cmd.args(["node", "--listen", &listen.to_string(), "--cert"])
        .arg(&files.cert)
        .arg("--key")
        .arg(&files.key)
        .arg("--ca")
        .arg(&certs.ca.cert)
        .arg("--state-dir")
        .arg(state)
        .env("BILLET_LOG", "info")
        .env_remove("NOTIFY_SOCKET")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(socket) = notify {
        cmd.env("NOTIFY_SOCKET", socket);
    }
    Ok(Node {
        child: cmd.spawn().context("start billet node")?,
        listen,
    })
}

async fn receive(socket: &tokio::net::UnixDatagram, within: Duration) -> Result<String> {
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(within, socket.recv(&mut buf))
        .await
        .context("no notification in time")??;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

#[tokio::test]
async fn systemd_hears_ready_once_both_listeners_are_up_and_stopping_when_a_drain_starts()
-> Result<()> {
    let dir = scratch_dir("readiness")?;
    let state = dir.join("state");
    let notify_path = dir.join("notify.sock");
    let socket = tokio::net::UnixDatagram::bind(&notify_path)?;
    let mut node = start(&dir, &state, Some(&notify_path))?;

    let ready = receive(&socket, Duration::from_secs(30)).await?;
    ensure!(
        ready.lines().any(|l| l == "READY=1"),
        "first notification: {ready:?}"
    );
    // Ready means both listeners answer.
    std::net::TcpStream::connect(node.listen).context("the network listener at READY=1")?;
    let seen = billet_agent::local::check(&state, Duration::from_secs(5))
        .await
        .map_err(anyhow::Error::msg)?;
    assert!(seen.serving, "health says serving at READY=1");
    assert_eq!(
        seen.status.version,
        billet_agent::upgrade::version::version()
    );
    assert_eq!(seen.status.pid, node.child.id());
    assert!(
        !seen.status.recovered,
        "no plane has attached, so no recovery yet"
    );

    let term = Command::new("kill")
        .args(["-TERM", &node.child.id().to_string()])
        .status()?;
    ensure!(term.success(), "kill -TERM");
    let stopping = receive(&socket, Duration::from_secs(30)).await?;
    ensure!(
        stopping.lines().any(|l| l == "STOPPING=1"),
        "after SIGTERM: {stopping:?}"
    );
    let status = match wait_exit(&mut node.child, Duration::from_secs(30)) {
        Ok(s) => s,
        Err(e) => {
            let _ = node.child.kill();
            let mut stderr = String::new();
            if let Some(err) = node.child.stderr.as_mut() {
                let _ = std::io::Read::read_to_string(err, &mut stderr);
            }
            bail!("{e}; its log:\n{stderr}");
        }
    };
    assert_eq!(status.code(), Some(0));
    assert!(
        !billet_agent::local::socket_path(&state).exists(),
        "the local socket is removed on a clean stop"
    );
    Ok(())
}

#[tokio::test]
async fn a_second_node_on_a_state_directory_in_use_is_refused_with_exit_6() -> Result<()> {
    let dir = scratch_dir("readiness")?;
    let state = dir.join("state");
    let first = start(&dir, &state, None)?;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while billet_agent::local::check(&state, Duration::from_secs(2))
        .await
        .is_err()
    {
        ensure!(
            std::time::Instant::now() < deadline,
            "the first node never served its socket"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let second_dir: PathBuf = dir.join("second");
    let mut second = start(&second_dir, &state, None)?;
    let status = wait_exit(&mut second.child, Duration::from_secs(30))?;
    let mut stderr = String::new();
    std::io::Read::read_to_string(second.child.stderr.as_mut().context("stderr")?, &mut stderr)?;
    assert_eq!(status.code(), Some(6), "stderr:\n{stderr}");
    assert!(
        stderr.contains("another billet node is running on this state directory"),
        "{stderr}"
    );
    let seen = billet_agent::local::check(&state, Duration::from_secs(5))
        .await
        .map_err(anyhow::Error::msg)?;
    assert_eq!(
        seen.status.pid,
        first.child.id(),
        "the first node still answers"
    );
    Ok(())
}

fn wait_exit(child: &mut Child, within: Duration) -> Result<std::process::ExitStatus> {
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if std::time::Instant::now() > deadline {
            bail!("the node did not exit within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
