//! `billet node --config FILE`: a TOML file whose keys are the node's flag
//! names in snake_case (`listen`, `cert`, `state_dir`, `max_custody_secs`,
//! ...). Its values become the flags' defaults, so a flag on the command line
//! beats its environment variable, which beats the file, which beats the
//! built-in default. Every key is checked with the flag's own parser before
//! anything runs, and an error names the file and the key. A relative path
//! in the file is taken relative to the file's own directory.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use clap::Command;
use thiserror::Error;

/// The flag and variable that name the file.
pub(crate) const FLAG: &str = "--config";
/// The environment variable that names the file.
pub(crate) const ENV: &str = "BILLET_CONFIG";

/// A configuration file that cannot be used.
#[derive(Debug, Error)]
#[error("configuration file {path}: {problem}")]
pub(crate) struct ConfigFileError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong, naming the key.
    pub problem: String,
}

/// The file named by `--config FILE`, `--config=FILE` or `BILLET_CONFIG`,
/// if any.
pub(crate) fn named(args: &[OsString], env: Option<OsString>) -> Option<PathBuf> {
    let mut iter = args.iter();
    while let Some(arg) = iter.next() {
        let text = arg.to_string_lossy();
        if text == FLAG {
            return iter.next().map(PathBuf::from);
        }
        if let Some(path) = text.strip_prefix("--config=") {
            return Some(PathBuf::from(path));
        }
    }
    env.map(PathBuf::from)
}

