//! The `tether` executable, for a build from source with cargo (`cargo install --path
//! crates/tether-cli`); the Python package runs the same command line without it. Scripts
//! run with `$PYTHON_EXEC`, else `python3`.

fn main() {
    tether_core::logging::init_from_env();
    if let Some(warning) = tether_core::logging::invalid_env_warning() {
        eprintln!("tether: warning: {warning}");
    }
    let code = tether_cli::main(std::env::args_os().collect(), tether_cli::Host::default());
    std::process::exit(code);
}
