#!/usr/bin/env python3
"""CPU per request of an RS256 route, with and without the verified-token cache.

Starts the release binary (one worker) with three direct-response routes: `/plain` (no
`jwt:`), `/nocache` (an RS256 verifier with `token_cache: 0`: every request verifies the
signature) and `/cached` (the same key, the default cache: the first request verifies, the
others hash the token and find it). Sends the same token N times per route over one
keep-alive connection, in turns, and reads sluice's utime+stime from /proc/PID/stat around
each turn. The client is this script (its CPU is not counted).

    python3 bench/jwt_cache.py target/release/sluice [requests per turn] [rounds]
"""

import base64
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = os.path.join(ROOT, "tests/it/support/jwt/rsa-1.key.pem")


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def token_and_jwks():
    with open(KEY, "rb") as f:
        key = serialization.load_pem_private_key(f.read(), password=None)
    numbers = key.public_key().public_numbers()
    as_bytes = lambda n: n.to_bytes((n.bit_length() + 7) // 8, "big")
    jwks = {"keys": [{"kty": "RSA", "kid": "k1", "alg": "RS256", "use": "sig",
                      "n": b64(as_bytes(numbers.n)), "e": b64(as_bytes(numbers.e))}]}
    header = b64(json.dumps({"alg": "RS256", "kid": "k1", "typ": "JWT"}).encode())
    claims = b64(json.dumps({"iss": "https://auth.example/", "aud": "api", "sub": "user-1234",
                             "plan": "paid", "exp": int(time.time()) + 3600}).encode())
    signed = f"{header}.{claims}".encode()
    sig = key.sign(signed, padding.PKCS1v15(), hashes.SHA256())
    return f"{header}.{claims}.{b64(sig)}", jwks


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    binary = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 20000
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    token, jwks = token_and_jwks()
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "jwks.json"), "w") as f:
            json.dump(jwks, f)
        port, admin = free_port(), free_port()
        verifier = """  - name: {name}
    issuer: "https://auth.example/"
    audiences: [api]
    jwks_file: jwks.json
{extra}"""
        verifiers = (verifier.format(name="nocache", extra="    token_cache: 0\n")
                     + verifier.format(name="cached", extra=""))
        config = f"""listen: 127.0.0.1:{port}
admin_listen: 127.0.0.1:{admin}
server: {{ workers: 1 }}
jwt:
{verifiers}routes:
  - name: plain
    match: {{ path_prefix: /plain }}
    respond: {{ status: 200, body: ok }}
  - name: nocache
    match: {{ path_prefix: /nocache }}
    respond: {{ status: 200, body: ok }}
    jwt: {{ verifier: nocache }}
  - name: cached
    match: {{ path_prefix: /cached }}
    respond: {{ status: 200, body: ok }}
    jwt: {{ verifier: cached }}
"""
        path = os.path.join(tmp, "sluice.yaml")
        with open(path, "w") as f:
            f.write(config)
        proc = subprocess.Popen([binary, "run", "--config", path],
                                env={**os.environ, "RUST_LOG": "warn"},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(100):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                    break
                except OSError:
                    time.sleep(0.1)
            results = {"plain": [], "nocache": [], "cached": []}
            headers = {"authorization": f"Bearer {token}"}
            for _ in range(rounds):
                for route in results:
                    conn = http.client.HTTPConnection("127.0.0.1", port)
                    for _ in range(200):  # warm-up (and the cached route's one verification)
                        conn.request("GET", f"/{route}", headers=headers)
                        r = conn.getresponse()
                        r.read()
                        assert r.status == 200, (route, r.status)
                    before = cpu_seconds(proc.pid)
                    for _ in range(n):
                        conn.request("GET", f"/{route}", headers=headers)
                        r = conn.getresponse()
                        r.read()
                    results[route].append((cpu_seconds(proc.pid) - before) / n * 1e6)
                    conn.close()
            for route, values in results.items():
                print(f"{route:8} µs of sluice CPU per request: "
                      + ", ".join(f"{v:.1f}" for v in values))
        finally:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
