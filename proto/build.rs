//! Compiles `billet/node/v1/node.proto` in pure Rust (protox), so a fresh
//! machine needs no `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "billet/node/v1/node.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["."])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
