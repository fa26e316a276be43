"""A private, single-member etcd for one machine: `recover train --coordinators 2` and tests.

Job: find the etcd binary, start it on 127.0.0.1 with two free ports and a data directory the
caller names, wait until it answers, and stop it (SIGTERM, then SIGKILL, reaped by pid).

It runs with a 50 ms heartbeat and a 500 ms election timeout: etcd refuses leases shorter than
1.5 election timeouts, so this gives 1 s leases (the default 1 s election timeout would give
2 s), and a one-member cluster has no elections to slow down.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from recover.coordinator.etcd import EtcdClient, EtcdUnavailable

__all__ = ["LocalEtcd", "find_etcd", "start_local_etcd"]


def find_etcd() -> str | None:
    """The etcd server binary (PATH, then /usr/bin/etcd of Debian's etcd-server), or None."""
    found = shutil.which("etcd")
    if found:
        return found
    return "/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies, even by SIGKILL
    (Linux prctl PR_SET_PDEATHSIG), so that a killed launcher leaves no etcd behind."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: stop() still ends it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]  # AF_INET: (host, port)
        return port


@dataclass
class LocalEtcd:
    proc: subprocess.Popen[bytes]
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    @property
    def endpoints(self) -> tuple[tuple[str, int], ...]:
        return (("127.0.0.1", self.client_port),)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; always reaped."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)


def start_local_etcd(
    data_dir: str | os.PathLike[str], *, binary: str | None = None, timeout_s: float = 15.0,
    client_port: int = 0, peer_port: int = 0,
) -> LocalEtcd:  # fmt: skip
    """Start etcd with its data in `data_dir`; returns once it answers requests.

    Ports 0 pick free ones (restart an etcd as it was by passing its ports and data dir again).
    Raises FileNotFoundError without an etcd binary, RuntimeError if it does not come up."""
    binary = binary or find_etcd()
    if binary is None:
        raise FileNotFoundError(
            "no etcd binary found (install Debian's etcd-server: apt-get install etcd-server)"
        )
    data = Path(data_dir)
    data.mkdir(parents=True, exist_ok=True)
    port, peer = client_port or _free_port(), peer_port or _free_port()
    log_path = data / "etcd.log"
    cmd = [
        binary,
        "--name", "recover",
        "--data-dir", str(data / "member-data"),
        "--listen-client-urls", f"http://127.0.0.1:{port}",
        "--advertise-client-urls", f"http://127.0.0.1:{port}",
        "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"recover=http://127.0.0.1:{peer}",
        "--heartbeat-interval", "50",
        "--election-timeout", "500",
    ]  # fmt: skip
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
    etcd = LocalEtcd(proc=proc, client_port=port, peer_port=peer, data_dir=data, log_path=log_path)
    client = EtcdClient(etcd.endpoints, timeout_s=1.0)
    end = time.monotonic() + timeout_s
    try:
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-800:]
                raise RuntimeError(f"etcd exited with status {proc.returncode}: {tail}")
            try:
                client.get("/recover/ping")
                return etcd
            except (EtcdUnavailable, ValueError):
                if time.monotonic() > end:
                    raise RuntimeError(f"etcd did not answer within {timeout_s} s") from None
                time.sleep(0.05)
    except BaseException:
        etcd.stop()
        raise
    finally:
        client.close()
