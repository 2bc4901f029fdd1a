//! Identities from verified JWTs, through the real sluice: tokens signed here with each key
//! type (RS256 from a JWK set and from a PEM file, ES256, EdDSA, HS256) are counted per
//! `sub`; a forged signature, an expired token, `alg: none`, a wrong audience or issuer get
//! 401 problem+json with `WWW-Authenticate`, counted by reason; `on_invalid: anonymous`
//! counts the address instead; a tier comes from a verified claim, not from a header the
//! client writes; a key rotated in the JWKS file takes effect without a restart.

use crate::support;

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ring::rand::SystemRandom;
use ring::signature::{self, EcdsaKeyPair, Ed25519KeyPair, KeyPair, RsaKeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::PrivatePkcs8KeyDer;
use serde_json::{json, Value};

use support::policy::{Jwt, Limit, Node, Policy, Route};
use support::{metric_sum, parse_metrics, replace_file, Redis, Sluice};

pub(crate) const ISSUER: &str = "https://auth.test/";
pub(crate) const AUDIENCE: &str = "api.test";

fn b64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().fold(0u32, |n, &b| (n << 8) | u32::from(b)) << (8 * (3 - chunk.len()));
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[(n >> (18 - 6 * i) & 63) as usize]));
        }
    }
    out
}

fn support_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/it/support/jwt")
        .join(name)
}

enum Material {
    Rsa(RsaKeyPair),
    Ec(EcdsaKeyPair),
    Ed(Ed25519KeyPair),
    Hmac(Vec<u8>),
}

/// A key that signs test tokens, and its public half as a JWK.
pub(crate) struct Signer {
    kid: String,
    alg: &'static str,
    material: Material,
}

impl Signer {
    pub(crate) fn rsa(kid: &str, n: u8) -> Signer {
        let pem = std::fs::read(support_file(&format!("rsa-{n}.key.pem"))).expect("test key");
        let der = PrivatePkcs8KeyDer::from_pem_slice(&pem).expect("PKCS#8");
        let key = RsaKeyPair::from_pkcs8(der.secret_pkcs8_der()).expect("RSA key");
        Signer {
            kid: kid.to_owned(),
            alg: "RS256",
            material: Material::Rsa(key),
        }
    }

    pub(crate) fn ec(kid: &str) -> Signer {
        let rng = SystemRandom::new();
        let alg = &signature::ECDSA_P256_SHA256_FIXED_SIGNING;
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(alg, &rng).expect("generate");
        let key = EcdsaKeyPair::from_pkcs8(alg, pkcs8.as_ref(), &rng).expect("EC key");
        Signer {
            kid: kid.to_owned(),
            alg: "ES256",
            material: Material::Ec(key),
        }
    }

    fn ed(kid: &str) -> Signer {
        let pkcs8 = Ed25519KeyPair::generate_pkcs8(&SystemRandom::new()).expect("generate");
        let key = Ed25519KeyPair::from_pkcs8(pkcs8.as_ref()).expect("Ed25519 key");
        Signer {
            kid: kid.to_owned(),
            alg: "EdDSA",
            material: Material::Ed(key),
        }
    }

    fn hmac(kid: &str, secret: &[u8]) -> Signer {
        Signer {
            kid: kid.to_owned(),
            alg: "HS256",
            material: Material::Hmac(secret.to_vec()),
        }
    }

    pub(crate) fn jwk(&self) -> Value {
        match &self.material {
            Material::Rsa(key) => {
                let parts: signature::RsaPublicKeyComponents<Vec<u8>> = key.public().into();
                json!({"kty": "RSA", "kid": self.kid, "alg": "RS256", "use": "sig",
                       "n": b64(&parts.n), "e": b64(&parts.e)})
            }
            Material::Ec(key) => {
                let point = key.public_key().as_ref();
                json!({"kty": "EC", "crv": "P-256", "kid": self.kid,
                       "x": b64(&point[1..33]), "y": b64(&point[33..65])})
            }
            Material::Ed(key) => json!({"kty": "OKP", "crv": "Ed25519", "kid": self.kid,
                                        "x": b64(key.public_key().as_ref())}),
            Material::Hmac(secret) => json!({"kty": "oct", "kid": self.kid, "k": b64(secret)}),
        }
    }

