"""`recover coordinator serve|relay|status`, and the coordinator's and the relay's process mains.

Job: parse flags into `CoordinatorOptions` and serve with `run_coordinator_process` (also usable
directly as a multiprocessing target or subprocess main); `relay` runs a `RelayServer` in front
of a coordinator (`run_relay_process`); `status` prints members, epoch, step,
lease ages and the last decisions with their reasons. The token comes from --token or, read once
here, the environment variable RECOVER_TOKEN; nothing below the CLI reads the environment.
Binding anything other than 127.0.0.1 must be asked for with --host or --ifname (and warns
without a token). The store address each replica is told: --advertise, else (bound to a wildcard)
the address that replica reached the coordinator at, else the bound address (recover.addresses).

Size: the coordinator's command line (serve, status and their flags) and the loops that
serve it with and without a shared state; the rules are in decide, the wire in server.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from recover import exits
from recover.addresses import (
    GLOO_IFNAME_ENV,
    IFNAME_ENV,
    InterfaceChoice,
    interface_ipv4,
    is_loopback,
    is_wildcard,
)
from recover.checks import is_int
from recover.coordinator.channel import request_once
from recover.coordinator.options import CoordinatorOptions
from recover.coordinator.outcomes import CoordinatorUnreachable
from recover.coordinator.protocol import COORDINATOR_ENV, TOKEN_ENV
from recover.logs import LOG_LEVELS, process_prefix, setup_logging
from recover.record import RecordUnwritable
from recover.settings import add_flags, given

__all__ = [
    "add_coordinator_parser",
    "run_coordinator_cli",
    "run_coordinator_process",
    "run_relay_process",
]

log = logging.getLogger("recover.coordinator")


def add_coordinator_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    p = subparsers.add_parser("coordinator", help="run or inspect the membership coordinator")
    sub = p.add_subparsers(dest="coordinator_command", required=True)

    serve = sub.add_parser("serve", help="run the coordinator (and the torch TCPStore)")
    serve.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="a job file: TOML with one [coordinator] table whose keys are these flags without "
        "dashes; flags given here override it",
    )
    serve.add_argument(
        "--host",
        default=None,
        help="bind address (default 127.0.0.1, or --ifname's address); 0.0.0.0 (or ::) binds "
        "every interface, and each replica is then told the store address it reached the "
        "coordinator at",
    )
    serve.add_argument(
        "--advertise",
        default=None,
        metavar="HOST",
        help="the store address given to every replica (default: the bound address; bound to "
        "0.0.0.0, the address each replica reached the coordinator at)",
    )
    serve.add_argument(
        "--ifname",
        default=None,
        metavar="IF",
        help=f"bind to this network interface's IPv4 address when --host is not given (default: "
        f"${IFNAME_ENV}, else ${GLOO_IFNAME_ENV}; neither: 127.0.0.1)",
    )
    serve.add_argument(
        "--port", type=int, default=29400, help="port for replicas and relays (default 29400)"
    )
    serve.add_argument(
        "--keep-serving",
        action="store_true",
        help="stay up after the run finished (default: exit with status 0 "
        f"{FINISHED_LINGER_S:g} s after every replica left at the last step; the local launcher "
        "stops its own coordinator)",
    )
    serve.add_argument(
        "--nice",
        type=int,
        default=None,
        metavar="N",
        help="run at this nice value, the process's and (under the kernel's autogroup "
        "scheduling) its session's: every reply is on some step's critical path, so a "
        "coordinator that shares cores with replicas answers sooner above them (the local "
        "launcher passes -10; a negative value needs root or CAP_SYS_NICE, and where refused "
        "the coordinator runs as started; default: as started)",
    )
    serve.add_argument("--store-port", type=int, default=0, help="TCPStore port (0: any)")
    serve.add_argument(
        "--no-store",
        action="store_true",
        help="host no torch TCPStore (load tests and tools that build no process groups)",
    )
    serve.add_argument(  # required, from the flag, the job file or --options
        "--replicas", type=int, default=None, help="replicas expected at start (required)"
    )
    # Every setting of the run (recover.coordinator.options), declared once there; absent from
    # the parsed flags unless said (so --options fills them, and the field's default after it).
    add_flags(serve.add_argument_group("the run's settings"), CoordinatorOptions,
              keep_defaults=False)  # fmt: skip
    serve.add_argument(
        "--options",
        default=None,
        metavar="JSON",
        help="the run's settings as one JSON object of CoordinatorOptions' fields (what a local "
        "launcher hands its coordinator); flags said as well override it, and what neither "
        "says keeps its default",
    )
    serve.add_argument("--token", default=None, help=f"shared secret (default: ${TOKEN_ENV})")
    serve.add_argument("--events", default=None, metavar="PATH", help="append decisions here")
    serve.add_argument("--address-file", default=None, help="write host/ports here when up")
    serve.add_argument(
        "--state",
        default=None,
        metavar="etcd://HOST:PORT[,HOST:PORT...][/PREFIX]",
        help="keep the state in etcd (one PREFIX per run; default /recover/default) and lead by "
        "etcd election: start the same command on another host (its own --port) for a standby "
        "that takes over when this one dies or stalls (default: in memory, no standby)",
    )
    serve.add_argument(
        "--leader-ttl",
        type=int,
        default=1,
        help="with --state: the leader's etcd lease in whole seconds; a standby takes over this "
        "long after the leader stops renewing it (etcd raises it to its minimum, 1.5 election "
        "timeouts: 2 s with etcd's defaults; default 1)",
    )
    serve.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="the least severe lines shown: debug, info (the decisions; default), warning, error",
    )

    relay = sub.add_parser(
        "relay",
        help="hold the sessions, leases and long-polls of a node's or a rack's replicas",
        description="A relay speaks to replicas exactly as the coordinator does (point "
        "--coordinator of a replica at it) and sends the coordinator only membership changes "
        "and batched done reports. If it dies, the coordinator declares its replicas dead.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    relay.add_argument(
        "--upstream", required=True, metavar="HOST:PORT", help="the coordinator's address"
    )
    relay.add_argument("--host", default="127.0.0.1", help="bind address for replicas")
    relay.add_argument("--port", type=int, default=29401, help="port for replicas (0: any)")
    relay.add_argument(
        "--beat",
        type=float,
        default=0.25,
        help="seconds the coordinator may hold the relay's beat (its lease runs from each reply)",
    )
    relay.add_argument(
        "--batch",
        type=float,
        default=0.01,
        help="seconds a done report may wait for the relay's other replicas' reports",
    )
    relay.add_argument(
        "--relay-id", default=None, help="name in the coordinator's logs (None: a random one)"
    )
    relay.add_argument("--token", default=None, help=f"shared secret (None: ${TOKEN_ENV})")
    relay.add_argument("--address-file", default=None, help="write host/port here when up")

    status = sub.add_parser("status", help="print members, epoch, step and recent decisions")
    status.add_argument(
        "--addr",
        default=None,
        metavar="HOST:PORT",
        help=f"the coordinator's address (default: ${COORDINATOR_ENV}; for a local run, "
        "`recover status RUN` finds it in the run folder)",
    )
    status.add_argument("--token", default=None, help=f"shared secret (default: ${TOKEN_ENV})")
    status.add_argument("--decisions", type=int, default=20, help="how many recent decisions")
    status.add_argument("--json", action="store_true", help="print the raw status reply")
    return p


def _parse_addr(addr: str, flag: str = "--addr") -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{flag} must be HOST:PORT, got {addr!r}")
    return host, int(port)


def _shares(view: dict[str, Any]) -> dict[str, int]:
    """replica id (a string) -> microbatches it holds in the current attempt's plan."""
    runs = view.get("plan_runs") or {}
    return {
        r: sum(b - a for a, b in zip(flat[::2], flat[1::2], strict=True))
        for r, flat in runs.items()
    }


