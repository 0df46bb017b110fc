"""A drain pushes its sessions' KV ahead of their next calls (issue 40). Pure: no I/O.

When an instance is drained, every session whose KV lives there (homed there in the book,
or reported in its snapshot's device or host registry and homed nowhere else) is moved:
`plan` names, per session, the instance its next call would most likely land on, and asks
that agent to pull the pages from the drained holder (`KvPushRequested`); its `KvPushed`
report moves the session's home there (`push_book.PushBook.fold_pushed`), so the next call finds its
KV in that instance's host registry. A push unanswered for `RETRY_AFTER_S` is asked again,
up to `ATTEMPTS` times; one that moved fewer pages than the holder listed, never reported,
or that no instance can take loses that session's context (counted in the drain's status).
"""

from __future__ import annotations

from talaria.services.router.costs import HARD_REASONS, CostModel
from talaria.services.router.push_book import ATTEMPTS, RETRY_AFTER_S
from talaria.services.router.state import SessionEntry, kv_on
from talaria.shared.events import CallSubmitted, KvPushRequested


def next_call(state, holder: str, session_id: str, model: str) -> tuple[CallSubmitted, SessionEntry] | None:
    """The session's next call as the router will price it, as far as it is known before it
    comes: its whole context as the prompt (the new suffix is unknown; it is the same on every
    candidate), its measured output estimate (`state.outputs`; none measured for the model:
    1 token, the decode term alike everywhere), and its session row (or, for a session only
    the holder's registry reports, one that says its KV is there). None: no context to move."""
    view = state.instances.get(holder)
    reported = view.kv.get((session_id, model)) if view is not None else None
    entry = state.sessions.get(session_id)
    tokens = reported.kv_tokens if reported is not None and reported.state in ("device", "host") else 0
    if entry is None or entry.model != model:
        at = view.snapshot.at if view is not None else 0.0
        entry = SessionEntry(session_id, model, holder, tokens, at, calls=1)
    tokens = max(tokens, entry.kv_tokens)
    if tokens <= 0:
        return None
    cap = 1 << 20 if model in state.outputs.models else 1
    call = CallSubmitted(call_id=f"drain-push:{session_id}", session_id=session_id, model=model, prompt_ids=[],
                         block_hashes=[], max_tokens=cap, submitted_at=entry.last_used, prompt_tokens_hint=tokens)
    return call, entry


def choose_target(costs: CostModel, state, holder: str, session_id: str, model: str, now: float,
                  asked: dict[str, int] | None = None):
    """The InstanceView where the session's next call would land: the candidates able to take
    its pages (not the holder, a page server, `model`'s KV bytes reported) priced by the
    router's own cost model (`CostModel.price_all`: queue, prefill and decode work there, the
    KV recovered by pulling the holder's pages, the model's activation, the move's cost to the
    sessions living there; its hard filters are `instances.unavailable` and the model's), the
    cheapest admissible one, else the cheapest one only soft limits (admission, KV room) rule
    out, as an overloaded router queues there. `asked`: pushes this drain already sent to each
    instance; each is a session that will live there, charged as the move term charges the
    sessions homed there (kv recovery x sessions). None: no instance can take them."""
    nxt = next_call(state, holder, session_id, model)
    if nxt is None:
        return None
    call, entry = nxt
    views = [v for iid, v in state.instances.items()
             if iid != holder and v.snapshot.page_address
             and (res := v.models.get(model)) is not None and res.kv_bytes_per_token > 0]
    best, best_key = None, None
    for p in costs.price_all(state, views, call, entry, now):
        c = p.cost
        if c.reason in HARD_REASONS:
            continue
        more = (asked or {}).get(c.instance_id, 0) * c.kv_recovery_s
        key = (not c.feasible, c.total_s + more, c.instance_id)
        if best_key is None or key < best_key:
            best, best_key = p.view, key
    return best


def plan(costs: CostModel, state, holder: str, now: float, owns
         ) -> tuple[list[KvPushRequested], list[tuple[str, str]]]:
    """(pushes to ask, (session, why) of sessions no push can move) for `holder`'s sessions no
    call runs for, not yet settled and not pending (or pending past RETRY_AFTER_S); asks only
    for the sessions `owns` (this router's partitions)."""
    view = state.instances.get(holder)
    address = view.snapshot.page_address if view is not None else ""
    asks: list[KvPushRequested] = []
    lost: list[tuple[str, str]] = []
    book = state.pushes
    asked: dict[str, int] = {}  # target -> pushes this plan sent there
    for session_id, model in kv_on(state, holder):
        if book.settled(holder, session_id) or _running(state, session_id):
            continue
        prior = book.pending.get(session_id)
        if prior is not None and now - prior.at < RETRY_AFTER_S:
            continue
        attempt = prior.attempt + 1 if prior is not None else 1
        # Every router counts the lost alike (any may answer `talaria drain`); only the
        # session's owner asks.
        if attempt > ATTEMPTS:
            lost.append((session_id, f"no report after {ATTEMPTS} asks"))
            continue
        if not address:
            lost.append((session_id, f"{holder} serves no KV pages (migration off there)"))
            continue
        target = choose_target(costs, state, holder, session_id, model, now, asked)
        if target is None:
            lost.append((session_id, f"no instance that serves {model} can take KV pages"))
        elif owns(session_id):
            asked[target.instance_id] = asked.get(target.instance_id, 0) + 1
            asks.append(KvPushRequested(target.snapshot.instance_id, session_id, model, holder, address, now,
                                        attempt))
    return asks, lost


def _running(state, session_id: str) -> bool:
    home = state.homes.home_of.get(session_id)
    if home is None:
        return False
    homes = state.homes.by_instance.get(home[0], {}).get(home[1])
    return homes is not None and bool(homes.running.get(session_id))
