//! `billet-release`: writes a release directory the updater can install
//! from (`release.rs`): `<out>/<version>/billet`, a copy of a built `billet`
//! stamped with `<version>`, and `<out>/<version>/manifest.json`. Prints the
//! manifest's SHA-256, the digest a rollout pins in `StartUpgrade`.
//!
//! Serve `<out>` as the updater's `release_source`: as a directory on the
//! node, or over HTTPS.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

#[derive(Debug, Parser)]
#[command(name = "billet-release", about = "Write a billet release directory")]
struct Args {
    /// The built `billet` binary to release.
    #[arg(long)]
    binary: PathBuf,
    /// The exact release name to stamp into it, such as 1.4.2.
    #[arg(long)]
    version: String,
    /// The release source's root directory; the release goes in
    /// `<out>/<version>/`.
    #[arg(long)]
    out: PathBuf,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let binary = match std::fs::read(&args.binary) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("error: --binary {}: {e}", args.binary.display());
            return ExitCode::from(2);
        }
    };
    match billet_agent::upgrade::release::write(&args.out, &args.version, binary) {
        Ok(digest) => {
            println!("{digest}");
            eprintln!(
                "wrote {}; pin the manifest with --manifest-sha256 {digest}",
                args.out.join(&args.version).display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
