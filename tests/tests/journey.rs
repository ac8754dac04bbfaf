//! README "Running a node": the operator's journey, run as written. The
//! shell block between `<!-- journey:start -->` and `<!-- journey:end -->`
//! is run by bash from the workspace root (with a scratch directory, a
//! deployment of its own and free ports in its variables, which the block
//! defaults), and must exit 0: build, certificates, check, node, a plane
//! against the scale-set emulator, a job queued and watched with `billet
//! node status`, its metrics scraped, both stopped.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use billet_tests::cluster::{free_port, scratch_dir};

#[test]
fn the_readmes_operator_journey_runs_as_written() -> Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .context("the workspace")?;
    let readme = std::fs::read_to_string(root.join("README.md"))?;
    let (_, rest) = readme
        .split_once("<!-- journey:start -->")
        .context("README has no journey")?;
    let (journey, _) = rest
        .split_once("<!-- journey:end -->")
        .context("the journey does not end")?;
    let script: String = journey
        .split("```sh")
        .skip(1)
        .filter_map(|block| block.split_once("```").map(|(code, _)| code))
        .collect::<Vec<_>>()
        .join("\n");
    ensure!(script.contains("billet-plane --emulator"), "{script}");

    let trial = scratch_dir("journey")?;
    let deployment = format!("journey-{}", std::process::id());
    let out = trial.join("journey.out");
    use std::os::unix::process::CommandExt;
    let mut child = std::process::Command::new("bash")
        .args(["-euc", &script])
        // Its own process group: the node and plane it starts in the
        // background are in it too, and end with it.
        .process_group(0)
        .current_dir(root)
        .env("TRIAL", &trial)
        .env("DEPLOYMENT", &deployment)
        .env("NODE_PORT", free_port()?.port().to_string())
        .env("METRICS_PORT", free_port()?.port().to_string())
        .env("EMULATOR_PORT", free_port()?.port().to_string())
        .stdout(std::fs::File::create(&out)?)
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    // Bounded: a journey that hangs is killed, with what it printed.
    let deadline = std::time::Instant::now() + Duration::from_secs(600);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut stderr);
    }
    let printed = std::fs::read_to_string(&out).unwrap_or_default();
    let logs = ["node.log", "plane.log"]
        .iter()
        .map(|f| {
            format!(
                "--- {f}\n{}",
                std::fs::read_to_string(trial.join(f)).unwrap_or_default()
            )
        })
        .collect::<Vec<_>>()
        .join("\n");
    // Whatever happened, no process of the journey outlives it.
    let _ = std::process::Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", child.id())])
        .stderr(std::process::Stdio::null())
        .status();
    let status = status.with_context(|| {
        format!(
            "the journey did not finish in 600 s\nstdout:\n{printed}\nstderr:\n{stderr}\n{logs}"
        )
    })?;
    ensure!(
        status.success(),
        "the journey failed ({status})\nstdout:\n{printed}\nstderr:\n{stderr}\n{logs}"
    );
    // What the operator was shown: the lease running, then its metrics.
    ensure!(printed.contains("ok: billet node would start"), "{printed}");
    ensure!(
        printed
            .lines()
            .any(|l| l.contains("running") && l.contains("billet-")),
        "no running lease in the status shown:\n{printed}"
    );
    ensure!(
        printed.contains("billet_commands_total{kind=\"launch\",outcome=\"ok\",reason=\"none\"} 1"),
        "{printed}"
    );
    Ok(())
}
