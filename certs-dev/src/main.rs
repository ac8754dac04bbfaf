//! `billet-certs-dev`: writes a development CA, a plane certificate and node certificates.
//!
//! ```sh
//! billet-certs-dev --out certs-dev/out --plane plane --node node-a --node node-b
//! ```

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

/// Writes a development CA (`ca.pem`, `ca.key`), a plane certificate (`plane.pem`, `plane.key`)
/// and one certificate per node (`node-<name>.pem`, `node-<name>.key`) for billet's mTLS.
/// Keys are written mode 0600. For development and tests only.
#[derive(Debug, Parser)]
#[command(version)]
struct Cli {
    /// Directory to write into (created mode 0700 if missing); files of the same names are replaced.
    #[arg(long, default_value = "certs-dev/out")]
    out: PathBuf,
    /// DNS name of the plane, put in its certificate's SAN.
    #[arg(long, default_value = "plane", value_parser = dns_name)]
    plane: String,
    /// DNS name of a node, put in its certificate's SAN; repeat for more nodes.
    #[arg(long = "node", default_values_t = [String::from("node-1")], value_parser = dns_name)]
    nodes: Vec<String>,
    /// Sign with the CA already in this directory (ca.pem, ca.key) instead of making a new one;
    /// to add a node to an existing deployment, pass the output directory.
    #[arg(long)]
    ca_dir: Option<PathBuf>,
}

fn dns_name(name: &str) -> Result<String, String> {
    billet_certs_dev::check_dns_name(name)
        .map(|()| name.to_owned())
        .map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let nodes: Vec<&str> = cli.nodes.iter().map(String::as_str).collect();
    let options = billet_certs_dev::Options {
        ca_dir: cli.ca_dir,
        ..Default::default()
    };
    match billet_certs_dev::generate_with(&cli.out, &cli.plane, &nodes, &options) {
        Ok(certs) => {
            for file in certs.written_files() {
                println!("{}", file.display());
            }
            if !certs.ca_generated {
                println!("(signed with the existing CA {})", certs.ca.cert.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("billet-certs-dev: {e:#}");
            ExitCode::FAILURE
        }
    }
}