/// Reads `path` and makes its values the defaults of `subcommand`'s flags.
///
/// # Errors
///
/// [`ConfigFileError`] when the file cannot be read, is not TOML, names a key
/// that is not a flag, or holds a value the flag's parser refuses.
pub(crate) fn apply(
    command: Command,
    subcommand: &str,
    path: &Path,
) -> Result<Command, ConfigFileError> {
    let fail = |problem: String| ConfigFileError {
        path: path.to_owned(),
        problem,
    };
    let text = std::fs::read_to_string(path).map_err(|e| fail(format!("cannot read: {e}")))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e| fail(format!("not valid TOML: {e}")))?;
    let sub = command
        .find_subcommand(subcommand)
        .ok_or_else(|| fail(format!("no subcommand {subcommand}")))?
        .clone();
    let known: Vec<String> = sub
        .get_arguments()
        .filter(|a| a.get_long().is_some() && a.get_id() != "config")
        .map(|a| a.get_id().as_str().to_owned())
        .collect();
    let mut defaults = Vec::new();
    for (key, value) in &table {
        let Some(arg) = sub
            .get_arguments()
            .find(|a| a.get_id() == key.as_str() && known.contains(key))
        else {
            return Err(fail(format!(
                "unknown key `{key}`; the keys are the flag names in snake_case: {}",
                known.join(", ")
            )));
        };
        // A list is for a flag that may be repeated (`registry_mirror`).
        let values: Vec<String> = match value {
            toml::Value::String(s) => vec![s.clone()],
            toml::Value::Integer(i) => vec![i.to_string()],
            // Judged by the flag's parser, which says what it takes.
            toml::Value::Float(f) => vec![f.to_string()],
            toml::Value::Boolean(b) => vec![b.to_string()],
            toml::Value::Array(items) if matches!(arg.get_action(), clap::ArgAction::Append) => {
                items
                    .iter()
                    .map(|item| match item {
                        toml::Value::String(s) => Ok(s.clone()),
                        other => Err(fail(format!(
                            "key `{key}`: expected a list of strings, found a {} in it",
                            other.type_str()
                        ))),
                    })
                    .collect::<Result<_, _>>()?
            }
            other => {
                return Err(fail(format!(
                    "key `{key}`: expected a string, an integer or a boolean, found {}",
                    other.type_str()
                )));
            }
        };
        let long = arg.get_long().unwrap_or(key.as_str());
        let mut checked = Vec::new();
        for value in values {
            // The flag's own parser judges the value: a one-flag command parses it.
            Command::new("check")
                .no_binary_name(true)
                .arg(arg.clone().required(false))
                // `--flag=value`: a value that starts with `-` (`-5`) is the
                // flag's, not another flag.
                .try_get_matches_from([format!("--{long}={value}")])
                .map_err(|e| {
                    let why = e.to_string();
                    let why = why
                        .lines()
                        .next()
                        .unwrap_or("")
                        .trim_start_matches("error: ")
                        .to_owned();
                    fail(format!("key `{key}`: {why}"))
                })?;
            // A relative path means the file's directory, not the working
            // directory (which is `/` under systemd).
            let value = if arg.get_value_parser().type_id() == std::any::TypeId::of::<PathBuf>()
                && Path::new(&value).is_relative()
            {
                std::path::absolute(path)
                    .ok()
                    .and_then(|p| p.parent().map(|d| d.join(&value)))
                    .map_or(value, |p| p.display().to_string())
            } else {
                value
            };
            checked.push(value);
        }
        defaults.push((arg.get_id().clone(), checked));
    }
    Ok(command.mut_subcommand(subcommand, |mut sub| {
        for (id, values) in defaults {
            let values: Vec<&'static str> = values
                .into_iter()
                .map(|v| &*Box::leak(v.into_boxed_str()))
                .collect();
            sub = sub.mut_arg(id, |a| a.default_values(values).required(false));
        }
        sub
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Arg;

    fn cli() -> Command {
        Command::new("billet").subcommand(
            Command::new("node")
                .arg(
                    Arg::new("listen")
                        .long("listen")
                        .required(true)
                        .value_parser(clap::value_parser!(std::net::SocketAddr)),
                )
                .arg(
                    Arg::new("vcpu")
                        .long("vcpu")
                        .value_parser(clap::value_parser!(u32)),
                )
                .arg(
                    Arg::new("cert")
                        .long("cert")
                        .value_parser(clap::value_parser!(PathBuf)),
                )
                .arg(
                    Arg::new("registry_mirror")
                        .long("registry-mirror")
                        .action(clap::ArgAction::Append)
                        .value_parser(crate::provider::mirrors::parse_mirror),
                )
                .arg(Arg::new("config").long("config")),
        )
    }

    #[test]
    fn a_list_fills_a_repeatable_flag_each_item_checked_and_only_there() {
        let p = file("registry_mirror = [\"https://a.example\", \"http://b.example:5000\"]\n");
        let m = apply(cli(), "node", &p)
            .unwrap()
            .try_get_matches_from(["billet", "node", "--listen", "127.0.0.1:1"])
            .unwrap();
        let (_, m) = m.subcommand().unwrap();
        let got: Vec<&String> = m.get_many::<String>("registry_mirror").unwrap().collect();
        assert_eq!(got, ["https://a.example", "http://b.example:5000"]);
        let bad = file("registry_mirror = [\"https://a.example\", \"mirror.example\"]\n");
        let e = apply(cli(), "node", &bad).unwrap_err().to_string();
        assert!(
            e.contains("key `registry_mirror`") && e.contains("is not a URL"),
            "{e}"
        );
        let not_a_list_key = file("vcpu = [1, 2]\n");
        let e = apply(cli(), "node", &not_a_list_key)
            .unwrap_err()
            .to_string();
        assert!(e.contains("key `vcpu`") && e.contains("found array"), "{e}");
    }

    fn file(text: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!(
            "billet-config-{}.toml",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn file_values_fill_in_and_flags_win() {
        let p = file("listen = \"127.0.0.1:7443\"\nvcpu = 4\n");
        let m = apply(cli(), "node", &p)
            .unwrap()
            .try_get_matches_from(["billet", "node", "--vcpu", "2"])
            .unwrap();
        let (_, m) = m.subcommand().unwrap();
        assert_eq!(m.get_one::<u32>("vcpu"), Some(&2));
        assert_eq!(
            m.get_one::<std::net::SocketAddr>("listen").unwrap().port(),
            7443
        );
    }

    #[test]
    fn a_relative_path_in_the_file_resolves_against_the_files_directory() {
        let p = file("cert = \"certs/node.pem\"\nlisten = \"127.0.0.1:1\"\n");
        let m = apply(cli(), "node", &p)
            .unwrap()
            .try_get_matches_from(["billet", "node"])
            .unwrap();
        let (_, m) = m.subcommand().unwrap();
        assert_eq!(
            m.get_one::<PathBuf>("cert"),
            Some(&p.parent().unwrap().join("certs/node.pem"))
        );
        // On the command line a relative path stays the working directory's.
        let m = apply(cli(), "node", &p)
            .unwrap()
            .try_get_matches_from(["billet", "node", "--cert", "here.pem"])
            .unwrap();
        let (_, m) = m.subcommand().unwrap();
        assert_eq!(
            m.get_one::<PathBuf>("cert"),
            Some(&PathBuf::from("here.pem"))
        );
    }

    #[test]
    fn a_bad_value_names_the_file_and_the_key() {
        let p = file("vcpu = \"many\"\n");
        let e = apply(cli(), "node", &p).unwrap_err().to_string();
        assert!(
            e.contains(&p.display().to_string()) && e.contains("`vcpu`"),
            "{e}"
        );
    }

    #[test]
    fn an_unknown_key_names_the_file_the_key_and_the_known_ones() {
        let p = file("vcpus = 3\n");
        let e = apply(cli(), "node", &p).unwrap_err().to_string();
        assert!(e.contains("`vcpus`") && e.contains("listen"), "{e}");
    }

    #[test]
    fn the_file_is_found_from_the_flag_or_the_environment() {
        let args: Vec<OsString> = ["billet", "node", "--config", "/a.toml"]
            .iter()
            .map(Into::into)
            .collect();
        assert_eq!(named(&args, None), Some(PathBuf::from("/a.toml")));
        let args: Vec<OsString> = ["billet", "node", "--config=/b.toml"]
            .iter()
            .map(Into::into)
            .collect();
        assert_eq!(
            named(&args, Some("/c.toml".into())),
            Some(PathBuf::from("/b.toml"))
        );
        let args: Vec<OsString> = ["billet", "node"].iter().map(Into::into).collect();
        assert_eq!(
            named(&args, Some("/c.toml".into())),
            Some(PathBuf::from("/c.toml"))
        );
    }
}
