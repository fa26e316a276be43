"""`recover agent`: one process per node, started by a scheduler (srun, a pod, or by hand).

Job: ask the job's coordinator which replica ids this node hosts (coordinator/placement.py: a
node of S slots hosts up to S replicas; a node that joins when every id is hosted is a standby
node, handed the ids of a node that is lost), start each with the variables the script API
reads (recover.runtime.env), restart a dead one in place (--respawn, the restart rule of
recover.supervisor, shared with `recover run`), give an id back when it will not run here any
more, and end with a status that tells the scheduler whether to requeue (docs/multinode.md,
"Exit statuses"). The agent holds no training state: it only starts, watches and stops processes.

Rules:
- the coordinator's answer is the truth: an id it gives is started; an id it no longer gives
  (this node was declared lost and came back, its ids handed to another node) is stopped at once
  (those processes are fenced already);
- a replica that dies is restarted here after --respawn S, at most --max-restarts times; one that
  will not be restarted here (no --respawn, or the restarts spent) is given back with its slot:
  another node with a free slot (a standby node) is handed the id, and its replica joins with the
  live state by transfer;
- SIGTERM (a drain: `scancel`, a pod's deletion, a node going to maintenance) is a planned leave
  of every replica here at its next step boundary; then the agent gives its ids back and exits 0;
  the coordinator hands them to another node if one has room;
- the run is over for this node when the coordinator says it ended (finished, quorum lost,
  diverged) and every process here has exited; a coordinator unreachable for the replicas'
  --coordinator-grace plus the stop grace ends it too (status 11: resume from the checkpoint).
- every process it starts dies with it (Linux parent-death signal), so a SIGKILLed agent leaves
  no replica behind, and its node's ids are handed on once its lease (`--node-lease` of the
  coordinator) runs out.

Record: the node's events (`agent.*`) go to --out's metrics.jsonl, where its replicas' events go
too (RECOVER_EVENTS); with TORCHELASTIC_ERROR_FILE set, a status other than 0 also writes the
one-line reason there in torchelastic's error-file format, for the tooling that reads it.

Size: one node agent from start to exit: its configuration and checks, the beat thread, the
placement it obeys, the relay it may run, the drain and the verdict; the process table and
restart rules are recover.supervisor's.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from recover import exits
from recover.coordinator.channel import NodeLink
from recover.coordinator.outcomes import CoordinatorUnreachable, RequestRefused
from recover.record import MetricsWriter, RecordUnwritable
from recover.runtime.env import ReplicaEnv
from recover.runtime.faults import FaultSpec, fault_flag, faults_for, read_fired
from recover.runtime.spec import ReplicaSpec
from recover.supervisor import (
    ProcessHost,
    ReplicaSupervisor,
    describe_exit,
    end_politely,
    free_ports,
    proc_name,
)

__all__ = ["AgentConfig", "NodeAgent", "AGENT_EXITS", "ERROR_FILE_ENV"]

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
BEAT_S = 0.25  # the shortest pause between an agent's beats (6 a --node-lease, 5 s: 0.83 s)
ENDED = ("finished", "quorum_lost", "diverged")  # coordinator statuses after which nothing runs

# The agent's exit statuses, for a scheduler's requeue policy (docs/multinode.md's table).
AGENT_EXITS = {
    exits.OK: "the run finished (every step committed), or this node was drained (SIGTERM) "
    "and its replicas left at a step boundary: do not requeue",
    1: "failed: a replica crashed and the run did not finish, or the agent itself failed: "
    "look at the output before requeueing",
    2: "bad usage (a flag, the command): fix the command",
    exits.QUORUM_LOST: "quorum lost: the committed state was checkpointed; requeue with "
    "--resume in the script's arguments",
    exits.DIVERGED: "the replicas diverged: do not requeue (a bug or bad hardware)",
    exits.REFUSED: "the coordinator refused this node (a wrong token): fix the job",
    exits.COORDINATOR_LOST: "the coordinator was lost: requeue the job (resume from the last "
    "checkpoint)",
    exits.STORAGE: "a run folder could not be written (full or read-only): free space, then "
    "requeue",
}

log = logging.getLogger("recover.launch")


def _default_slots(ranks: int) -> int:
    """Slots on a node: its GPUs over the ranks of a replica (at least 1); 1 without GPUs."""
    from recover.launch import visible_gpus

    gpus = visible_gpus()
    return max(1, gpus // ranks) if gpus else 1


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    coordinators: tuple[tuple[str, int], ...]  # the leader first, then standbys
    command: tuple[str, ...]
    node: str = field(default_factory=socket.gethostname)
    slots: int = 1
    replica: ReplicaSpec = field(default_factory=ReplicaSpec)
    respawn_s: float | None = None
    max_restarts: int = 3
    out: Path = Path("runs/agent")
    faults: tuple[FaultSpec, ...] = ()
    start_timeout_s: float = 60.0  # the coordinator must have answered by then
    stop_grace_s: float = 30.0  # a drain: how long the replicas get to leave
    warm_start: bool = True
    preload: tuple[str, ...] = ()  # --preload: the warm start's imports besides torch's
    # The agent relays its replicas' sessions (coordinator/relay.py): they speak to it on
    # 127.0.0.1, it holds their leases and long-polls and sends the coordinator one beat and one
    # batch of done reports per step for the whole node.
    relay: bool = False

    def __post_init__(self) -> None:
        if not self.coordinators:
            raise ValueError("--coordinator is required (HOST:PORT[,HOST:PORT...])")
        if not self.command:
            raise ValueError("recover agent needs a command after --, e.g. -- python train.py")
        if not self.node or len(self.node) > 128:
            raise ValueError(f"--node must be a name of 1 to 128 characters, got {self.node!r}")
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 0:
            raise ValueError(f"--slots must be an int >= 0, got {self.slots!r}")
        if self.respawn_s is not None and self.respawn_s < 0:
            raise ValueError(f"--respawn must be >= 0 seconds, got {self.respawn_s}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if not self.start_timeout_s > 0:
            raise ValueError(f"--start-timeout must be > 0, got {self.start_timeout_s}")
        if self.relay and len(self.coordinators) > 1:
            raise ValueError(
                "--relay speaks to one coordinator: give one --coordinator address (a relay does "
                "not follow a standby's takeover)"
            )
        for f in self.faults:
            if f.rank >= self.ranks:
                raise ValueError(
                    f"--fault names rank {f.rank}, but a replica has ranks 0..{self.ranks - 1}"
                )

    @property
    def ranks(self) -> int:
        return self.replica.layout.ranks


class NodeAgent(ProcessHost):
    """`NodeAgent(cfg).run()` -> the exit status (AGENT_EXITS)."""

    WARM_MODULES = (
        "torch",
        "torch.distributed",
        "torch._dynamo",  # a script's optimizer imports it when built (see launch.LocalLauncher)
        "recover.runtime.api",
    )

    def __init__(
        self, cfg: AgentConfig, *, console: TextIO | None = sys.stdout, token: str | None = None
    ) -> None:
        super().__init__(console=console, token=token or "")
        self.cfg = cfg
        self.link = NodeLink(list(cfg.coordinators), token=token or None)
        self.sup = ReplicaSupervisor(
            cfg.ranks, cfg.respawn_s, cfg.max_restarts, lambda r, k: self.children[proc_name(r, k)]
        )
        self.hosted: dict[int, int] = {}  # replica id -> its slot on this node (device numbering)
        self.retired = 0  # slots given back with a replica that would not run here
        self.status: str | None = None  # the run's, as the coordinator last said
        self.draining = False
        self.finishing = False  # a replica here finished, or the run stopped for good
        self._last_answer = time.monotonic()  # (the agent's start, until the first answer)
        # The beats run on a thread of their own: starting a replica can block for seconds (the
        # first fork waits for the zygote's torch import), longer than the node's lease.
        self._beats = threading.Condition()
        self._wish = 0  # bumped at every change of what this node claims (slots, ids)
        self._answer: tuple[int, float, dict | Exception] | None = None  # (wish, when, reply)
        self._stop_beats = threading.Event()
        self.relay = None  # the node's RelayServer (--relay), started with the first answer
        self._relay_env: dict[str, str] = {}  # what the replicas behind it need to know

    # ---- the loop --------------------------------------------------------------------------

    def run(self) -> int:
        cfg = self.cfg
        cfg.out.mkdir(parents=True, exist_ok=True)
        self.writer = MetricsWriter(cfg.out / "metrics.jsonl")
        self.writer.event("agent.started", node=cfg.node, slots=cfg.slots, pid=os.getpid())
        self.say(
            f"node {cfg.node}: {cfg.slots} slot(s) of {cfg.ranks} rank(s); coordinator "
            + ",".join(f"{h}:{p}" for h, p in cfg.coordinators)
        )
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        code, reason = 1, "the agent failed"
        self._beater = beater = threading.Thread(
            target=self._beat_loop, name="agent-beats", daemon=True
        )
        try:
            beater.start()
            if cfg.warm_start:
                self.start_zygote(f"{cfg.out}:{cfg.node}", cfg.preload)
            code, reason = self._loop()
        except KeyboardInterrupt:
            code, reason = exits.STOPPED, "interrupted"
        except RecordUnwritable as e:
            code, reason = exits.STORAGE, str(e)
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.reap_all()
            if not self._stop_beats.is_set():  # nothing runs here any more: the node leaves
                self._give_back_all("its agent ended", record=False)
            if self.relay is not None:
                self.relay.stop()
            self.close_host()
            self.link.close()
        level = logging.INFO if code == 0 else logging.ERROR
        self.say(f"node {cfg.node} ends with status {code}: {reason}", level)
        try:
            self.writer.event("agent.finished", node=cfg.node, exit_status=code, reason=reason)
        except RecordUnwritable:
            code = exits.STORAGE
        self.writer.close()
        if code != 0:
            write_error_file(os.environ.get(ERROR_FILE_ENV), reason, code, cfg.node)
        return code

    def _on_sigterm(self, signum, frame) -> None:
        if not self.draining:
            self.draining = True
            self._changed()
            self.say(f"node {self.cfg.node} drained (SIGTERM): every replica here leaves")
            for r in list(self.hosted):
                for k in range(self.cfg.ranks):
                    proc = self.children.get(proc_name(r, k))
                    if proc is not None and proc.poll() is None:
                        end_politely(proc)

    def _loop(self) -> tuple[int, str]:
        cfg = self.cfg
        drain_deadline = None
        seen = None
        while True:
            now = time.monotonic()
            with self._beats:
                answer = self._answer
            if answer is not None and answer is not seen:
                seen = answer
                wish, when, reply = answer
                if wish == self._wish:  # (an answer to an older claim could undo a change)
                    outcome = self._take(when, reply)
                    if outcome is not None:
                        return outcome
            self._read_exits(now)
            for r in self.sup.due(now):
                restart = self.sup.incarnation[r]
                self.say(f"respawning replica {r} (restart {restart})")
                self._start(r)
                self.writer.event("agent.respawned", node=cfg.node, replica=r, restart=restart)
            if self.draining:
                drain_deadline = drain_deadline or now + cfg.stop_grace_s
                if not self.sup.running() or now > drain_deadline:
                    self.reap_all()
                    self._give_back_all("drained")
                    return exits.OK, "drained: its replicas left at a step boundary"
            elif not self.sup.running() and (self.finishing or self.status in ENDED):
                return self._verdict()
            time.sleep(0.02)

    def _claim(self) -> dict:
        """What this node tells the coordinator now: its free slots and the ids it runs."""
        # Draining, the node keeps its ids until its replicas have left (handed on earlier, a
        # replica of the same id would start elsewhere while this one is still a member).
        slots = len(self.hosted) if self.draining else max(0, self.cfg.slots - self.retired)
        return {"node": self.cfg.node, "slots": slots, "holds": sorted(self.hosted)}

    def _changed(self) -> None:
        """The claim changed: answers to the older one are not acted on."""
        with self._beats:
            self._wish += 1

    def _beat_loop(self) -> None:
        """Every BEAT_S: send the current claim, keep the answer (or the error) for the loop."""
        while not self._stop_beats.is_set():
            with self._beats:
                wish, claim = self._wish, self._claim()
            try:
                reply: dict | Exception = self.link.beat(**claim)
            except (CoordinatorUnreachable, RequestRefused) as e:
                reply = e
            with self._beats:
                self._answer = (wish, time.monotonic(), reply)
            lease = reply.get("node_lease_s") if isinstance(reply, dict) else None
            # six beats a lease (a lost beat costs no lease), at most four a second: a
            # coordinator of 1,600 nodes hears 1,300 beats a second at its default lease of 5 s
            pause = max(BEAT_S, float(lease) / 6) if isinstance(lease, int | float) else BEAT_S
            self._stop_beats.wait(pause)

    def _take(self, when: float, reply: dict | Exception) -> tuple[int, str] | None:
        """Act on one answer of the coordinator; an outcome when the agent must end."""
        cfg = self.cfg
        if isinstance(reply, RequestRefused):
            return exits.REFUSED, f"the coordinator refused this node: {reply}"
        if isinstance(reply, CoordinatorUnreachable):
            silent = when - self._last_answer
            if self.status is None and silent > cfg.start_timeout_s:
                return exits.COORDINATOR_LOST, (
                    f"no coordinator answered in --start-timeout ({cfg.start_timeout_s:g} s): "
                    f"{reply}"
                )
            # Its replicas stop by themselves after their grace (status 11); then the agent.
            limit = cfg.replica.coordinator_grace_s + cfg.stop_grace_s
            if self.status is not None and silent > limit and not self.sup.running():
                return exits.COORDINATOR_LOST, f"the coordinator was lost: {reply}"
            return None
        self._last_answer = when
        self.status = reply.get("status")
        assign = set(reply.get("assign", []))
        if assign and self.cfg.relay and self.relay is None:
            outcome = self._start_relay()
            if outcome is not None:
                return outcome
        for r in sorted(set(self.hosted) - assign):
            self._drop(r, "the coordinator gave it to another node")
        if not self.draining and not self.finishing and self.status not in ENDED:
            for r in sorted(assign - set(self.hosted)):
                self._host(r)
        return None

    def _start_relay(self) -> tuple[int, str] | None:
        """Start the node's relay (the coordinator answered: it is up). Its replicas reach the
        coordinator through 127.0.0.1, so they cannot find the route to it themselves: they are
        told the interface this node reaches it through (unless one was asked for)."""
        from recover.addresses import AddressError, InterfaceChoice, resolve_peer_address
        from recover.coordinator.relay import RelayServer

        cfg = self.cfg
        try:
            peer = resolve_peer_address(
                cfg.coordinators[0], InterfaceChoice.from_environ(os.environ)
            )
        except AddressError as e:
            return exits.ADDRESS, str(e)
        if peer.hostname is not None:  # the route's source: name its interface for the replicas
            from recover.addresses import gather_host_facts

            via = gather_host_facts(cfg.coordinators[0]).interface_of(peer.hostname)
            if via is not None:
                self._relay_env = {"RECOVER_IFNAME": via}
        relay = RelayServer(
            cfg.coordinators[0], token=self.token or None, relay_id=f"node:{cfg.node}"
        )
        try:
            relay.start(timeout_s=cfg.start_timeout_s)
        except (OSError, RuntimeError, TimeoutError) as e:
            return exits.COORDINATOR_LOST, f"the node's relay could not reach the coordinator: {e}"
        self.relay = relay
        self.say(f"relaying this node's replicas at 127.0.0.1:{relay.address[1]} ({peer.reason})")
        self.writer.event(
            "agent.relay_started", node=cfg.node, port=relay.address[1], relay=relay.relay_id
        )
        return None

    def _read_exits(self, now: float) -> None:
        cfg = self.cfg
        for d in self.sup.reap():
            self.finishing = self.finishing or d.code == 0 or d.code in exits.RUN_FAILURES
            if d.code == 0 or not d.first:
                continue
            self.say(describe_exit(d.replica, d.incarnation, d.code), logging.WARNING)
            self.writer.event(
                "agent.replica_died", node=cfg.node, replica=d.replica, rank=d.rank,
                restart=d.incarnation, exit_status=d.code,
            )  # fmt: skip
            finishing = self.finishing or self.draining or self.status in ENDED
            if self.sup.schedule(d.replica, now, finishing=finishing) or finishing:
                continue
            if d.code in (exits.COORDINATOR_LOST, exits.STORAGE):
                continue  # the run stops: nobody else could run it either
            # Not restarted here: its id goes back, with its slot, for another node to host.
            self.retired += 1  # (_drop marks the change)
            self._drop(d.replica, "it will not be restarted here", kill=False)

    # ---- replicas ----------------------------------------------------------------------------

    def _host(self, r: int) -> None:
        used = set(self.hosted.values())
        slot = next(i for i in range(len(used) + 1) if i not in used)
        with self._beats:
            self.hosted[r] = slot
            self._wish += 1
        self._start(r)
        self.sup.hosting(r)
        self.say(f"hosting replica {r} (slot {slot})")
        self.writer.event("agent.hosting", node=self.cfg.node, replica=r, slot=slot)

    def _drop(self, r: int, why: str, *, kill: bool = True) -> None:
        """Replica r is no longer this node's: its processes are ended (they are fenced or gone)
        and its id is left out of the next beat."""
        self.sup.release(r)
        with self._beats:
            self.hosted.pop(r, None)
            self._wish += 1
        for k in range(self.cfg.ranks):
            proc = self.children.pop(proc_name(r, k), None)
            if kill and proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        self.say(f"replica {r} leaves this node: {why}", logging.WARNING)
        self.writer.event("agent.gave_back", node=self.cfg.node, replica=r, reason=why)

    def _give_back_all(self, why: str, *, record: bool = True) -> None:
        """The node leaves the job: no more beats, then one that says so (its ids are free at
        once, not after its lease)."""
        self._stop_beats.set()  # (no beat in flight may claim the ids again after this one)
        self._beater.join(timeout=5.0)
        try:
            self.link.beat(node=self.cfg.node, slots=0, holds=[], leaving=True, why=why)
        except (CoordinatorUnreachable, RequestRefused):
            pass  # (gone, or the run is over) its lease runs out instead
        for r in list(self.hosted) if record else ():
            self.writer.event("agent.gave_back", node=self.cfg.node, replica=r, reason=why)
        with self._beats:
            self.hosted.clear()

    def _start(self, r: int) -> None:
        cfg = self.cfg
        (host, port), *standbys = cfg.coordinators
        if self.relay is not None:
            (host, port), standbys = ("127.0.0.1", self.relay.address[1]), []
        fired = cfg.out / "faults.fired"
        done = read_fired(fired)
        pending = [
            f
            for f in faults_for(list(cfg.faults), r)
            if f.kind == "slow" or fault_flag(f) not in done
        ]
        base = ReplicaEnv(
            coordinator=(host, port), standbys=tuple(standbys), replica_id=r,
            faults=tuple(pending), fired=fired, events=cfg.out / "metrics.jsonl",
            spec=cfg.replica,
        ).to_environ()  # fmt: skip
        base.update(self._relay_env)
        slot = self.hosted[r]
        name = f"replica {r}"
        if cfg.ranks == 1:
            env = {**base, "RECOVER_DEVICE_INDEX": str(slot)}
            self.spawn(name, list(cfg.command), f"[{name}] ", env)
            return
        (master_port,) = free_ports(1)
        for k in range(cfg.ranks):
            env = {
                **base,
                "RANK": str(k), "LOCAL_RANK": str(k), "WORLD_SIZE": str(cfg.ranks),
                "LOCAL_WORLD_SIZE": str(cfg.ranks), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master_port), "RECOVER_DEVICE_INDEX": str(slot * cfg.ranks + k),
            }  # fmt: skip
            self.spawn(proc_name(r, k), list(cfg.command), f"[{name} rank {k}] ", env)

    # ---- the end ------------------------------------------------------------------------------

    def _verdict(self) -> tuple[int, str]:
        """This node's status once nothing runs here and the run ended (or a replica here
        finished or stopped it)."""
        codes = [c for _, _, c in self.sup.codes]
        failures = [c for c in codes if c in exits.RUN_FAILURES]
        if self.status == "finished" or (0 in codes and not failures):
            return exits.OK, "the run finished"
        if self.status == "quorum_lost" or exits.QUORUM_LOST in failures:
            return exits.QUORUM_LOST, "quorum lost: the committed state was checkpointed"
        if self.status == "diverged" or exits.DIVERGED in failures:
            return exits.DIVERGED, "the replicas diverged"
        if exits.STORAGE in codes:
            return exits.STORAGE, "a run folder could not be written"
        if exits.COORDINATOR_LOST in codes:
            return exits.COORDINATOR_LOST, "the coordinator was lost"
        return 1, "the run stopped: " + "; ".join(
            describe_exit(r, i, c) for r, i, c in self.sup.codes if c != 0
        )


def write_error_file(path: str | None, reason: str, code: int, node: str) -> None:
    """torchelastic's error file (TORCHELASTIC_ERROR_FILE), with our one-line reason: the JSON
    that torchelastic's tooling reads ({"message": {"message", "extraInfo"}})."""
    if not path:
        return
    data = {
        "message": {
            "message": f"recover agent on {node}: {reason}",
            "extraInfo": {
                "py_callstack": "",
                "timestamp": str(int(time.time())),
                "exit_status": code,
            },
        }
    }
    tmp = f"{path}.tmp{os.getpid()}-{secrets.token_hex(2)}"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not write %s=%s: %s", ERROR_FILE_ENV, path, e)
