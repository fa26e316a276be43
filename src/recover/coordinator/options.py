"""The coordinator's settings, each declared once: `CoordinatorOptions`.

Job: every setting of the coordinator is a field here that carries its flag, its default, its
help text and its check (recover.settings). `recover coordinator serve` offers them all as flags;
the local launchers (`recover train`, `recover run`) offer the ones tagged "launcher" in their
supervision group and hand their coordinator the whole object as one JSON document
(`settings_json`, read back by `serve --options`), so nothing is turned back into flags.

M, the microbatches of a step, is not a setting: the replicas declare it in their fingerprints,
and the run takes it from the first ones when it forms (`microbatches` is 0 until then; an
in-process harness may fix it).

What it must not do: hold state that changes during a run (recover.coordinator.state_store).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from recover.checks import is_int, is_number
from recover.coordinator.protocol import DEFAULT_LEASE_S
from recover.settings import check_settings, json_fields, setting

__all__ = ["BALANCES", "COORDINATOR_MODES", "CoordinatorOptions"]

BALANCES = ("throughput", "equal")
# "shrink" is a baseline for comparison only (torchft's semantics): a dead replica's ids are
# dropped, each replica keeps the fixed slot of ids it had in a full job; the global batch shrinks.
COORDINATOR_MODES = ("recover", "shrink")
LAUNCHER = ("launcher",)  # the tag of the settings a local launcher offers too


@dataclass(frozen=True, kw_only=True)
class CoordinatorOptions:
    expected_replicas: int  # R: the run forms when R replicas have registered (serve --replicas)
    # M: microbatch ids 0..M-1 are summed in every step. 0: learned when the run forms, from the
    # fingerprints' "microbatches" (the replicas declare it; the only way a process is told M).
    microbatches: int = 0
    min_replicas: int = setting(
        1, "--min-replicas",
        "the run stops, quorum lost (the committed state is saved, and it resumes from that "
        "checkpoint), when fewer replicas are live (default: %(default)s)",
        metavar="N", low=(1, True), tags=LAUNCHER,
    )  # fmt: skip
    lease_s: float = setting(
        DEFAULT_LEASE_S, "--lease",
        "a replica silent this long, in seconds, is declared dead (default: %(default)s)",
        metavar="S", low=(0.0, False), tags=LAUNCHER,
    )  # fmt: skip
    start_deadline_s: float = setting(
        300.0, "--start-deadline",
        "seconds for the expected replicas to register; after it the run forms with those there "
        "if they are at least --min-replicas (default: %(default)s; a local launcher gives its "
        "own start timeout)",
        metavar="S", low=(0.0, False),
    )  # fmt: skip
    balance: str = setting(
        "throughput", "--balance",
        "microbatch shares: by each replica's measured throughput, or equal (default: "
        "%(default)s)",
        choices=BALANCES, tags=LAUNCHER,
    )  # fmt: skip
    mode: str = setting(
        "recover", "--mode",
        "recover: reassign a dead replica's microbatches (default); shrink: drop them (a baseline "
        "for comparison: the global batch shrinks)",
        choices=COORDINATOR_MODES,
    )  # fmt: skip
    # When more than half of the members go silent together, the coordinator suspects its own
    # network and restarts their leases, for at most this long (membership._suspects_itself).
    self_suspicion_s: float = setting(
        10.0, "--self-suspicion",
        "when more than half of the replicas go silent together, suspect this coordinator's own "
        "network and restart their leases for at most S seconds before judging them (default: "
        "%(default)s, the replicas' default --coordinator-grace; 0: never)",
        metavar="S", low=(0.0, True),
    )  # fmt: skip
    node_lease_s: float = setting(
        5.0, "--node-lease",
        "a node agent (recover agent) silent this long, in seconds, is lost: its replica ids go "
        "to another node with a free slot (default: %(default)s)",
        metavar="S", low=(0.0, False),
    )  # fmt: skip
    # Weight of the newest sample (one per step, itself a mean over the step's microbatches) in
    # the throughput average: a straggler's share falls within two or three steps.
    throughput_ema_alpha: float = 0.5
    # Re-plan on measured throughput only when some replica's share of the weights moved by more
    # than this fraction: measurement noise must not reshuffle plans (and summation order) at
    # every step.
    rebalance_threshold: float = 0.1
    # A member that a majority of the others cannot dial (their groups would not form, and their
    # probes say why: recover.runtime.reach) in this many consecutive failed attempts of a step
    # is evicted (how="unreachable"): one failed probe may be a blip, an endless redo is not.
    unreachable_attempts: int = 2

    def __post_init__(self) -> None:
        check_settings(self)
        for name in ("expected_replicas", "microbatches", "unreachable_attempts"):
            v = getattr(self, name)
            low = 0 if name == "microbatches" else 1
            if not is_int(v) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if self.min_replicas > self.expected_replicas:
            raise ValueError(
                f"--min-replicas ({self.min_replicas}) must be <= the replicas expected "
                f"({self.expected_replicas})"
            )
        alpha = self.throughput_ema_alpha
        if not is_number(alpha) or not 0 < alpha <= 1:
            raise ValueError(f"throughput_ema_alpha must be in (0, 1], got {alpha!r}")
        if not is_number(self.rebalance_threshold) or not self.rebalance_threshold >= 0:
            raise ValueError(
                f"rebalance_threshold must be a number >= 0, got {self.rebalance_threshold!r}"
            )

    @property
    def throughput_weights(self) -> bool:
        """Whether shares are weighted by measured throughput (--balance throughput)."""
        return self.balance == "throughput"

    def matches(self, saved: CoordinatorOptions) -> bool:
        """Whether the saved state of a run with `saved` options may be served with these (a
        standby taking over, a restart): every setting equal, and M too unless these leave it
        to the replicas (0), as a launcher's coordinators do; they take the run's M with its
        state."""
        mine = self if self.microbatches else replace(self, microbatches=saved.microbatches)
        return mine == saved

    # ---- the serialised form a launcher hands its coordinator ------------------------------
    def settings_json(self) -> str:
        """Every field but M (the replicas declare it), as one JSON object."""
        d = asdict(self)
        d.pop("microbatches")
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_settings(cls, text: str, **given: Any) -> CoordinatorOptions:
        """The options of `settings_json`'s text, with `given` (flags said as well) over it; a
        partial object keeps the defaults of what it lacks. ValueError that says what is wrong:
        not JSON, not an object, an unknown field, or M (which comes from the replicas)."""
        known = {f.name for f in fields(cls)}
        raw = json_fields(text, known, name="--options")
        if "microbatches" in raw:
            raise ValueError(
                "--options may not fix microbatches: M comes from the replicas' fingerprints"
            )
        merged = {**raw, **given}
        if "expected_replicas" not in merged:
            raise ValueError("--replicas is required (or replicas in --config's table)")
        return cls(**merged)


def options_from_stored(d: dict[str, Any]) -> CoordinatorOptions:
    """The options of a state saved by any version: fields since removed are dropped, and the
    older `throughput_weights` switch is read as --balance."""
    d = {k: v for k, v in d.items() if k not in _DROPPED}
    if "throughput_weights" in d:
        d["balance"] = "throughput" if d.pop("throughput_weights") else "equal"
    return CoordinatorOptions(**d)


_DROPPED = ("suspect_grace_s",)
