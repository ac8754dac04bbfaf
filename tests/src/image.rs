//! The stand-in runner's container image, built from the project's own binary.
//!
//! No registry is reachable, so nothing is pulled: the image is `FROM scratch` with the binary at
//! `/billet-standin-runner` and every shared library `ldd` lists for it, each stored at the
//! absolute path `ldd` printed (symlinks followed, so the real file sits under the linked name),
//! the dynamic loader included. There are no CA certificates: the runner speaks plain HTTP to the
//! emulator.
//!
//! The binaries of other packages are not built by `cargo test -p billet-tests`; [`binary_path`]
//! finds them in the target directory of the running test and says what to build when missing.

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail, ensure};
use bollard::Docker;
use bollard::query_parameters::BuildImageOptionsBuilder;
use futures::StreamExt as _;

/// Where the binary is put in the image, and its entrypoint.
pub const STANDIN_ENTRYPOINT: &str = "/billet-standin-runner";

/// The stand-in runner's binary name.
pub const STANDIN_BINARY: &str = "billet-standin-runner";

/// Directory of the build context whose contents become the image's root.
const ROOTFS: &str = "rootfs";

/// Connects to the local Docker engine (`DOCKER_HOST` or `/var/run/docker.sock`) and negotiates
/// the API version down to the engine's (1.41 for engine 20.10).
///
/// # Errors
///
/// The engine is unreachable; the message says so plainly, since a test that needs Docker must
/// fail rather than skip.
pub async fn connect_docker() -> anyhow::Result<Docker> {
    let unreachable = "Docker is unreachable; these tests need a running Docker engine \
                       (DOCKER_HOST or /var/run/docker.sock)";
    let docker = Docker::connect_with_local_defaults().context(unreachable)?;
    let docker = docker.negotiate_version().await.context(unreachable)?;
    docker.ping().await.context(unreachable)?;
    Ok(docker)
}

/// Builds the stand-in runner's image from `binary` and tags it `tag`.
///
/// The build context is made in memory: a `Dockerfile` (`FROM scratch`, `COPY rootfs/ /`,
/// `ENTRYPOINT ["/billet-standin-runner"]`) and `rootfs/` holding the binary and its shared
/// libraries. The classic builder is used and nothing is pulled. The image `tag` named before
/// is removed once no other tag names it (a running test's content pin keeps it).
///
/// # Errors
///
/// `binary` or one of its libraries cannot be read, `ldd` fails or reports a library
/// `not found`, or the engine refuses the build (its error text is in the message, with the
/// build output before it).
pub async fn build_standin_image(docker: &Docker, binary: &Path, tag: &str) -> anyhow::Result<()> {
    let context = standin_build_context(binary)?;
    let previous = docker.inspect_image(tag).await.ok().and_then(|i| i.id);
    let options = BuildImageOptionsBuilder::default()
        .dockerfile("Dockerfile")
        .t(tag)
        .rm(true)
        .forcerm(true)
        .build();
    let mut output = String::new();
    let mut build = docker.build_image(options, None, Some(bollard::body_full(context.into())));
    while let Some(item) = build.next().await {
        match item {
            Ok(info) => {
                if let Some(line) = info.stream {
                    output.push_str(&line);
                }
            }
            Err(e) => {
                let engine_said = match e {
                    bollard::errors::Error::DockerStreamError { error } => error,
                    other => other.to_string(),
                };
                bail!("docker build of {tag} failed: {engine_said}\nbuild output:\n{output}");
            }
        }
    }
    let built = docker.inspect_image(tag).await.with_context(|| {
        format!("docker build of {tag} ended but the image is missing; build output:\n{output}")
    })?;
    if let Some(previous) = previous.filter(|p| built.id.as_ref() != Some(p)) {
        // The image this tag named before: removed when nothing names it any more, so a rebuild
        // of a changed binary leaves no dangling image behind. One another tag still names (a
        // running test's `:c-<id>` pin, see `cluster.rs`) stays: removing it by id would delete
        // it under that test, whose launches then find no image. A container using it keeps it
        // too (the engine refuses).
        let still_named = docker
            .inspect_image(&previous)
            .await
            .map(|i| {
                i.repo_tags
                    .is_some_and(|tags| tags.iter().any(|t| t != "<none>:<none>"))
            })
            .unwrap_or(true);
        if !still_named {
            let _ = docker
                .remove_image(
                    &previous,
                    None::<bollard::query_parameters::RemoveImageOptions>,
                    None,
                )
                .await;
        }
    }
    Ok(())
}

