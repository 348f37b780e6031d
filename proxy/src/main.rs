//! `llm-retry-proxy`: parses arguments, reads the configuration, starts serving.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use tower_llm_retry_proxy::config::LogFormat;
use tower_llm_retry_proxy::{demo, Config, Proxy, Workers};

/// The tower-llm-retry stack as an HTTP proxy: point an SDK's base URL at it.
#[derive(Debug, Parser)]
#[command(name = "llm-retry-proxy", version, about)]
struct Args {
    /// The TOML configuration file; without it, the defaults (and LLM_RETRY_PROXY_* overrides).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Validate the configuration, print it resolved with secrets masked, and exit.
    #[arg(long)]
    check_config: bool,
    /// Start in front of the crate's fault-injecting mock server, and print how to try it.
    #[arg(long)]
    demo: bool,
    /// Overrides `listen` (ip:port).
    #[arg(long, value_name = "ADDR")]
    listen: Option<std::net::SocketAddr>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let mut config = match Config::load(args.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("llm-retry-proxy: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(addr) = args.listen {
        config.listen = addr;
    }
    // Accepting, signals, and the state's own work (Redis, the demo's mock); the connections
    // are served on the workers `run` starts.
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("llm-retry-proxy: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    if args.check_config {
        // Every check the server makes at start, not only the file's: the key sources, the
        // CA file, the client token's variable. Nothing listens or connects.
        let built = {
            let _rt = rt.enter();
            Proxy::new(config.clone())
        };
        if let Err(e) = built {
            eprintln!("llm-retry-proxy: {e}");
            return ExitCode::from(2);
        }
        print!("{}", config.masked());
        return ExitCode::SUCCESS;
    }
    init_logs(config.log_format);
    match rt.block_on(run(config, args.demo)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("llm-retry-proxy: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(mut config: Config, demo: bool) -> Result<(), Box<dyn std::error::Error>> {
    let mock = if demo {
        let mock = demo::start_mock().await?;
        config = demo::config(&mock, config);
        Some(mock)
    } else {
        None
    };
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    let addr = listener.local_addr()?;
    // Each client and upstream connection is a descriptor: the soft limit (often 1,024) goes
    // up to the hard one before the connection cap is set from it.
    match tower_llm_retry_proxy::conn::raise_fd_limit() {
        Ok(l) => tracing::info!(
            soft_before = l.before,
            soft = l.soft,
            hard = l.hard,
            "file-descriptor limit"
        ),
        Err(e) => tracing::warn!(error = %e, "cannot raise the file-descriptor limit"),
    }
    let workers = Workers::start(config.worker_threads)
        .map_err(|e| format!("cannot start the worker threads: {e}"))?;
    tracing::info!(threads = workers.len(), "workers started");
    let proxy = Proxy::new(config)?;
    let shutdown = shutdown_signal()?;
    tracing::info!(%addr, "listening");
    if let Some(mock) = &mock {
        println!(
            "llm-retry-proxy (demo) on http://{addr}, in front of the mock at {}",
            mock.url("")
        );
        println!("mock: {}", mock.url("").trim_end_matches('/'));
        println!();
        println!("  curl -si http://{addr}/v1/messages -H 'content-type: application/json' \\");
        println!("    -H 'x-api-key: demo' -H 'anthropic-version: 2023-06-01' \\");
        println!("    -d '{{\"model\":\"claude-demo\",\"max_tokens\":64,\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}'");
        println!();
        println!("  export ANTHROPIC_BASE_URL=http://{addr}");
        println!("  export OPENAI_BASE_URL=http://{addr}/v1");
        println!();
        println!(
            "Every third request the mock sees is overloaded first: see x-llm-retry-attempts."
        );
    }
    proxy.serve_on(listener, shutdown, &workers).await?;
    Ok(())
}

/// Resolves on SIGTERM or ctrl-c. The handlers are installed here, at once, before anything
/// says the proxy is up: a signal sent right after must not find the default action.
fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        Ok(async move {
            tokio::select! {
                _ = term.recv() => {},
                _ = int.recv() => {},
            }
            tracing::info!("signal received");
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async {
            let _ = tokio::signal::ctrl_c().await;
        })
    }
}

fn init_logs(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("LLM_RETRY_PROXY_LOG")
        .unwrap_or_else(|_| EnvFilter::new("info,hyper=warn,h2=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
