//! `billet-certs-dev`: writes a development CA, a plane certificate and node certificates.
//!
//! ```sh
//! billet-certs-dev --out certs-dev/out --plane plane --node node-a --node node-b
//! ```
//!
//! The node certificates can be made to be refused, beside a good CA and plane certificate:
//!
//! ```sh
//! billet-certs-dev --out bad --ca-dir certs-dev/out --node node-a --expired
//! billet-certs-dev --out bad --node node-a --other-ca        # signed by bad/other-ca.pem
//! billet-certs-dev --out short --node node-a --lifetime-secs 30
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

use billet_certs_dev::{DevCerts, NodeOptions, Options, Validity};

/// Writes a development CA (`ca.pem`, `ca.key`), a plane certificate (`plane.pem`, `plane.key`)
/// and one certificate per node (`node-<name>.pem`, `node-<name>.key`) for billet's mTLS.
/// Keys are written mode 0600. For development and tests only.
///
/// `--expired`, `--not-yet-valid`, `--lifetime-secs` and `--other-ca` make the node
/// certificates the negative cases tests and operators use; the CA and the plane certificate
/// stay good.
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
    /// Make the node certificates expired: valid from 30 days ago until 1 day ago.
    #[arg(long, group = "node_validity")]
    expired: bool,
    /// Make the node certificates not yet valid: valid from 1 day from now for 30 days.
    #[arg(long, group = "node_validity")]
    not_yet_valid: bool,
    /// Make the node certificates short-lived: valid from now for N seconds (1 to 3153600000,
    /// 100 years), to watch one expire.
    #[arg(
        long,
        value_name = "N",
        group = "node_validity",
        value_parser = clap::value_parser!(u64).range(1..=billet_certs_dev::MAX_LIFETIME.as_secs())
    )]
    lifetime_secs: Option<u64>,
    /// Sign the node certificates with a second CA made now and written beside the others as
    /// other-ca.pem and other-ca.key, so the deployment's CA refuses them. It has the same common
    /// name as the deployment's CA and its own key.
    #[arg(long)]
    other_ca: bool,
}

impl Cli {
    /// The library's options for this command line.
    ///
    /// # Errors
    ///
    /// A lifetime [`Validity::lasting`] refuses (clap has checked its range already).
    fn options(&self) -> anyhow::Result<(Options, NodeOptions)> {
        let node_validity = if self.expired {
            Some(Validity::expired())
        } else if self.not_yet_valid {
            Some(Validity::not_yet_valid())
        } else {
            self.lifetime_secs
                .map(|secs| Validity::lasting(Duration::from_secs(secs)))
                .transpose()?
        };
        let options = Options {
            ca_dir: self.ca_dir.clone(),
            ..Options::default()
        };
        let nodes = NodeOptions {
            validity: node_validity,
            other_ca: self.other_ca,
            ..NodeOptions::default()
        };
        Ok((options, nodes))
    }

    /// Writes what the command line asks for.
    ///
    /// # Errors
    ///
    /// As [`billet_certs_dev::generate_with_nodes`].
    fn run(&self) -> anyhow::Result<DevCerts> {
        let (options, nodes) = self.options()?;
        let names: Vec<&str> = self.nodes.iter().map(String::as_str).collect();
        billet_certs_dev::generate_with_nodes(&self.out, &self.plane, &names, &options, &nodes)
    }

    /// How the node certificates differ from good ones, for the summary; `None` if they do not.
    fn node_variant(&self, certs: &DevCerts) -> Option<String> {
        let mut what = Vec::new();
        if self.expired {
            what.push("expired".to_owned());
        }
        if self.not_yet_valid {
            what.push("not yet valid".to_owned());
        }
        if let Some(secs) = self.lifetime_secs {
            what.push(format!("valid for {secs} s from now"));
        }
        if let Some(other) = &certs.other_ca {
            what.push(format!("signed by the other CA {}", other.cert.display()));
        }
        (!what.is_empty()).then(|| what.join(", "))
    }
}