/// Builds `tag` as `from` plus `labels` (`key`, `value`): a distinct image
/// whose parent is `from`, so `from` cannot be removed from under it. The
/// same tag built again with other labels is another image (another id)
/// under the same name, as a rebuilt runner image is.
///
/// # Errors
///
/// When the engine refuses the build or the image is missing after it.
pub async fn derive_image(
    docker: &Docker,
    from: &str,
    tag: &str,
    labels: &[(&str, &str)],
) -> anyhow::Result<()> {
    let mut dockerfile = format!("FROM {from}\nLABEL sh.billet.test=derived\n");
    for (key, value) in labels {
        dockerfile.push_str(&format!("LABEL {key}=\"{value}\"\n"));
    }
    let mut context = tar::Builder::new(Vec::new());
    append(
        &mut context,
        Path::new("Dockerfile"),
        dockerfile.as_bytes(),
        0o644,
    )?;
    let context = context.into_inner()?;
    let options = BuildImageOptionsBuilder::default()
        .dockerfile("Dockerfile")
        .t(tag)
        .rm(true)
        .forcerm(true)
        .build();
    let mut build = docker.build_image(options, None, Some(bollard::body_full(context.into())));
    while let Some(item) = build.next().await {
        item.with_context(|| format!("build {tag} from {from}"))?;
    }
    docker
        .inspect_image(tag)
        .await
        .with_context(|| format!("{tag} was not built"))?;
    Ok(())
}

/// The build context of the stand-in runner's image, as an uncompressed tar.
fn standin_build_context(binary: &Path) -> anyhow::Result<Vec<u8>> {
    let binary_bytes =
        std::fs::read(binary).with_context(|| format!("cannot read {}", binary.display()))?;
    let libraries = shared_libraries(binary)?;

    let mut files: Vec<(PathBuf, Vec<u8>, u32)> =
        vec![(PathBuf::from(STANDIN_ENTRYPOINT), binary_bytes, 0o755)];
    for library in &libraries {
        // `read` follows symlinks: the real file is stored under the name the loader asks for.
        let bytes = std::fs::read(library)
            .with_context(|| format!("cannot read the shared library {}", library.display()))?;
        files.push((library.clone(), bytes, 0o755));
    }

    let library_dirs: BTreeSet<&Path> = libraries.iter().filter_map(|l| l.parent()).collect();
    let mut dockerfile = String::from("FROM scratch\n");
    if !library_dirs.is_empty() {
        // There is no /etc/ld.so.cache in the image; name the directories in case `ldd` found a
        // library through the host's cache rather than the loader's default directories.
        let dirs: Vec<String> = library_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        dockerfile.push_str(&format!("ENV LD_LIBRARY_PATH={}\n", dirs.join(":")));
    }
    // The runner version the stand-in plays, where a node reads an image's.
    dockerfile.push_str(&format!(
        "LABEL org.opencontainers.image.version={}\n",
        billet_controlplane_stub::plane::STANDIN_RUNNER_VERSION
    ));
    dockerfile.push_str(&format!(
        "COPY {ROOTFS}/ /\nENTRYPOINT [\"{STANDIN_ENTRYPOINT}\"]\n"
    ));

    let mut tar = tar::Builder::new(Vec::new());
    append(
        &mut tar,
        Path::new("Dockerfile"),
        dockerfile.as_bytes(),
        0o644,
    )?;
    let mut dirs_added = BTreeSet::new();
    for (path, bytes, mode) in &files {
        let relative = in_rootfs(path)?;
        for dir in relative.ancestors().skip(1) {
            if dir.as_os_str().is_empty() || !dirs_added.insert(dir.to_path_buf()) {
                continue;
            }
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(tar::EntryType::Directory);
            header.set_mode(0o755);
            header.set_size(0);
            header.set_mtime(0);
            tar.append_data(&mut header, dir, std::io::empty())
                .with_context(|| format!("cannot add {} to the build context", dir.display()))?;
        }
        append(&mut tar, &relative, bytes, *mode)?;
    }
    tar.into_inner()
        .context("cannot finish the build context archive")
}