    /// A token of `claims` with this key's `kid` and algorithm.
    pub(crate) fn token(&self, claims: &Value) -> String {
        self.token_with(
            &json!({"alg": self.alg, "kid": self.kid, "typ": "JWT"}),
            claims,
        )
    }

    /// A token whose header is `header` (whatever it says), signed with this key.
    fn token_with(&self, header: &Value, claims: &Value) -> String {
        let signed = format!(
            "{}.{}",
            b64(header.to_string().as_bytes()),
            b64(claims.to_string().as_bytes())
        );
        let rng = SystemRandom::new();
        let sig = match &self.material {
            Material::Rsa(key) => {
                let mut sig = vec![0; key.public().modulus_len()];
                key.sign(
                    &signature::RSA_PKCS1_SHA256,
                    &rng,
                    signed.as_bytes(),
                    &mut sig,
                )
                .expect("sign");
                sig
            }
            Material::Ec(key) => key
                .sign(&rng, signed.as_bytes())
                .expect("sign")
                .as_ref()
                .to_vec(),
            Material::Ed(key) => key.sign(signed.as_bytes()).as_ref().to_vec(),
            Material::Hmac(secret) => {
                let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
                ring::hmac::sign(&key, signed.as_bytes()).as_ref().to_vec()
            }
        };
        format!("{signed}.{}", b64(&sig))
    }
}

pub(crate) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs()
}

/// Claims that pass every check, for `sub`.
pub(crate) fn claims(sub: Value) -> Value {
    json!({"iss": ISSUER, "aud": AUDIENCE, "sub": sub, "iat": now(), "exp": now() + 600})
}

pub(crate) fn with(mut claims: Value, name: &str, value: Value) -> Value {
    claims[name] = value;
    claims
}

const HS_SECRET: &[u8] = b"a test secret of more than 32 bytes, for HS256 only";

/// The key files of the verifier `auth`, written to a directory of their own.
struct Keys {
    dir: tempfile::TempDir,
    rsa: Signer,
    rsa_pem: Signer,
    ec: Signer,
    ed: Signer,
    hs: Signer,
}

