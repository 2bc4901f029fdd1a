//! A real `redis-server` across a real network link: in its own network namespace, reached
//! from the host through a veth pair, with `iptables` inside the namespace to cut the link
//! silently (every packet dropped both ways, no RST, no FIN: a security group changed, a host
//! gone) and to heal it. Needs root, `ip` (iproute2) and `iptables`, which `scripts/test.sh`
//! installs; a test that cannot make the namespace fails, it does not pass quietly.

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use super::redis_server::redis_server_path;

/// Numbers the namespaces of one test process, so tests running at once never share one.
static NEXT: AtomicU32 = AtomicU32::new(0);

fn run(args: &[&str]) {
    let status = Command::new(args[0])
        .args(&args[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {args:?}: {e} (this test needs iproute2 and iptables, installed by scripts/test.sh, and root)"));
    assert!(
        status.status.success(),
        "{args:?} failed: {} (this test needs root, iproute2 and iptables)",
        String::from_utf8_lossy(&status.stderr)
    );
}

/// Redis at `10.N.M.2:6379` in namespace `sluice-PID-K`, the host at `10.N.M.1`.
pub struct NetRedis {
    namespace: String,
    host_link: String,
    pub ip: String,
    child: Option<Child>,
}

impl NetRedis {
    pub async fn start() -> NetRedis {
        let k = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let namespace = format!("sluice-{pid}-{k}");
        // Interface names are at most 15 bytes.
        let tag = (pid % 10_000) * 100 + k % 100;
        let (host_link, inner_link) = (format!("slh{tag}"), format!("sln{tag}"));
        let (a, b) = ((tag / 250) % 250 + 1, tag % 250);
        let (host_ip, ip) = (format!("10.{a}.{b}.1"), format!("10.{a}.{b}.2"));
        // A namespace left by a test that was killed goes first.
        let _ = Command::new("ip")
            .args(["netns", "del", &namespace])
            .status();
        run(&["ip", "netns", "add", &namespace]);
        run(&[
            "ip",
            "link",
            "add",
            &host_link,
            "type",
            "veth",
            "peer",
            "name",
            &inner_link,
        ]);
        run(&["ip", "link", "set", &inner_link, "netns", &namespace]);
        run(&[
            "ip",
            "addr",
            "add",
            &format!("{host_ip}/30"),
            "dev",
            &host_link,
        ]);
        run(&["ip", "link", "set", &host_link, "up"]);
        let exec = |args: &[&str]| {
            let mut all = vec!["ip", "netns", "exec", namespace.as_str()];
            all.extend_from_slice(args);
            run(&all);
        };
        exec(&["ip", "addr", "add", &format!("{ip}/30"), "dev", &inner_link]);
        exec(&["ip", "link", "set", &inner_link, "up"]);
        exec(&["ip", "link", "set", "lo", "up"]);
        let child = Command::new("ip")
            .args(["netns", "exec", &namespace])
            .arg(redis_server_path())
            .args(["--bind", &ip, "--port", "6379", "--protected-mode", "no"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server in the namespace");
        let redis = NetRedis {
            namespace,
            host_link,
            ip,
            child: Some(child),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect((redis.ip.as_str(), 6379))
            .await
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "redis-server in {} did not start",
                redis.namespace
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        redis
    }

    /// `redis://10.N.M.2:6379/0`
    pub fn url(&self) -> String {
        format!("redis://{}:6379/0", self.ip)
    }

    fn iptables(&self, args: &[&str]) {
        let mut all = vec!["ip", "netns", "exec", self.namespace.as_str(), "iptables"];
        all.extend_from_slice(args);
        run(&all);
    }

    /// Cuts the link silently: every packet into and out of the namespace is dropped.
    pub fn partition(&self) {
        self.iptables(&["-A", "INPUT", "-j", "DROP"]);
        self.iptables(&["-A", "OUTPUT", "-j", "DROP"]);
    }

    /// Lets packets through again.
    pub fn heal(&self) {
        self.iptables(&["-F", "INPUT"]);
        self.iptables(&["-F", "OUTPUT"]);
    }
}

impl Drop for NetRedis {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // The redis-server started by `ip netns exec` is its child's; kill what is left in
        // the namespace, then the namespace (its end of the veth pair goes with it).
        if let Ok(out) = Command::new("ip")
            .args(["netns", "pids", &self.namespace])
            .output()
        {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = Command::new("kill").args(["-9", pid]).status();
            }
        }
        let _ = Command::new("ip")
            .args(["netns", "del", &self.namespace])
            .status();
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_link])
            .status();
    }
}