/// `/lib64/x` becomes `rootfs/lib64/x`; a path that is not absolute and clean is refused.
fn in_rootfs(path: &Path) -> anyhow::Result<PathBuf> {
    let mut relative = PathBuf::from(ROOTFS);
    let mut components = path.components();
    ensure!(
        components.next() == Some(Component::RootDir),
        "{} is not an absolute path",
        path.display()
    );
    for component in components {
        match component {
            Component::Normal(part) => relative.push(part),
            _ => bail!("{} is not a clean absolute path", path.display()),
        }
    }
    Ok(relative)
}

fn append(
    tar: &mut tar::Builder<Vec<u8>>,
    path: &Path,
    bytes: &[u8],
    mode: u32,
) -> anyhow::Result<()> {
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(tar::EntryType::Regular);
    header.set_size(bytes.len() as u64);
    header.set_mode(mode);
    header.set_mtime(0);
    tar.append_data(&mut header, path, bytes)
        .with_context(|| format!("cannot add {} to the build context", path.display()))
}

/// The absolute paths of the shared libraries `ldd` lists for `binary`, the dynamic loader
/// included and the vDSO left out; empty for a static binary.
fn shared_libraries(binary: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let output = Command::new("ldd")
        .arg(binary)
        .output()
        .context("cannot run ldd, which lists the shared libraries to put in the image")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        if stdout.contains("not a dynamic executable")
            || stderr.contains("not a dynamic executable")
        {
            return Ok(Vec::new());
        }
        bail!("ldd {} failed: {stderr}{stdout}", binary.display());
    }
    parse_ldd(&stdout)
}

/// Parses `ldd` output: `name => /path (0x...)`, `/path (0x...)`, or a vDSO without a path.
fn parse_ldd(stdout: &str) -> anyhow::Result<Vec<PathBuf>> {
    let mut libraries = Vec::new();
    for line in stdout.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.contains("statically linked") {
            continue;
        }
        let target = match line.split_once("=>") {
            Some((name, target)) => {
                let target = target.trim();
                ensure!(
                    !target.starts_with("not found"),
                    "the shared library {} is not found (ldd: {line})",
                    name.trim()
                );
                target
            }
            None => line,
        };
        let path = target.split(" (").next().unwrap_or(target).trim();
        if path.starts_with('/') {
            libraries.push(PathBuf::from(path));
        }
    }
    Ok(libraries)
}

/// The cargo target directory of the running test or binary: the nearest ancestor of its
/// profile directory holding cargo's `CACHEDIR.TAG`, else the profile directory's parent.
///
/// # Panics
///
/// If the path of the current executable is unknown.
pub fn workspace_target_dir() -> PathBuf {
    let profile = profile_dir();
    profile
        .ancestors()
        .skip(1)
        .find(|dir| dir.join("CACHEDIR.TAG").is_file())
        .or_else(|| profile.parent())
        .map_or_else(|| profile.clone(), Path::to_path_buf)
}

/// The profile directory (`target/debug`, `target/release`, ...) the current executable was built
/// into: its directory, or the parent of that when it is `deps` or `examples`.
///
/// # Panics
///
/// If the path of the current executable is unknown.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the path of the current executable");
    let dir = exe.parent().expect("an executable lives in a directory");
    match dir.file_name().and_then(|n| n.to_str()) {
        Some("deps" | "examples") => dir.parent().unwrap_or(dir).to_path_buf(),
        _ => dir.to_path_buf(),
    }
}