impl Keys {
    fn new() -> Keys {
        let keys = Keys {
            dir: tempfile::tempdir().expect("tempdir"),
            rsa: Signer::rsa("rsa", 1),
            rsa_pem: Signer::rsa("rsa-pem", 2),
            ec: Signer::ec("ec"),
            ed: Signer::ed("ed"),
            hs: Signer::hmac("hs", HS_SECRET),
        };
        keys.write_jwks(&[&keys.rsa, &keys.ec, &keys.ed]);
        std::fs::write(keys.path("hs.secret"), [HS_SECRET, b"\n"].concat()).expect("write");
        std::fs::copy(support_file("rsa-2.pub.pem"), keys.path("rsa-pem.pub")).expect("copy");
        keys
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn write_jwks(&self, signers: &[&Signer]) {
        let set = json!({"keys": signers.iter().map(|s| s.jwk()).collect::<Vec<_>>()});
        replace_file(&self.path("jwks.json"), &set.to_string());
    }

    fn all(&self) -> [&Signer; 5] {
        [&self.rsa, &self.rsa_pem, &self.ec, &self.ed, &self.hs]
    }

    /// The `jwt:` section and routes: `/api` rejects invalid tokens, 2 per `sub` a minute;
    /// `/open` counts the address for them, 1 a minute; `/tiers` lets a verified `plan`
    /// claim choose the limit.
    fn policy(&self) -> Policy {
        self.policy_with(&Setup::good(self))
    }

    /// [`Keys::policy`] with the choices of `setup`, which `sluice check` may refuse.
    fn policy_with(&self, setup: &Setup) -> Policy {
        let key = |file: &Path, file_field: &str, algorithm: &str, kid: &str| {
            Node::map([
                (file_field, Node::from(file.display().to_string())),
                ("algorithm", algorithm.into()),
                ("kid", kid.into()),
            ])
        };
        let condition = |claim: &str, test: &str, value: Node| {
            Node::map([("jwt", Node::from(claim)), (test, value)])
        };
        let mut api = Route::new("api", "/api").respond(200, "ok");
        if setup.api_jwt {
            api = api.jwt(setup.api_verifier, false);
        }
        let mut tiers = Route::new("tiers", "/tiers").respond(200, "ok");
        if setup.tiers_jwt {
            tiers = tiers.jwt("auth", true);
        }
        Policy::new()
            .jwt(
                Jwt::new("auth", ISSUER, ["other.test", AUDIENCE])
                    .jwks_file(&setup.jwks)
                    .clock_skew("5s")
                    .key(key(&setup.secret, "secret_file", setup.hs_algorithm, "hs"))
                    .key(key(
                        &self.path("rsa-pem.pub"),
                        "pem_file",
                        setup.rs_algorithm,
                        setup.pem_kid,
                    )),
            )
            .route(api.limit(Limit::requests("per-user", 2, "1m").key(["jwt:sub"])))
            .route(
                Route::new("open", "/open")
                    .respond(200, "ok")
                    .jwt("auth", true)
                    .limit(Limit::requests("per-user", 1, "1m").key(["jwt:sub"])),
            )
            .route(
                tiers
                    .limit(
                        Limit::requests("paid", 4, "1m")
                            .key([setup.paid_key])
                            .when(vec![condition("plan", "equals", "paid".into())]),
                    )
                    .limit(
                        Limit::requests("free", 1, "1m")
                            .key(["jwt:sub"])
                            .when(vec![condition("plan", "one_of", ["free"].into())]),
                    )
                    .limit(Limit::requests("anonymous", 1, "1m").when(vec![condition(
                        "sub",
                        "present",
                        false.into(),
                    )])),
            )
    }
}

/// What [`Keys::policy_with`] varies: each field as the good policy has it, or one mistake.
#[derive(Clone)]
struct Setup {
    api_verifier: &'static str,
    /// Whether `/api` verifies tokens (its limit is keyed on `jwt:sub` either way).
    api_jwt: bool,
    /// Whether `/tiers` verifies tokens (its `paid` limit's `when` reads a claim either way).
    tiers_jwt: bool,
    paid_key: &'static str,
    jwks: PathBuf,
    secret: PathBuf,
    hs_algorithm: &'static str,
    rs_algorithm: &'static str,
    pem_kid: &'static str,
}

impl Setup {
    fn good(keys: &Keys) -> Setup {
        Setup {
            api_verifier: "auth",
            api_jwt: true,
            tiers_jwt: true,
            paid_key: "jwt:sub",
            jwks: keys.path("jwks.json"),
            secret: keys.path("hs.secret"),
            hs_algorithm: "HS256",
            rs_algorithm: "RS256",
            pem_kid: "rsa-pem",
        }
    }
}

async fn get(sluice: &Sluice, path: &str, token: Option<&str>) -> reqwest::Response {
    get_with(sluice, path, token, &[]).await
}

async fn get_with(
    sluice: &Sluice,
    path: &str,
    token: Option<&str>,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut request = support::client().get(format!("{}{path}", sluice.url()));
    if let Some(token) = token {
        request = request.header("authorization", format!("Bearer {token}"));
    }
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request.send().await.expect("an answer")
}

async fn status(sluice: &Sluice, path: &str, token: Option<&str>) -> u16 {
    get(sluice, path, token).await.status().as_u16()
}

/// Each key type's valid token is admitted, twice per `sub`, then limited; another `sub`
/// has its own bucket. On both stores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_valid_token_of_each_key_type_counts_per_sub_on_both_stores() {
    let redis = Redis::start().await;
    let keys = Keys::new();
    for policy in [keys.policy(), keys.policy().store_redis(&redis)] {
        let sluice = Sluice::start(&policy).await;
        for signer in keys.all() {
            let alice = signer.token(&claims(json!(format!("alice-{}", signer.kid))));
            let bob = signer.token(&claims(json!(format!("bob-{}", signer.kid))));
            for n in 1..=2 {
                assert_eq!(
                    status(&sluice, "/api/x", Some(&alice)).await,
                    200,
                    "{} #{n}",
                    signer.kid
                );
            }
            assert_eq!(
                status(&sluice, "/api/x", Some(&alice)).await,
                429,
                "{}: the third of one sub",
                signer.kid
            );
            assert_eq!(
                status(&sluice, "/api/x", Some(&bob)).await,
                200,
                "{}: another sub",
                signer.kid
            );
        }
        let metrics = parse_metrics(&sluice.metrics().await);
        assert_eq!(metric_sum(&metrics, "sluice_jwt_invalid_total", &[]), 0.0);
    }
}