fn dns_name(name: &str) -> Result<String, String> {
    billet_certs_dev::check_dns_name(name)
        .map(|()| name.to_owned())
        .map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.run() {
        Ok(certs) => {
            for file in certs.written_files() {
                println!("{}", file.display());
            }
            if !certs.ca_generated {
                println!("(signed with the existing CA {})", certs.ca.cert.display());
            }
            if let Some(variant) = cli.node_variant(&certs) {
                println!("(node certificates: {variant})");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("billet-certs-dev: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::SystemTime;

    use x509_parser::extensions::ParsedExtension;

    use super::*;

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> Self {
            static NEXT: AtomicU32 = AtomicU32::new(0);
            let path = std::env::temp_dir().join(format!(
                "billet-certs-dev-cli-test-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&path);
            Self(path)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Parses `billet-certs-dev --out <dir> <args>`.
    fn parse(dir: &TempDir, args: &[&str]) -> Result<Cli, clap::Error> {
        let out = dir.0.to_str().expect("a UTF-8 temp dir");
        Cli::try_parse_from(
            ["billet-certs-dev", "--out", out]
                .into_iter()
                .chain(args.iter().copied()),
        )
    }

    /// What the tests read back from a written certificate.
    struct Read {
        /// Validity window, Unix seconds.
        not_before: i64,
        not_after: i64,
        subject_key_id: Option<Vec<u8>>,
        authority_key_id: Option<Vec<u8>>,
    }

    fn read(path: &Path) -> Read {
        let pem = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let (_, pem) = x509_parser::pem::parse_x509_pem(&pem).unwrap();
        let cert = pem.parse_x509().unwrap();
        let mut read = Read {
            not_before: cert.validity().not_before.timestamp(),
            not_after: cert.validity().not_after.timestamp(),
            subject_key_id: None,
            authority_key_id: None,
        };
        for extension in cert.extensions() {
            match extension.parsed_extension() {
                ParsedExtension::SubjectKeyIdentifier(id) => {
                    read.subject_key_id = Some(id.0.to_vec());
                }
                ParsedExtension::AuthorityKeyIdentifier(aki) => {
                    read.authority_key_id = aki.key_identifier.as_ref().map(|id| id.0.to_vec());
                }
                _ => {}
            }
        }
        read
    }

    fn now_secs() -> i64 {
        let since = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap();
        i64::try_from(since.as_secs()).unwrap()
    }

    const DAY_SECS: i64 = 24 * 60 * 60;

    #[test]
    fn the_validity_flags_give_the_node_certificates_that_window_and_leave_the_plane_good() {
        type Check = fn(&Read, i64) -> bool;
        let cases: [(&[&str], Check); 3] = [
            (&["--expired"], |c, now| {
                c.not_before == now - 30 * DAY_SECS && c.not_after == now - DAY_SECS
            }),
            (&["--not-yet-valid"], |c, now| {
                c.not_before == now + DAY_SECS && c.not_after == now + 31 * DAY_SECS
            }),
            (&["--lifetime-secs", "45"], |c, now| {
                c.not_before == now && c.not_after == now + 45
            }),
        ];
        for (flags, node_window_is_right) in cases {
            let dir = TempDir::new();
            let mut args = vec!["--node", "node-a", "--node", "node-b"];
            args.extend(flags);
            let before = now_secs();
            let certs = parse(&dir, &args).unwrap().run().unwrap();
            let after = now_secs();
            assert!(certs.other_ca.is_none());
            for node in &certs.nodes {
                let read = read(&node.cert);
                // The window is computed from "now" once, within this second or the next.
                assert!(
                    (before..=after).any(|now| node_window_is_right(&read, now)),
                    "{flags:?}: {} has {}..{} (now {before})",
                    node.name,
                    read.not_before,
                    read.not_after
                );
            }
            let plane = read(&certs.plane.cert);
            assert!(
                plane.not_before <= before && after < plane.not_after,
                "{flags:?}: the plane's window {}..{} does not hold now",
                plane.not_before,
                plane.not_after
            );
        }
    }

    #[test]
    fn with_other_ca_the_nodes_are_signed_by_other_ca_pem_and_the_plane_by_ca_pem() {
        let dir = TempDir::new();
        let certs = parse(&dir, &["--node", "node-a", "--other-ca", "--expired"])
            .unwrap()
            .run()
            .unwrap();
        let other = certs.other_ca.clone().expect("an other CA");
        assert_eq!(other.cert, dir.0.join("other-ca.pem"));
        let ca_id = read(&certs.ca.cert)
            .subject_key_id
            .expect("the CA's key id");
        let other_id = read(&other.cert)
            .subject_key_id
            .expect("the other CA's key id");
        assert_ne!(ca_id, other_id);
        let node = read(&certs.nodes[0].cert);
        assert_eq!(node.authority_key_id.as_ref(), Some(&other_id));
        assert!(node.not_after < now_secs(), "--expired applies as well");
        assert_eq!(read(&certs.plane.cert).authority_key_id, Some(ca_id));
        let cli = parse(&dir, &["--other-ca"]).unwrap();
        assert_eq!(
            cli.node_variant(&certs).as_deref(),
            Some(format!("signed by the other CA {}", other.cert.display()).as_str())
        );
    }

    #[test]
    fn without_flags_the_node_certificates_are_made_as_the_planes() {
        let dir = TempDir::new();
        let cli = parse(&dir, &[]).unwrap();
        let (options, nodes) = cli.options().unwrap();
        assert_eq!(options.ca_dir, None);
        assert_eq!(nodes, NodeOptions::default());
        let certs = cli.run().unwrap();
        assert_eq!(cli.node_variant(&certs), None);
        assert!(!dir.0.join("other-ca.pem").exists());
    }

    #[test]
    fn conflicting_or_out_of_range_validity_flags_are_usage_errors() {
        let dir = TempDir::new();
        for args in [
            &["--expired", "--not-yet-valid"][..],
            &["--expired", "--lifetime-secs", "5"],
            &["--not-yet-valid", "--lifetime-secs", "5"],
            &["--lifetime-secs", "0"],
            &["--lifetime-secs", "3153600001"],
            &["--lifetime-secs", "soon"],
        ] {
            let err = parse(&dir, args)
                .err()
                .unwrap_or_else(|| panic!("{args:?} parsed"));
            assert_eq!(err.exit_code(), 2, "{args:?}: {err}");
        }
        parse(&dir, &["--lifetime-secs", "3153600000", "--other-ca"]).unwrap();
        assert!(!dir.0.exists(), "nothing is written by parsing");
    }
}
