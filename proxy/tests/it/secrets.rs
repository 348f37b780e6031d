//! No credential in logs, metrics, errors or the printed configuration.

use std::io::Write;
use std::sync::{Arc, Mutex};

use http::Request;
use http_body_util::{BodyExt, Full};
use tower_llm_retry::mock::{sse, Reply, Script};
use tower_llm_retry_proxy::config::Secret;

use crate::common::*;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn no_credential_is_ever_logged_even_at_trace() {
    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .finish();
    // One thread runs the client, the proxy and the mock: all of it is captured.
    let _guard = tracing::subscriber::set_default(subscriber);

    let keys = std::env::temp_dir().join(format!("llm-retry-proxy-secret-{}", std::process::id()));
    std::fs::write(&keys, "sk-HELD-SECRET-1\nsk-HELD-SECRET-2\n").unwrap();
    let k = keys.clone();
    let mut partial = sse::anthropic_message(&["x"]);
    partial.truncate(3);
    let script = Script::new()
        .then(Reply::unauthorized())
        .then(Reply::rate_limited("1"))
        .then(Reply::overloaded())
        .then(Reply::sse_then_reset(partial))
        .otherwise(Reply::success());
    let h = start_with(script, move |c| {
        c.client_token = Some(Secret::new("TOKEN-SECRET"));
        c.upstream[0].keys_file = Some(k);
    })
    .await;
    for token in ["TOKEN-SECRET", "TOKEN-SECRET", "WRONG-SECRET"] {
        let req = Request::post(h.url("/v1/messages"))
            .header("x-api-key", token)
            .body(Full::from(MESSAGES_STREAM))
            .unwrap();
        let res = h.send(req).await;
        let _ = res.into_body().collect().await;
    }
    // Pass-through keys on the OpenAI upstream, through a failing upstream too.
    let req = Request::post(h.url("/v1/chat/completions"))
        .header("authorization", "Bearer sk-PASS-SECRET")
        .body(Full::from(CHAT_STREAM))
        .unwrap();
    let _ = h.send(req).await.into_body().collect().await;

    let text = String::from_utf8(logs.0.lock().unwrap().clone()).unwrap();
    assert!(text.contains("request"), "nothing was captured");
    assert!(
        !text.contains("SECRET"),
        "a credential reached the logs:\n{text}"
    );
    assert!(!h.proxy.metrics().render().contains("SECRET"));
    let _ = std::fs::remove_file(&keys);
}