/// Every kind of bad token gets 401 problem+json with `WWW-Authenticate`, counted by reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tokens_get_401_and_are_counted_by_reason() {
    let keys = Keys::new();
    let sluice = Sluice::start(&keys.policy()).await;
    let good = claims(json!("mallory"));
    let valid = keys.ec.token(&good);
    let (signed, _) = valid.rsplit_once('.').expect("three parts");
    let forged = format!("{signed}.{}", b64(&[7u8; 64]));
    let payload = b64(good.to_string().as_bytes());
    let none = format!("{}.{payload}.", b64(br#"{"alg":"none","kid":"ec"}"#));
    // HS256 "signed" with the RSA public key's bytes as the secret: the classic confusion.
    let public_pem = std::fs::read(support_file("rsa-2.pub.pem")).expect("pem");
    let confused = Signer::hmac("rsa-pem", &public_pem)
        .token_with(&json!({"alg": "HS256", "kid": "rsa-pem"}), &good);
    let cases: Vec<(&str, String)> = vec![
        ("missing", String::new()),
        ("malformed", "not.a-token".to_owned()),
        ("signature", forged),
        ("algorithm", none),
        ("algorithm", confused),
        (
            "expired",
            keys.ed.token(&with(good.clone(), "exp", json!(now() - 60))),
        ),
        (
            "malformed",
            keys.ed.token(&with(good.clone(), "exp", Value::Null)),
        ),
        (
            "not_yet_valid",
            keys.hs
                .token(&with(good.clone(), "nbf", json!(now() + 120))),
        ),
        (
            "audience",
            keys.rsa
                .token(&with(good.clone(), "aud", json!(["elsewhere.test"]))),
        ),
        (
            "issuer",
            keys.rsa
                .token(&with(good.clone(), "iss", json!("https://evil.test/"))),
        ),
        ("unknown_key", Signer::ec("nobody").token(&good)),
    ];
    for (reason, token) in &cases {
        let token = (!token.is_empty()).then_some(token.as_str());
        let response = get(&sluice, "/api/x", token).await;
        assert_eq!(response.status(), 401, "{reason}");
        let challenge = support::header(&response, "www-authenticate").to_owned();
        if *reason == "missing" {
            assert_eq!(
                challenge, "Bearer",
                "no error code without a token (RFC 6750 §3.1)"
            );
        } else {
            assert!(
                challenge.starts_with(r#"Bearer error="invalid_token""#),
                "{reason}: {challenge}"
            );
        }
        assert_eq!(
            support::header(&response, "content-type"),
            "application/problem+json"
        );
        let body: Value = response.json().await.expect("JSON");
        assert_eq!(body["status"], 401, "{body}");
        assert!(
            !body.to_string().contains("mallory"),
            "no claim of a bad token is echoed"
        );
    }
    let metrics = parse_metrics(&sluice.metrics().await);
    for (reason, _) in &cases {
        let want = cases.iter().filter(|(r, _)| r == reason).count() as f64;
        let got = metric_sum(
            &metrics,
            "sluice_jwt_invalid_total",
            &[("route", "api"), ("reason", reason)],
        );
        assert_eq!(got, want, "{reason}");
    }
    // The valid token still passes: nothing above was refused for a reason of its own.
    assert_eq!(status(&sluice, "/api/x", Some(&valid)).await, 200);
}

/// A number is read as its decimal text; an object is no value, so the key counts the
/// client address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_is_not_a_string() {
    let keys = Keys::new();
    let sluice = Sluice::start(&keys.policy()).await;
    let number = keys.ed.token(&claims(json!(42)));
    let text = keys.ed.token(&claims(json!("42")));
    assert_eq!(status(&sluice, "/api/n", Some(&number)).await, 200);
    assert_eq!(status(&sluice, "/api/n", Some(&text)).await, 200);
    assert_eq!(
        status(&sluice, "/api/n", Some(&number)).await,
        429,
        "42 and \"42\" are one sub"
    );
    let object_a = keys.ed.token(&claims(json!({"id": "a"})));
    let object_b = keys.ed.token(&claims(json!({"id": "b"})));
    let list = keys.ed.token(&claims(json!(["c"])));
    assert_eq!(status(&sluice, "/api/o", Some(&object_a)).await, 200);
    assert_eq!(status(&sluice, "/api/o", Some(&object_b)).await, 200);
    assert_eq!(
        status(&sluice, "/api/o", Some(&list)).await,
        429,
        "objects and arrays are no sub: all three count the one client address"
    );
}

/// A 16 KB token (a large claim set) is verified like any other; one past the 24 KiB cap
/// (still within the 32 KiB head) is refused as malformed before any crypto.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_16_kb_token_works_and_one_past_the_cap_is_malformed() {
    let keys = Keys::new();
    let sluice = Sluice::start(&keys.policy()).await;
    let big = keys.rsa.token(&with(
        claims(json!("big")),
        "groups",
        json!("g".repeat(12_000)),
    ));
    assert!((16_000..17_000).contains(&big.len()), "{}", big.len());
    assert_eq!(status(&sluice, "/api/big", Some(&big)).await, 200);
    let huge = keys.rsa.token(&with(
        claims(json!("huge")),
        "groups",
        json!("g".repeat(19_000)),
    ));
    assert!(
        huge.len() > 24 * 1024 && huge.len() < 28 * 1024,
        "{}",
        huge.len()
    );
    let response = get(&sluice, "/api/big", Some(&huge)).await;
    assert_eq!(response.status(), 401);
    let metrics = parse_metrics(&sluice.metrics().await);
    assert_eq!(
        metric_sum(
            &metrics,
            "sluice_jwt_invalid_total",
            &[("reason", "malformed")]
        ),
        1.0
    );
}