def format_status(
    reply: dict[str, Any], n_decisions: int, *, tokens_per_microbatch: int | None = None
) -> str:
    """The status reply for people; `tokens_per_microbatch` (known from a run folder) adds each
    member's throughput in tokens/s."""
    v = reply["view"]
    shares = _shares(v)
    lines = [
        f"status {v['status']} | epoch {v['epoch']} | step {v['step']} | committed "
        f"{v['committed_step']} | attempt epoch {v['attempt_epoch']} | live {v['live']} | "
        f"pending {v.get('pending', [])}",
        f"reason: {v.get('reason', '')}",
        "members:",
    ]
    for m in reply["members"]:
        how = f" ({m['how']})" if m.get("how") else ""
        tp = "" if m.get("throughput") is None else f" | {m['throughput']:.2f} microbatches/s"
        if tp and tokens_per_microbatch:
            tp += f" ({m['throughput'] * tokens_per_microbatch:,.0f} tokens/s)"
        share = shares.get(str(m["replica_id"]))
        held = "" if share is None else f" | share {share} microbatches"
        lines.append(
            f"  replica {m['replica_id']:>4} {m['state']:<7}{how} | lease age "
            f"{m['lease_age_s']:.3f} s | incarnation {m['incarnation'][:8]}{held}{tp}"
        )
    notable = reply.get("notable") or []
    if notable:  # deaths, redos, joins, epochs first: routine commits would hide them
        now = time.time()
        lines.append(f"last {min(n_decisions, len(notable))} events (deaths, redos, joins, views):")
        for d in notable[-n_decisions:]:
            age = f"{now - d['t_wall']:.0f} s ago" if "t_wall" in d else ""
            lines.append(f"  {d['decision']:<14} {age:>9}  {d['reason']}")
    lines.append(f"last {n_decisions} decisions:")
    for d in reply["decisions"][-n_decisions:]:
        lines.append(f"  {d['decision']:<14} {d['reason']}")
    return "\n".join(lines)


