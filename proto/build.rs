//! Compiles `billet/node/v1/node.proto` in pure Rust (protox), so a fresh
//! machine needs no `protoc`, and writes its encoded descriptor set for
//! gRPC server reflection (`FILE_DESCRIPTOR_SET`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "billet/node/v1/node.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["."])?;
    let out = std::path::PathBuf::from(std::env::var_os("OUT_DIR").ok_or("OUT_DIR")?);
    std::fs::write(
        out.join("billet_node_v1_descriptor.bin"),
        prost::Message::encode_to_vec(&descriptors),
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // A credential: its Debug is written by hand, redacted (lib.rs).
        .skip_debug(["billet.node.v1.JitConfig"])
        .compile_fds(descriptors)?;
    Ok(())
}