/// `on_invalid: anonymous`: without a valid token the `jwt:sub` key counts the address, so
/// a forged token shares the bucket of no token at all; a valid token has its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_invalid_anonymous_counts_the_address() {
    let keys = Keys::new();
    let sluice = Sluice::start(&keys.policy()).await;
    assert_eq!(status(&sluice, "/open", None).await, 200);
    assert_eq!(
        status(&sluice, "/open", None).await,
        429,
        "the address's one request"
    );
    let forged = format!("{}x", keys.hs.token(&claims(json!("eve"))));
    assert_eq!(
        status(&sluice, "/open", Some(&forged)).await,
        429,
        "a forged token is no way out"
    );
    let valid = keys.hs.token(&claims(json!("eve")));
    assert_eq!(status(&sluice, "/open", Some(&valid)).await, 200);
    let metrics = parse_metrics(&sluice.metrics().await);
    assert_eq!(
        metric_sum(
            &metrics,
            "sluice_jwt_invalid_total",
            &[("route", "open"), ("reason", "missing")]
        ),
        2.0
    );
}

/// The tier is a verified claim: a paid token gets the paid limit; a free token, or no token,
/// gets its own however the client writes a plan header. On both stores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_chosen_by_a_verified_claim_cannot_be_written_by_the_client() {
    let redis = Redis::start().await;
    let keys = Keys::new();
    for policy in [keys.policy(), keys.policy().store_redis(&redis)] {
        let sluice = Sluice::start(&policy).await;
        let paid = keys
            .rsa
            .token(&with(claims(json!("payer")), "plan", json!("paid")));
        let free = keys
            .rsa
            .token(&with(claims(json!("saver")), "plan", json!("free")));
        let claims_paid_unsigned = {
            let (_, payload) = (
                0,
                b64(with(claims(json!("saver")), "plan", json!("paid"))
                    .to_string()
                    .as_bytes()),
            );
            let mut parts: Vec<String> = free.split('.').map(str::to_owned).collect();
            parts[1] = payload;
            parts.join(".")
        };
        for n in 1..=4 {
            assert_eq!(
                status(&sluice, "/tiers", Some(&paid)).await,
                200,
                "paid #{n}"
            );
        }
        assert_eq!(status(&sluice, "/tiers", Some(&paid)).await, 429);
        let plan_header = [("x-plan", "paid")];
        let free_status = |token: Option<String>| {
            let sluice = &sluice;
            async move {
                get_with(sluice, "/tiers", token.as_deref(), &plan_header)
                    .await
                    .status()
                    .as_u16()
            }
        };
        assert_eq!(free_status(Some(free.clone())).await, 200);
        assert_eq!(
            free_status(Some(free.clone())).await,
            429,
            "a header does not make it paid"
        );
        assert_eq!(
            free_status(None).await,
            200,
            "the address's one anonymous request"
        );
        assert_eq!(
            free_status(Some(claims_paid_unsigned)).await,
            429,
            "an edited claim is no paid plan: its request is anonymous, and this address \
             already spent the anonymous one"
        );
    }
}