def run_coordinator_cli(args: argparse.Namespace) -> int:
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    if args.coordinator_command == "serve":
        try:
            options = serve_options(args)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        prefix = process_prefix("coordinator", os.environ)
        setup_logging(args.log_level, prefix=prefix, timestamps=True)
        if getattr(args, "resolved_job", None) is not None:  # (recover.cli.parse_args)
            log.debug("job: %s", json.dumps(args.resolved_job, sort_keys=True))
        try:
            host = bind_host(args.host, args.ifname, os.environ)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if not is_loopback(host) and host != "localhost" and token is None:
            log.warning(f"warning: serving on {host} without a token; set --token or {TOKEN_ENV}")
        if args.nice is not None and (refused := set_nice(args.nice)) is not None:
            log.debug("--nice %d not applied: %s", args.nice, refused)
        return run_coordinator_process(
            options,
            host=host,
            advertise=args.advertise,
            port=args.port,
            store_port=None if args.no_store else args.store_port,
            exit_when_finished=not args.keep_serving,
            token=token,
            events_path=args.events,
            address_file=args.address_file,
            state=args.state,
            leader_ttl_s=args.leader_ttl,
        )
    if args.coordinator_command == "relay":
        setup_logging("info", prefix=process_prefix("relay", os.environ), timestamps=True)
        try:
            upstream = _parse_addr(args.upstream, "--upstream")
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return run_relay_process(
            upstream,
            host=args.host,
            port=args.port,
            token=token,
            relay_id=args.relay_id,
            beat_s=args.beat,
            batch_s=args.batch,
            address_file=args.address_file,
        )
    addr = args.addr or os.environ.get(COORDINATOR_ENV)
    if not addr:
        print(f"error: --addr HOST:PORT (or ${COORDINATOR_ENV}) is required", file=sys.stderr)
        return 2
    try:
        host, port = _parse_addr(addr)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        reply = request_once(host, port, {"kind": "status"}, token=token)
    except CoordinatorUnreachable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not reply.get("ok"):
        print(f"error: refused ({reply.get('code')}): {reply.get('reason')}", file=sys.stderr)
        return 2
    print(json.dumps(reply, indent=2) if args.json else format_status(reply, args.decisions))
    return 0


def serve_options(args: argparse.Namespace) -> CoordinatorOptions:
    """The run's settings of `serve`'s flags: --options, then the flags said (or set by the job
    file) over it, then the defaults. ValueError naming the flag, or saying that M is the
    replicas' to declare (M is not a setting: every replica declares it when it registers)."""
    said = given(CoordinatorOptions, args)
    if args.replicas is not None:
        said["expected_replicas"] = args.replicas
    return CoordinatorOptions.from_settings(args.options or "{}", **said)


