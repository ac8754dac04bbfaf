//! Records the commit the binary was built from as `BILLET_COMMIT`
//! (`billet --version`, `billet_build_info`): `git rev-parse` of the
//! checkout, `unknown` outside one. `BILLET_COMMIT` set in the build's
//! environment wins (a package built from a source tarball).

use std::path::Path;
use std::process::Command;

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .current_dir(dir)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .filter(|s| !s.is_empty())
}

fn main() {
    println!("cargo:rerun-if-env-changed=BILLET_COMMIT");
    let dir =
        std::path::PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let commit = std::env::var("BILLET_COMMIT").ok().or_else(|| {
        // Rebuild when HEAD moves: the HEAD file, the branch it names, and
        // packed refs, each only where it exists (cargo reruns a build
        // script on every build while a path it watches is missing: a
        // checkout without packed refs rebuilt the agent every time). A
        // branch packed later deletes its file, which is a change.
        for path in ["HEAD", "packed-refs"]
            .into_iter()
            .map(str::to_owned)
            .chain(git(&dir, &["symbolic-ref", "-q", "HEAD"]))
        {
            if let Some(p) = git(
                &dir,
                &["rev-parse", "--path-format=absolute", "--git-path", &path],
            ) && Path::new(&p).exists()
            {
                println!("cargo:rerun-if-changed={p}");
            }
        }
        git(&dir, &["rev-parse", "--short=12", "HEAD"])
    });
    println!(
        "cargo:rustc-env=BILLET_COMMIT={}",
        commit.unwrap_or_else(|| "unknown".to_owned())
    );
}
