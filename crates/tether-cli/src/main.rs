//! The `tether` executable, for a build from source with cargo (`cargo install --path
//! crates/tether-cli`); the Python package runs the same command line without it. Scripts
//! run with `$PYTHON_EXEC`, else `python3`.

fn main() {
    tether_core::logging::init_from_env();
    let code = tether_cli::main(std::env::args_os().collect(), tether_cli::Host::default());
    std::process::exit(code);
}
