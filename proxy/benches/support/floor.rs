//! The floors the proxy is measured against in the same run: a bare pass-through proxy made
//! of the same hyper server and hyper-util client, and nginx `proxy_pass`.

use std::path::Path;
use std::process::{Child, Command, Stdio};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// A process measured beside the proxy, killed when dropped.
pub struct Floor {
    pub name: &'static str,
    pub child: Child,
    pub base: String,
}

impl Drop for Floor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The environment variable that makes the bench binary the bare pass-through proxy:
/// `port upstream_base_url`.
pub const BARE_ENV: &str = "LLM_RETRY_PROXY_BENCH_BARE";

/// The bench binary again, as the bare pass-through proxy on `port` in front of `upstream`:
/// its own process, so its CPU time and peak RSS are its own.
pub fn start_bare(port: u16, upstream: &str) -> Floor {
    let child = Command::new(std::env::current_exe().expect("the bench binary"))
        .env(BARE_ENV, format!("{port} {upstream}"))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the bare proxy");
    Floor {
        name: "bare",
        child,
        base: format!("http://127.0.0.1:{port}"),
    }
}

/// Serves as the bare pass-through proxy when [`BARE_ENV`] is set: hyper's server (auto,
/// as the proxy's) and hyper-util's client, threaded as the proxy is (a worker thread per
/// core, each a current-thread runtime with its own upstream pool, a connection's socket
/// handed to its worker's reactor), with no layer, no tenant, no metric and no log. Never
/// returns then.
pub fn bare_if_asked() {
    let Ok(spec) = std::env::var(BARE_ENV) else {
        return;
    };
    let (port, upstream) = spec.split_once(' ').expect("port and upstream");
    let port: u16 = port.parse().expect("a port");
    let upstream: http::Uri = upstream.parse().expect("an upstream URL");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let workers = tower_llm_retry_proxy::Workers::start(0).expect("workers");
    rt.block_on(bare(port, upstream, &workers));
    std::process::exit(0);
}

thread_local! {
    /// Each worker's own upstream pool, as the proxy's.
    static CLIENT: Client<HttpConnector, Incoming> = {
        let mut tcp = HttpConnector::new();
        tcp.set_nodelay(true);
        Client::builder(TokioExecutor::new()).build(tcp)
    };
}

async fn bare(port: u16, upstream: http::Uri, workers: &tower_llm_retry_proxy::Workers) {
    use hyper_util::rt::TokioIo;
    use hyper_util::server::conn::auto;

    let authority = upstream.authority().expect("an authority").clone();
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("bind the bare proxy");
    let mut conns = tokio::task::JoinSet::new();
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let Ok(tcp) = tcp.into_std() else {
            continue;
        };
        let authority = authority.clone();
        let svc = hyper::service::service_fn(move |mut req: http::Request<Incoming>| {
            let mut parts = req.uri().clone().into_parts();
            parts.scheme = Some(http::uri::Scheme::HTTP);
            parts.authority = Some(authority.clone());
            *req.uri_mut() = http::Uri::from_parts(parts).expect("a URI");
            let sent = CLIENT.with(|client| client.request(req));
            async move {
                match sent.await {
                    Ok(res) => Ok::<_, std::convert::Infallible>(res.map(|b| {
                        use http_body_util::BodyExt;
                        b.map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
                            .boxed()
                    })),
                    Err(e) => {
                        use http_body_util::BodyExt;
                        let mut res = http::Response::new(
                            Full::new(Bytes::from(e.to_string()))
                                .map_err(|never| match never {})
                                .boxed(),
                        );
                        *res.status_mut() = http::StatusCode::BAD_GATEWAY;
                        Ok(res)
                    }
                }
            }
        });
        workers.spawn(&mut conns, async move {
            let Ok(tcp) = tokio::net::TcpStream::from_std(tcp) else {
                return;
            };
            let _ = auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(tcp), svc)
                .await;
        });
        while conns.try_join_next().is_some() {}
    }
}

/// nginx `proxy_pass` in front of `upstream` (`host:port`), one worker, upstream keep-alive,
/// no buffering (as a gateway of event streams is set up), no access log; `None`, with a
/// notice, when `nginx` is not on `PATH`.
pub fn start_nginx(port: u16, upstream: &str, dir: &Path) -> Option<Floor> {
    if Command::new("nginx")
        .arg("-v")
        .stderr(Stdio::null())
        .status()
        .is_err()
    {
        println!("NOTICE: nginx is not on PATH: the nginx proxy_pass floor is skipped");
        return None;
    }
    let dir = dir.join("nginx");
    std::fs::create_dir_all(dir.join("tmp")).expect("nginx dir");
    let d = dir.display();
    let conf = format!(
        "worker_processes 1;\nmaster_process off;\ndaemon off;\npid {d}/nginx.pid;\n\
         error_log {d}/error.log warn;\nevents {{ worker_connections 16384; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {d}/tmp;\n  proxy_temp_path {d}/tmp;\n\
         fastcgi_temp_path {d}/tmp;\n  uwsgi_temp_path {d}/tmp;\n  scgi_temp_path {d}/tmp;\n\
         keepalive_requests 1000000;\n\
         upstream up {{ server {upstream}; keepalive 256; keepalive_requests 1000000; }}\n\
         server {{\n    listen 127.0.0.1:{port} reuseport;\n    location / {{\n\
         proxy_pass http://up;\n      proxy_http_version 1.1;\n\
         proxy_set_header Connection \"\";\n      proxy_buffering off;\n    }}\n  }}\n}}\n"
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, conf).expect("nginx.conf");
    let child = Command::new("nginx")
        .arg("-e")
        .arg(dir.join("error.log"))
        .arg("-p")
        .arg(&dir)
        .arg("-c")
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .ok()?;
    Some(Floor {
        name: "nginx",
        child,
        base: format!("http://127.0.0.1:{port}"),
    })
}