#[test]
fn check_config_prints_the_resolved_config_masked() {
    let dir = std::env::temp_dir().join(format!("llm-retry-proxy-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good.toml");
    std::fs::write(
        &good,
        "client_token = \"tok-SECRET\"\nredis_url = \"redis://:SECRET@127.0.0.1:6379/\"\n[[upstream]]\nname = \"anthropic\"\nkeys_env = \"SOME_KEYS\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_llm-retry-proxy"))
        .args(["--check-config", "--config"])
        .arg(&good)
        .env("LLM_RETRY_PROXY_UPSTREAM_ANTHROPIC_MAX_RETRIES", "4")
        .env("SOME_KEYS", "sk-held-SECRET")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("client_token = \"***\""), "{stdout}");
    assert!(stdout.contains("redis_url = \"***\""), "{stdout}");
    assert!(stdout.contains("max_retries = 4"), "{stdout}");
    assert!(stdout.contains("listen = \"127.0.0.1:8787\""), "{stdout}");
    assert!(!stdout.contains("SECRET"));

    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        "[[upstream]]\nname = \"a\"\nurl = \"http://x\"\nretries = 3\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_llm-retry-proxy"))
        .args(["--check-config", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("bad.toml") && stderr.contains("retries"),
        "{stderr}"
    );

    // What only the start of the server used to find, `--check-config` finds too: a key
    // variable that is not set, a CA file that is not there.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_llm-retry-proxy"))
        .args(["--check-config", "--config"])
        .arg(&good)
        .env_remove("SOME_KEYS")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("SOME_KEYS"), "{stderr}");
    let no_ca = dir.join("no_ca.toml");
    std::fs::write(
        &no_ca,
        "[[upstream]]\nname = \"a\"\nurl = \"https://x\"\nca_file = \"not-there.pem\"\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_llm-retry-proxy"))
        .args(["--check-config", "--config"])
        .arg(&no_ca)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("ca_file"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_password_in_an_upstream_url_is_masked_and_never_quoted() {
    let dir = std::env::temp_dir().join(format!("llm-retry-proxy-userinfo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("userinfo.toml");
    std::fs::write(
        &file,
        "[[upstream]]\nname = \"a\"\nurl = \"https://user:pw-SECRET@api.example.com/base\"\n\
         [[upstream]]\nname = \"b\"\nkind = \"openai\"\nurl = \"https://b.example.com\"\n",
    )
    .unwrap();
    let check = |envs: &[(&str, &str)]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_llm-retry-proxy"));
        cmd.args(["--check-config", "--config"]).arg(&file);
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // From the file, and from the environment: shown as `***@`.
    let (code, stdout, stderr) = check(&[]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stdout.contains("url = \"https://***@api.example.com/base\""),
        "{stdout}"
    );
    assert!(
        !stdout.contains("SECRET") && !stdout.contains("user:"),
        "{stdout}"
    );
    let (code, stdout, stderr) = check(&[(
        "LLM_RETRY_PROXY_UPSTREAM_B_URL",
        "https://env-user:env-pw-SECRET@env.example.com",
    )]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stdout.contains("url = \"https://***@env.example.com\""),
        "{stdout}"
    );
    assert!(!stdout.contains("SECRET"), "{stdout}");
    // An invalid URL from the environment, whatever is wrong with it: the error names the
    // upstream and the key, never the value.
    for bad in [
        "https://u:pw-SECRET@ho st/",
        "ftp://u:pw-SECRET@h.example.com",
        "u:pw-SECRET",
        "https://u:pw-SECRET@h.example.com/?q=1",
    ] {
        let (code, stdout, stderr) = check(&[("LLM_RETRY_PROXY_UPSTREAM_B_URL", bad)]);
        assert_eq!(code, Some(2), "{bad}: {stdout} {stderr}");
        assert!(
            stderr.contains("\"b\"") && stderr.contains("url"),
            "{stderr}"
        );
        assert!(
            !stderr.contains("SECRET") && !stderr.contains("pw-"),
            "{stderr}"
        );
    }
    // Any other variable's bad value is not quoted either.
    for (name, value) in [
        ("LLM_RETRY_PROXY_MAX_BODY_BYTES", "12-SECRET"),
        ("LLM_RETRY_PROXY_UPSTREAM_A_POLICY", "SECRET"),
        ("LLM_RETRY_PROXY_LISTEN", "SECRET:1"),
        ("LLM_RETRY_PROXY_NO_SUCH", "SECRET"),
    ] {
        let (code, _, stderr) = check(&[(name, value)]);
        assert_eq!(code, Some(2), "{name}: {stderr}");
        assert!(
            stderr.contains(name) && !stderr.contains("SECRET"),
            "{stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A client token of only whitespace is refused from every source: inline, the
/// `LLM_RETRY_PROXY_CLIENT_TOKEN` override, and the variable `client_token_env` names.
#[test]
fn a_blank_client_token_is_refused_from_every_source() {
    let dir =
        std::env::temp_dir().join(format!("llm-retry-proxy-blank-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let run = |toml: &str, envs: &[(&str, &str)]| {
        let file = dir.join("blank.toml");
        std::fs::write(&file, toml).unwrap();
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_llm-retry-proxy"));
        cmd.args(["--check-config", "--config"]).arg(&file);
        cmd.env("SOME_KEYS", "sk-held");
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let holds = "[[upstream]]\nname = \"a\"\nkeys_env = \"SOME_KEYS\"\n";
    for blank in [" ", "   ", "\t", " \t  "] {
        let inline = format!("client_token = {blank:?}\n{holds}");
        let (code, stderr) = run(&inline, &[]);
        assert_eq!(code, Some(2), "inline {blank:?}: {stderr}");
        let (code, stderr) = run(holds, &[("LLM_RETRY_PROXY_CLIENT_TOKEN", blank)]);
        assert_eq!(code, Some(2), "override {blank:?}: {stderr}");
        let named = format!("client_token_env = \"THE_TOKEN\"\n{holds}");
        let (code, stderr) = run(&named, &[("THE_TOKEN", blank)]);
        assert_eq!(code, Some(2), "client_token_env {blank:?}: {stderr}");
        assert!(
            stderr.contains("THE_TOKEN") && stderr.contains("whitespace"),
            "{stderr}"
        );
    }
    // A token with spaces around it is a token.
    let named = format!("client_token_env = \"THE_TOKEN\"\n{holds}");
    let (code, stderr) = run(&named, &[("THE_TOKEN", " tok ")]);
    assert_eq!(code, Some(0), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