def bind_host(host: str | None, ifname: str | None, environ: Mapping[str, str]) -> str:
    """Where `coordinator serve` binds: --host; else the IPv4 address of --ifname (else
    RECOVER_IFNAME, else GLOO_SOCKET_IFNAME; the first interface of a list); else 127.0.0.1.
    ValueError naming the flag for both flags at once or an interface without an address."""
    if host is not None:
        if ifname is not None:
            raise ValueError("give --host or --ifname, not both")
        return host
    asked = InterfaceChoice.from_environ(environ, ifname)
    if not asked.names:
        return "127.0.0.1"
    address = interface_ipv4(asked.names[0])
    if address is None:
        raise ValueError(
            f"{asked.source} names interface {asked.names[0]!r}, which has no IPv4 address on "
            "this host: set --host (an address, or 0.0.0.0) or another interface"
        )
    log.info("binding %s, the address of interface %s (%s)", address, asked.names[0], asked.source)
    return address


# Seconds `coordinator serve` stays up after the run finished, answering late requests.
FINISHED_LINGER_S = 2.0


def set_nice(nice: int) -> str | None:
    """Run this process at nice value `nice` (before it starts threads: they inherit it), and
    its session too where the kernel schedules sessions as groups (autogroup: there a nice
    value orders only the threads of one session, and each of a local job's processes has its
    own). Returns why it was refused (a negative value needs CAP_SYS_NICE), or None."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        group = Path("/proc/self/autogroup")
        if group.exists():
            group.write_text(f"{nice}\n")
    except OSError as e:
        return e.strerror or str(e)
    return None


def run_coordinator_process(
    options: CoordinatorOptions | dict[str, Any],
    *,
    host: str = "127.0.0.1",
    advertise: str | None = None,
    port: int = 0,
    store_port: int | None = 0,
    token: str | None = None,
    events_path: str | None = None,
    address_file: str | None = None,
    state: str | None = None,
    leader_ttl_s: int = 1,
    exit_when_finished: bool = False,
) -> int:
    """Serve until SIGTERM/SIGINT, or (`exit_when_finished`, without `state`) until
    FINISHED_LINGER_S after the run finished. Usable as a multiprocessing target or a subprocess
    main.

    When listening, writes {"host", "port", "store_host", "store_port", "pid"} (and "term" with
    `state`) to `address_file` atomically (write then rename), so a parent can poll for it.
    With `state` (etcd://...), it leads only while elected and stands by otherwise
    (`_serve_ha`).
    """
    if isinstance(options, dict):
        options = CoordinatorOptions(**options)
    if state is not None:
        from recover.coordinator.etcd import parse_state_url  # noqa: PLC0415

        try:
            url = parse_state_url(state)
        except ValueError as e:
            log.error("error: %s", e)
            return 2
        if not is_int(leader_ttl_s) or leader_ttl_s < 1:
            log.error("error: --leader-ttl must be an int >= 1, got %r", leader_ttl_s)
            return 2
    if store_port is not None:  # torch only when a TCPStore is hosted
        try:
            import torch  # noqa: PLC0415 - only to keep this process to one thread

            torch.set_num_threads(1)
        except ImportError:
            pass
    from recover.coordinator.server import CoordinatorServer

    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    if state is not None:
        serve = dict(
            host=host, port=port, store_port=store_port, token=token, advertise=advertise,
        )  # fmt: skip
        return _serve_ha(options, url, leader_ttl_s, serve, events_path, address_file, stop)
    server = CoordinatorServer(
        options, host=host, port=port, store_port=store_port, token=token,
        events_path=events_path, advertise=advertise,
    )  # fmt: skip
    try:
        server.start()
    except RecordUnwritable as e:  # a read-only or full run folder: one line, not a traceback
        log.error("error: %s", e)
        return exits.STORAGE
    try:
        if address_file is not None:
            store = server.store_address or (None, None)
            info = {
                "host": server.address[0],
                "port": server.address[1],
                "store_host": store[0],
                "store_port": store[1],
                "pid": os.getpid(),
            }
            _write_address(address_file, info)
        log.info("coordinator listening on %s:%s%s", *server.address, _store_line(server))
        finished_at = None
        while not stop.wait(0.2):
            if server.failed is not None:
                # (a record it could not write: it said so in one line, and stopped the run)
                return exits.STORAGE if isinstance(server.failed, RecordUnwritable) else 1
            if exit_when_finished and finished_at is None and server.state().status == "finished":
                finished_at = time.monotonic()  # late requests (a last heartbeat) still answered
            if finished_at is not None and time.monotonic() - finished_at >= FINISHED_LINGER_S:
                log.info("the run finished (every replica left): the coordinator stops")
                return 0
        return 0
    finally:
        server.stop()


def _serve_ha(
    options: CoordinatorOptions,
    url: Any,
    ttl_s: int,
    serve: dict[str, Any],
    events_path: str | None,
    address_file: str | None,
    stop: threading.Event,
) -> int:
    """Stand by until elected; lead (serve the state taken from etcd, under the new term) until
    stopped, deposed (superseded or out of lease: then stand by again) or failed."""
    import socket  # noqa: PLC0415

    from recover.coordinator.election import Election  # noqa: PLC0415
    from recover.coordinator.etcd import EtcdClient, EtcdStateStore  # noqa: PLC0415
    from recover.coordinator.server import CoordinatorServer  # noqa: PLC0415

    identity = f"{socket.gethostname()}:{os.getpid()}"
    log.info("coordinator %s: state in %s", identity, url)
    while not stop.is_set():
        election = Election(EtcdClient(url.endpoints), url.prefix, identity=identity, ttl_s=ttl_s)
        term = election.campaign(stop)
        if term is None:
            return 0
        store = EtcdStateStore(EtcdClient(url.endpoints), url.prefix)
        store.fence(term)
        server = CoordinatorServer(
            options, **serve, events_path=events_path, state_store=store, term=term,
            authority=election.holds,
        )  # fmt: skip
        try:
            server.start()
        except Exception as e:  # etcd lost while loading, a port taken, options differ
            log.error("term %d could not start serving: %s", term, e)
            election.resign()
            if isinstance(e, ValueError):  # the stored run is another (options differ)
                return 1
            stop.wait(1.0)
            continue
        # the keep-alive stops when the loop stops ticking: a stalled leader lets its lease go
        election.alive = lambda s=server: time.monotonic() - s.last_tick < ttl_s
        store_host, store_port = server.store_address or (None, None)
        info = {"host": server.address[0], "port": server.address[1]}
        info.update(store_host=store_host, store_port=store_port, term=term, pid=os.getpid())
        election.publish(info)
        if address_file is not None:
            _write_address(address_file, info)
        log.info(
            "coordinator of term %d listening on %s:%s%s", term, *server.address,
            _store_line(server),
        )  # fmt: skip
        while not stop.wait(0.1):
            if server.failed is not None or server.deposed is not None:
                break
        server.stop()
        if server.failed is not None:
            election.resign()
            return 1
        if stop.is_set():
            election.resign()
            return 0
        log.warning("term %d ended (%s); standing by", term, server.deposed)
    return 0


def _store_line(server: Any) -> str:
    """How the log line names the store's address (a wildcard: per replica)."""
    store = server.store_address
    if store is None:
        return ""
    if is_wildcard(store[0]):
        return f"; store on port {store[1]}, given to each replica at the address it reached"
    return f"; store given as {store[0]}:{store[1]}"


def _write_address(path: str, info: dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


def run_relay_process(
    upstream: tuple[str, int],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    relay_id: str | None = None,
    beat_s: float = 0.25,
    batch_s: float = 0.01,
    address_file: str | None = None,
) -> int:
    """Relay until SIGTERM/SIGINT, or until the coordinator is lost (exit code 1). Writes
    {"host", "port", "relay_id", "pid"} to `address_file` when listening."""
    from recover.coordinator.relay import RelayServer

    relay = RelayServer(
        upstream,
        host=host,
        port=port,
        token=token,
        relay_id=relay_id,
        beat_s=beat_s,
        batch_s=batch_s,
    )
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    relay.start()
    try:
        if address_file is not None:
            info = {"host": relay.address[0], "port": relay.address[1]}
            _write_address(address_file, {**info, "relay_id": relay.relay_id, "pid": os.getpid()})
        log.info(
            "relay %s listening on %s:%s, upstream %s:%s", relay.relay_id, *relay.address, *upstream
        )
        while not stop.wait(0.2):
            if relay.failed is not None:
                return 1
        return 0
    finally:
        relay.stop()


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m recover.coordinator.cli coordinator status ...`)."""
    parser = argparse.ArgumentParser(prog="recover")
    add_coordinator_parser(parser.add_subparsers(dest="command", required=True))
    return run_coordinator_cli(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