/// Editing the JWKS file alone reloads the policy: the old key is refused and the new one
/// admitted without a restart; a JWKS file that cannot be read keeps the last good keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_rotated_in_the_jwks_file_takes_effect_without_restart() {
    let keys = Keys::new();
    let sluice = Sluice::start(&keys.policy()).await;
    let old = keys.ec.token(&claims(json!("rotating-old")));
    assert_eq!(status(&sluice, "/api/r", Some(&old)).await, 200);
    let next = Signer::ec("ec-2");
    let new = next.token(&claims(json!("rotating-new")));
    assert_eq!(
        status(&sluice, "/api/r", Some(&new)).await,
        401,
        "not yet known"
    );
    keys.write_jwks(&[&keys.rsa, &next, &keys.ed]);
    support::wait_for(
        Duration::from_secs(15),
        "the new key to be in force",
        || async { status(&sluice, "/api/r", Some(&new)).await == 200 },
    )
    .await;
    assert_eq!(
        status(&sluice, "/api/r", Some(&old)).await,
        401,
        "the old key is gone"
    );

    replace_file(&keys.path("jwks.json"), "{ not json");
    support::wait_for(
        Duration::from_secs(15),
        "the bad JWKS file to be refused",
        || async {
            let metrics = parse_metrics(&sluice.metrics().await);
            metric_sum(
                &metrics,
                "sluice_config_reloads_total",
                &[("result", "error")],
            ) >= 1.0
        },
    )
    .await;
    assert_eq!(
        status(&sluice, "/api/r", Some(&new)).await,
        200,
        "the last good keys serve"
    );
    assert!(
        sluice.log().contains("jwks.json"),
        "the refusal names the file:\n{}",
        sluice.log()
    );
}

/// A rotation that reuses a kid: the JWK set then holds two keys of the kid `ec`, the new one
/// first. The set is refused whole, the error naming the kid and the file, counted as a
/// refused reload; the last good keys keep serving (the old `ec` key verifies, the new one
/// does not: with the first of two keys winning, the new one would).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jwk_set_with_two_keys_of_one_kid_is_refused_and_the_last_good_keys_serve() {
    let keys = Keys::new();
    let sluice = Sluice::start(&keys.policy()).await;
    let old = keys.ec.token(&claims(json!("kid-old")));
    assert_eq!(status(&sluice, "/api/k", Some(&old)).await, 200);
    let reused = Signer::ec("ec");
    let new = reused.token(&claims(json!("kid-new")));
    keys.write_jwks(&[&keys.rsa, &reused, &keys.ec, &keys.ed]);
    support::wait_for(
        Duration::from_secs(15),
        "the JWK set with a repeated kid to be refused",
        || async {
            let metrics = parse_metrics(&sluice.metrics().await);
            metric_sum(
                &metrics,
                "sluice_config_reloads_total",
                &[("result", "error")],
            ) >= 1.0
        },
    )
    .await;
    let metrics = parse_metrics(&sluice.metrics().await);
    assert_eq!(
        metric_sum(&metrics, "sluice_config_reloads_total", &[("result", "ok")]),
        0.0,
        "nothing was applied"
    );
    assert_eq!(
        status(&sluice, "/api/k", Some(&new)).await,
        401,
        "the new key of the reused kid is not in force"
    );
    assert_eq!(
        status(&sluice, "/api/k", Some(&old)).await,
        200,
        "the last good keys serve"
    );
    let log = sluice.log();
    assert!(
        log.contains("keys[1] and keys[2] both have the `kid` `ec`") && log.contains("jwks.json"),
        "the refusal names the kid and the file:\n{log}"
    );
}

