//! Compiles the KEDA external-scaler proto without a system `protoc` (protox).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/externalscaler.proto");
    let fds = protox::compile(["externalscaler.proto"], ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