/// The path of the workspace binary `name` in the current profile directory, such as
/// `target/debug/billet-standin-runner`.
///
/// # Errors
///
/// The binary is missing; the message says to build the workspace first, because
/// `cargo test -p billet-tests` builds no other package's binaries.
pub fn binary_path(name: &str) -> anyhow::Result<PathBuf> {
    let path = profile_dir().join(name);
    ensure!(
        path.is_file(),
        "{} is missing: run `cargo build --workspace` first (cargo test -p billet-tests does not \
         build the binaries of other packages, and a stale binary is used as it is)",
        path.display()
    );
    Ok(path)
}

/// The binaries the end-to-end tests and the demo start.
pub const PROCESS_BINARIES: [(&str, &str); 3] = [
    ("billet-agent", "billet"),
    ("billet-controlplane-stub", "billet-standin-runner"),
    // The plane as a process (`planes.rs`).
    ("billet-controlplane-stub", "billet-plane"),
];

/// Builds [`PROCESS_BINARIES`] with cargo, in the profile the current
/// executable was built with, so a test or the demo never runs a missing or
/// stale `billet`. `cargo test` does not build other packages' binaries as
/// binaries, so without this a fresh clone would fail and an old checkout
/// would test old code. Cargo decides what is stale; an up-to-date build
/// costs a fraction of a second.
///
/// # Errors
///
/// When cargo cannot be run or the build fails; cargo's own output explains.
pub fn build_process_binaries() -> anyhow::Result<()> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let profile = match profile_dir().file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev".to_owned(),
        Some(other) => other.to_owned(),
    };
    let mut command = std::process::Command::new(cargo);
    command
        .arg("build")
        .arg("--quiet")
        .arg("--profile")
        .arg(&profile)
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    for (package, bin) in PROCESS_BINARIES {
        command.args(["-p", package, "--bin", bin]);
    }
    let status = command
        .status()
        .context("run cargo to build the billet binaries")?;
    ensure!(
        status.success(),
        "cargo build of the billet binaries failed ({status})"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_yields_the_libraries_and_the_loader_but_not_the_vdso() {
        let out = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                   \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f4c)\n\
                   \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f4c)\n\
                   \t/lib64/ld-linux-x86-64.so.2 (0x00007f4c)\n";
        assert_eq!(
            parse_ldd(out).unwrap(),
            [
                "/lib/x86_64-linux-gnu/libgcc_s.so.1",
                "/lib/x86_64-linux-gnu/libc.so.6",
                "/lib64/ld-linux-x86-64.so.2"
            ]
            .map(PathBuf::from)
        );
    }

    #[test]
    fn a_library_ldd_cannot_find_is_an_error_naming_it() {
        let err = parse_ldd("\tlibmissing.so.3 => not found\n").unwrap_err();
        assert!(err.to_string().contains("libmissing.so.3"), "{err}");
    }

    #[test]
    fn the_build_context_holds_the_dockerfile_the_binary_and_its_loader() {
        // Any dynamically linked binary will do; the current test executable is one.
        let exe = std::env::current_exe().unwrap();
        let context = standin_build_context(&exe).unwrap();
        let mut archive = tar::Archive::new(context.as_slice());
        let names: Vec<String> = archive
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .collect();
        assert!(names.contains(&"Dockerfile".to_owned()), "{names:?}");
        assert!(
            names.contains(&"rootfs/billet-standin-runner".to_owned()),
            "{names:?}"
        );
        assert!(
            names
                .iter()
                .any(|n| n.starts_with("rootfs/") && n.contains("ld-linux")),
            "{names:?}"
        );
    }

    #[test]
    fn the_profile_dir_is_where_cargo_put_this_test() {
        let profile = profile_dir();
        assert!(profile.join("deps").is_dir(), "{}", profile.display());
        assert!(workspace_target_dir().join("CACHEDIR.TAG").is_file());
        let err = binary_path("no-such-billet-binary").unwrap_err();
        assert!(err.to_string().contains("cargo build --workspace"), "{err}");
    }
}
