//! The reservation and the decision of a request on a token route, and the soft budgets that
//! switch models (`on_exceed: { switch_model: M }`, `crate::llm::switch`): when the store
//! refuses a request and every limit that refused it is a soft one naming the same fallback
//! `M` (not already the body's model), the request is not refused but sent to `M`:
//! 1. the body's top-level `model` is rewritten to `M`, every other byte as the client sent
//!    it (the body as read, before any output cap sluice writes for the first model), and its
//!    `Content-Length` set;
//! 2. the request is planned again for `M` (`request::checks::with_body`): per-model limits,
//!    keys and conditions now read `M`, and a calendar quota's period is the new decision's;
//! 3. the reservation is computed again for the new body, so it is priced at `M`'s prices
//!    (and the cap written, if the request names none, is `M`'s), and the settlement uses
//!    those prices;
//! 4. the store decides again: a second atomic call for the switched request. The first
//!    recorded nothing (a refused decision records nothing in any limit), so the two calls
//!    never count one request twice. The second decision is final: a refusal there (the
//!    fallback's own limits, or any other limit) is a 429, whatever its limits say on
//!    exceeding: a request is switched at most once, so there are no chains or loops at run
//!    time (and `sluice check` refuses policies that would imply them).
//!
//! A refusal by any limit without `switch_model` (a hard limit) is a 429 at once, even when a
//! soft limit refused too. The answer says the request was switched in the
//! `sluice-model-switched` header (`gpt-4o -> gpt-4o-mini`), on the upstream's answer and on
//! a refusal of the switched request alike; `sluice_model_switches_total` counts each switch
//! by route, limit and fallback. The soft limit's refusal stays counted as `rejected` in
//! `sluice_limit_decisions_total`: it did refuse the model asked for.
//!
//! The model is read once, from the body as the client sent it, and a body naming `model`
//! twice, in any spelling, was refused (400) before (`crate::model::read`,
//! `crate::llm::estimate::parse`): the model decided on is the one the upstream gets.

use std::net::IpAddr;

use http::header::{HeaderValue, CONTENT_LENGTH};
use http::request::Parts;
use http::StatusCode;

use super::decide::{self, Decided};
use super::request_body::ClientBody;
use super::stop::Stop;
use super::{tokens, Exchange, Gateway};
use crate::jwt::Claims;
use crate::llm::switch::Fallback;
use crate::llm::Prices;
use crate::policy::{Limit, Policy, Route};
use crate::request::{self, Now, Plan};

/// The longest model name the header repeats from a body: a longer one is left out.
const MOST_NAME_BYTES: usize = 128;

/// What planning a request again needs besides its head: what `request::plan` read.
pub struct Replan<'a, 'r> {
    pub policy: &'r Policy,
    pub route: &'r Route,
    pub peer: IpAddr,
    pub claims: Option<&'a Claims>,
    /// The body's `model`, normalised (`None`: it names none, or no limit reads it).
    pub model: Option<&'a str>,
}

/// Reserves the request's token limits (`tokens::reserve`) and decides `plan` in one store
/// call (`decide::decide`); when only soft limits refused it, switches it to their fallback
/// and reserves and decides once more. Returns the prices the settlement uses (the
/// fallback's after a switch).
pub async fn reserve_and_decide<'r, B>(
    gateway: &Gateway,
    again: &Replan<'_, 'r>,
    mut plan: Plan<'r>,
    head: &mut Parts,
    body: &mut ClientBody<B>,
    exchange: &mut Exchange<'r>,
) -> Result<Option<Prices>, Stop> {
    // The body as read: a switch rewrites this, not the body with the first model's cap.
    let sent = match (&*body, switches(&plan)) {
        (ClientBody::Read(read), true) => Some(read.bytes.clone()),
        _ => None,
    };
    let prices = tokens::reserve(&mut plan, head, body)?;
    let log = &gateway.finisher.log;
    let store = &gateway.store;
    let first = decide::decide(
        store,
        &gateway.notifier,
        &gateway.waiting,
        log,
        again.route,
        plan,
        exchange,
    )
    .await;
    let (Err(Stop::Limited), Some(sent)) = (&first, sent) else {
        return first.map(|()| prices);
    };
    let Some((soft, fallback)) = exchange
        .decided
        .as_ref()
        .and_then(|decided| soft_refusal(decided, again.model))
    else {
        return Err(Stop::Limited);
    };
    let rewritten = crate::llm::switch::with_model(&sent, &fallback.model).map_err(|err| {
        Stop::Unreservable {
            status: StatusCode::BAD_REQUEST,
            detail: format!(
                "this request cannot be switched to `{}`: {err}",
                fallback.model
            ),
        }
    })?;
    if let ClientBody::Read(read) = body {
        head.headers
            .insert(CONTENT_LENGTH, HeaderValue::from(rewritten.len() as u64));
        read.bytes = rewritten.into();
    }
    for limit in &soft {
        if let Some(counter) = limit
            .metrics
            .tokens
            .as_ref()
            .and_then(|t| t.switches.as_ref())
        {
            counter.inc();
        }
    }
    exchange.switched = header(again.model, &fallback);
    // The refused decision is not this request's any more: an undecided second one (the
    // store failed and the route allows) must not leave it behind.
    exchange.decided = None;
    let mut plan = request::checks::with_body(
        again.policy,
        again.route,
        head,
        again.peer,
        again.claims,
        Some(fallback.normalised.as_str()),
        Now::read().calendar,
    );
    let prices = tokens::reserve(&mut plan, head, body)?;
    decide::decide(
        store,
        &gateway.notifier,
        &gateway.waiting,
        log,
        again.route,
        plan,
        exchange,
    )
    .await?;
    Ok(prices)
}

/// Whether some limit of `plan` switches models (only then is the body kept as read).
fn switches(plan: &Plan<'_>) -> bool {
    plan.limits
        .limits()
        .iter()
        .any(|limit| fallback_of(limit).is_some())
}

fn fallback_of(limit: &Limit) -> Option<&Fallback> {
    limit.tokens.as_ref()?.switch_to.as_ref()
}

/// The limits that refused `decided` and the fallback they switch to, when every limit that
/// refused it (shadow limits record and refuse nothing) is a soft one naming the same
/// fallback, and the body names a `model` that is not that fallback already.
fn soft_refusal<'r>(
    decided: &Decided<'r>,
    model: Option<&str>,
) -> Option<(Vec<&'r Limit>, Fallback)> {
    let mut soft = Vec::new();
    let mut to: Option<&Fallback> = None;
    let refusing = decided
        .limits
        .limits()
        .iter()
        .zip(&decided.decision.rejecting)
        .filter(|(limit, &rejecting)| rejecting && !limit.spec.shadow);
    for (limit, _) in refusing {
        let fallback = fallback_of(limit)?;
        if to.is_some_and(|to| to != fallback) {
            return None;
        }
        to = Some(fallback);
        soft.push(*limit);
    }
    let to = to.filter(|to| model.is_some() && !to.is(model))?;
    Some((soft, to.clone()))
}

/// The header's value: the body's model, then the fallback; the body's name is left out when
/// it is not plain text or too long to repeat.
fn header(model: Option<&str>, fallback: &Fallback) -> Option<HeaderValue> {
    let from = model
        .filter(|m| m.len() <= MOST_NAME_BYTES)
        .and_then(|m| HeaderValue::from_str(&format!("{m} -> {}", fallback.model)).ok());
    from.or_else(|| HeaderValue::from_str(&format!("-> {}", fallback.model)).ok())
}
