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
    /// The relay of a link with delay and loss (`start_relayed`).
    relay: Option<Child>,
}

impl NetRedis {
    /// Behind a veth pair: a link as fast as the host's loopback.
    pub async fn start() -> NetRedis {
        NetRedis::start_with(None).await
    }

    /// Behind two TUN devices joined by `scripts/tunrelay.py`, which delays each packet by
    /// `delay_ms` (plus its own wake-ups, about 0.6 ms) and drops it with probability `loss`.
    pub async fn start_relayed(delay_ms: f64, loss: f64) -> NetRedis {
        NetRedis::start_with(Some((delay_ms, loss))).await
    }

    async fn start_with(relayed: Option<(f64, f64)>) -> NetRedis {
        let k = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let namespace = format!("sluice-{pid}-{k}");
        // Interface names are at most 15 bytes.
        let tag = (pid % 10_000) * 100 + k % 100;
        let (host_link, inner_link) = (format!("slh{tag}"), format!("sln{tag}"));
        let (a, b) = ((tag / 250) % 250 + 1, tag % 250);
        let (host_ip, ip) = (format!("10.{a}.{b}.1"), format!("10.{a}.{b}.2"));
        // A namespace left by a test that was killed goes first.
        for args in [["netns", "del", &namespace], ["link", "del", &host_link]] {
            let _ = Command::new("ip").args(args).stderr(Stdio::null()).status();
        }
        run(&["ip", "netns", "add", &namespace]);
        let relay = match relayed {
            None => {
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
                None
            }
            Some((delay_ms, loss)) => {
                run(&["ip", "tuntap", "add", "mode", "tun", "name", &host_link]);
                run(&["ip", "tuntap", "add", "mode", "tun", "name", &inner_link]);
                let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/tunrelay.py");
                let mut relay = Command::new("python3")
                    .arg(script)
                    .args([&host_link, &inner_link])
                    .arg(delay_ms.to_string())
                    .arg(loss.to_string())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::inherit())
                    .spawn()
                    .expect("start scripts/tunrelay.py (python3)");
                // Attached to both devices before one moves into the namespace.
                let mut ready = String::new();
                std::io::BufRead::read_line(
                    &mut std::io::BufReader::new(relay.stdout.take().expect("its stdout")),
                    &mut ready,
                )
                .expect("the relay's first line");
                assert_eq!(ready.trim(), "ready", "scripts/tunrelay.py did not start");
                Some(relay)
            }
        };
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
            relay,
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

    /// Makes the link half-open: Redis receives every packet, but what it sends is dropped
    /// (its calls run; their answers never arrive).
    pub fn drop_answers(&self) {
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
        for mut child in [self.child.take(), self.relay.take()].into_iter().flatten() {
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