/// `sluice check` names the file, the line and the field of each mistake.
#[test]
fn check_refuses_bad_verifiers_with_their_position() {
    let keys = Keys::new();
    let good = Setup::good(&keys);
    let listen = "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\n";
    std::fs::write(keys.path("short.secret"), "too short").expect("write");
    let twice = json!({"keys": [keys.rsa.jwk(), keys.ec.jwk(), Signer::rsa("rsa", 2).jwk()]});
    std::fs::write(keys.path("twice.json"), twice.to_string()).expect("write");
    let cases: Vec<(Setup, &str, &str)> = vec![
        (
            Setup {
                api_verifier: "nobody",
                ..good.clone()
            },
            "routes[0].jwt.verifier",
            "unknown verifier `nobody`",
        ),
        (
            Setup {
                api_jwt: false,
                ..good.clone()
            },
            "routes[0].limits[0].key[0]",
            "needs a verified token",
        ),
        (
            Setup {
                tiers_jwt: false,
                paid_key: "client_ip",
                ..good.clone()
            },
            "routes[2].limits[0].when[0].jwt",
            "needs a verified token",
        ),
        (
            Setup {
                jwks: keys.path("missing.json"),
                ..good.clone()
            },
            "jwt[0].jwks_file",
            "missing.json",
        ),
        (
            Setup {
                secret: keys.path("short.secret"),
                ..good.clone()
            },
            "jwt[0].keys[0].secret_file",
            "at least 32 bytes",
        ),
        (
            Setup {
                hs_algorithm: "HS512",
                ..good.clone()
            },
            "jwt[0].keys[0]",
            "HS512",
        ),
        (
            Setup {
                rs_algorithm: "ES256",
                ..good.clone()
            },
            "jwt[0].keys[1].pem_file",
            "P-256",
        ),
        (
            Setup {
                jwks: keys.path("twice.json"),
                ..good.clone()
            },
            "jwt[0].jwks_file",
            "keys[0] and keys[2] both have the `kid` `rsa`",
        ),
        (
            Setup {
                pem_kid: "ed",
                ..good.clone()
            },
            "jwt[0].keys[1].kid",
            "the `kid` `ed` is already",
        ),
    ];
    let good = keys.policy_with(&good).to_yaml();
    for (setup, field, message) in cases {
        let yaml = keys.policy_with(&setup).to_yaml();
        assert_ne!(yaml, good, "the case changed nothing: {field}");
        let path = keys.path("policy.yaml");
        std::fs::write(&path, format!("{listen}{yaml}")).expect("write");
        let (status, _, stderr) = support::sluice_check(&path);
        assert!(!status.success(), "{field}: accepted");
        assert!(stderr.contains(field), "{field}: {stderr}");
        assert!(stderr.contains(message), "{message}: {stderr}");
        assert!(stderr.contains("policy.yaml:"), "names the file: {stderr}");
    }
    std::fs::write(keys.path("policy.yaml"), format!("{listen}{good}")).expect("write");
    let (status, stdout, stderr) = support::sluice_check(&keys.path("policy.yaml"));
    assert!(status.success(), "{stdout}{stderr}");
}

/// `sluice explain` runs the identify phase: the token given as a header is verified, and
/// the store key names the verified `sub`.
#[test]
fn explain_reads_the_verified_claims() {
    let keys = Keys::new();
    let path = keys.path("policy.yaml");
    std::fs::write(
        &path,
        format!(
            "listen: 127.0.0.1:1\nadmin_listen: 127.0.0.1:2\n{}",
            keys.policy().to_yaml()
        ),
    )
    .expect("write");
    let token = keys.ed.token(&claims(json!("explained")));
    let header = format!("authorization: Bearer {token}");
    let config = path.display().to_string();
    let out = support::run_sluice(
        &[
            "explain", "--config", &config, "-H", &header, "GET", "/api/x",
        ],
        Duration::from_secs(30),
    );
    assert!(
        out.stdout.contains("{jwt:sub=explained}"),
        "{}{}",
        out.stdout,
        out.stderr
    );
    let forged = format!("{token}x");
    let header = format!("authorization: Bearer {forged}");
    let out = support::run_sluice(
        &[
            "explain", "--config", &config, "-H", &header, "GET", "/api/x",
        ],
        Duration::from_secs(30),
    );
    assert!(out.stdout.contains("401"), "{}{}", out.stdout, out.stderr);
}

/// The token is one reading of the request: two `Authorization` fields (a valid token and a
/// forged one, say) are refused, not verified one way and forwarded another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_token_fields_are_refused() {
    let keys = Keys::new();
    let sluice = Sluice::start(&keys.policy()).await;
    let valid = keys.hs.token(&claims(json!("twice")));
    let response = get_with(
        &sluice,
        "/open",
        Some(&valid),
        &[("authorization", "Bearer forged")],
    )
    .await;
    assert_eq!(response.status(), 400);
    let body: Value = response.json().await.expect("JSON");
    assert!(
        body["detail"].to_string().contains("authorization"),
        "{body}"
    );
}
