"""The published view as bytes: encoded once per version, sent relative to what a peer holds.

Job: `ViewCache` keeps the current view in three encoded parts (scalars, live set, plan) and the
(epoch, plan_version, live) of the last versions, and answers `encoded(known)`: the view as the
holder of version `known` needs it. The plan is left out (`"pulse": true`) when `known` has the
same plan_version; the live set is sent as `live_from` {"epoch", "gone", "new"} when `known` is a
remembered version (O(change) bytes); an unknown or forgotten `known` gets the whole view. The
whole view is compact too: the live set as runs of consecutive ids (`live_runs`), and the plan,
when it is `assign(M, members, equal weights)` (every attempt that is not a redo), as that rule
(`"plan": {"assign": M, "members": runs, "weight": w}`, which the receiver recomputes: `assign`
is pure), else as `{"plan_runs", "weights"}`. A run of R replicas formed without gaps is a few
hundred bytes whatever R. `protocol.merge_view` is the other half.
`frame(reply, view)` splices view bytes into a reply frame without decoding them. The server and
the relays (relay.py) both answer through it, so a replica cannot tell them apart.

Invariants: the full form is `{scalars,"live_runs":[...],"plan":{...}}` with the plan last, so a
relay can cut the plan bytes off with one search (`split_plan`) instead of decoding them. A delta names the epoch it applies to; `merge_view` drops it unless the holder's
view is of that epoch.

Costs: per version, the scalars are encoded once (small) and the plan only when it changed; per
distinct `known` per version one set difference O(R) (memoized: a commit reaches R replicas that
mostly hold the same version). No sockets, no clock.
"""

from __future__ import annotations

import json
import struct
from collections import OrderedDict
from typing import Any

from recover.coordinator.protocol import MAX_FRAME, FrameTooLarge, View, id_runs
from recover.policy import assign

__all__ = ["ViewCache", "encode_plan", "frame", "split_plan"]

_HEADER = struct.Struct(">I")
_PLAN_AT = b',"plan":'
_KEPT = 64  # versions remembered for deltas


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def encode_plan(view: View, microbatches: int = 0) -> bytes:
    """`"plan":{...}` of a view (a fragment of an object): the rule when the plan is `assign`'s
    with equal weights over its members and `microbatches` (M) is known, else the plan as
    runs and the weights. O(R + M), once per plan."""
    members = sorted(view.plan)
    weights = set(view.weights.values())
    if microbatches > 0 and members and len(weights) == 1 and set(view.weights) == set(members):
        w = weights.pop()
        if assign(microbatches, members, {r: w for r in members}) == view.plan:
            rule = {"assign": microbatches, "members": id_runs(tuple(members)), "weight": w}
            return b'"plan":' + _dumps(rule)
    d = view.to_dict()
    return b'"plan":' + _dumps({"plan_runs": d["plan_runs"], "weights": d["weights"]})


def split_plan(body: bytes) -> tuple[bytes, bytes | None]:
    """A view's bytes -> (the view without its plan, the plan fragment or None). Inside a JSON
    string every quote is escaped, so `,"plan":` can only be the key itself."""
    at = body.find(_PLAN_AT)
    if at < 0:
        return body, None
    return body[:at] + b"}", body[at + 1 : -1]


class ViewCache:
    """The current view, encoded, and the last versions it can send deltas against."""

    def __init__(self) -> None:
        self.version = -1
        self.epoch = -1
        self.plan_version = -1
        self.live: tuple[int, ...] = ()
        self._scalars = b""
        self._live = b""
        self._plan = b""
        self._history: OrderedDict[int, tuple[int, int, tuple[int, ...]]] = OrderedDict()
        self._memo: dict[int, bytes] = {}

    def publish(self, view: View, plan: bytes | None = None, microbatches: int = 0) -> None:
        """Make `view` current. `plan`: its encoded plan (see `encode_plan`); None encodes it
        from the view (with M = `microbatches`) when its plan_version is new, or keeps the
        current bytes."""
        if plan is not None:
            self._plan = plan
        elif view.plan_version != self.plan_version:
            self._plan = encode_plan(view, microbatches)
        if view.epoch != self.epoch or not self._live:
            self._live = _dumps(id_runs(tuple(view.live)))
        self.version, self.epoch, self.plan_version = view.version, view.epoch, view.plan_version
        self.live = view.live
        self._scalars = _dumps(view.scalars())[1:-1]
        self._history[view.version] = (view.epoch, view.plan_version, view.live)
        while len(self._history) > _KEPT:
            self._history.popitem(last=False)
        self._memo = {}

    def full(self) -> bytes:
        return b"{" + self._scalars + b',"live_runs":' + self._live + b"," + self._plan + b"}"

    def encoded(self, known: Any) -> bytes:
        """The current view for a holder of version `known` (anything else: the full view)."""
        if not isinstance(known, int) or isinstance(known, bool):
            return self.full()
        out = self._memo.get(known)
        if out is None:
            out = self._memo[known] = self._relative(known)
        return out

    def _relative(self, known: int) -> bytes:
        held = self._history.get(known)
        if held is None:
            return self.full()
        epoch, plan_version, live = held
        if epoch == self.epoch:
            live_part = b'"live_from":' + _dumps({"epoch": epoch, "gone": [], "new": []})
        else:
            now, then = set(self.live), set(live)
            gone, new = sorted(then - now), sorted(now - then)
            if len(gone) + len(new) > len(self.live) // 2:  # not much of a delta
                live_part = b'"live_runs":' + self._live
            else:
                delta = {"epoch": epoch, "gone": gone, "new": new}
                live_part = b'"live_from":' + _dumps(delta)
        plan_part = b',"pulse":true' if plan_version == self.plan_version else b"," + self._plan
        return b"{" + self._scalars + b"," + live_part + plan_part + b"}"


def frame(reply: dict[str, Any], view: bytes | None = None) -> bytes:
    """One reply frame: `reply` as JSON with `view` (encoded view bytes) spliced in last."""
    body = _dumps(reply)
    if view is not None:
        body = body[:-1] + (b',"view":' if len(body) > 2 else b'"view":') + view + b"}"
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(f"reply of {len(body)} bytes exceeds {MAX_FRAME}")
    return _HEADER.pack(len(body)) + body
