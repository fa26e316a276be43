"""The local launcher: `recover train --replicas R` and `recover run` on one machine.

Job: write the run folder's config, start the job's coordinators (recover.launch.coordinators) and
R replica processes, prefix their output with `[replica r]`, keep warm standbys
(recover.launch.standbys), wake hung replicas whose fault says `wake_after`, and reap every child
on exit, on error and on Ctrl-C (no orphans, ever). The exit status says whether training
succeeded.

Supervision rules:
- a replica that exits is reaped at once; its death is already known to the coordinator (its
  session connection dropped), so the launcher only records it;
- the run succeeded when a replica finished (exit 0: every step committed), no replica reported
  a run failure (quorum lost, divergence), and the run record holds every step with all M
  microbatches; a replica that died on the way (injected fault or not) is listed, not a failure;
- a replica whose fault is `hang` is left stopped unless `wake_after=S`: the launcher sends
  SIGCONT S seconds after it sees the process stopped (the process is then fenced and exits);
- a scheduled fault fires once per run: a new process of a replica (a respawn, a promoted standby,
  a restarted job, a resumed run) gets only its faults that are not in RUN/faults.fired, where
  each process records its fault before the fault acts (recover.runtime.faults);
- the coordinator's death ends the run, without stopping anyone: the replicas wait for it for
  their grace (--coordinator-grace), then the lowest saves the last committed step and each
  exits (status 11); the launcher lets them, then names the command that resumes the run.

It must not touch the trajectory: it only starts, watches and stops processes.

Size: one local launcher for both `recover train` and `recover run` (they differ in the replica's
command and environment only): the run's start and end, the supervision loop, respawns, stops and
the verdict, which all read the same process table and record.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import TextIO

from recover import exits
from recover.launch.config import (
    COORDINATOR_FILE,
    FIRED_FILE,
    JOB_FILE,
    TOKEN_FILE,
    LaunchConfig,
)
from recover.launch.coordinators import CoordinatorFleet
from recover.launch.standbys import StandbyPool
from recover.logs import replica_name
from recover.record import MetricsWriter, RecordUnwritable, committed_steps, read_metrics
from recover.runtime.env import (
    ReplicaEnv,
)
from recover.runtime.faults import FaultSpec, fault_flag, faults_for, read_fired
from recover.supervisor import RECOVER as _RECOVER
from recover.supervisor import (
    ProcessHost,
    ReplicaSupervisor,
    describe_exit,
    end_politely,
    free_ports,
    is_stopped,
    proc_name,
)
from recover.training.config import TRAIN_CONFIG_ENV, RunPaths, TrainConfig
from recover.training.runfolder import LOCK_FILE, RunFolderError, lock_run_folder, open_run_folder

# How often the supervising loop looks at what no event wakes it for (a hang fault's wake-up, a
# finished run's stopped processes, standbys); a child's end wakes it at once.
SUPERVISE_PERIOD_S = 0.1
RESTART = -1000  # _supervise's answer in checkpoint-restart mode: restart the whole job

log = logging.getLogger(__name__)


def _steps_text(steps: list[int]) -> str:
    shown = ", ".join(str(s) for s in steps[:10])
    return shown + (f" (and {len(steps) - 10} more)" if len(steps) > 10 else "")


class LocalLauncher(ProcessHost):
    def __init__(
        self,
        cfg: TrainConfig,
        lcfg: LaunchConfig,
        *,
        data: Path,
        out: Path,
        resume: bool,
        data_info: dict,
        console: TextIO | None = sys.stdout,
        token: str | None = None,
    ) -> None:
        # The shared token: the caller's (RECOVER_TOKEN, read by the CLI), so that hand-started
        # workers can join; else a fresh random one for this run.
        super().__init__(console=console, token=token or secrets.token_hex(16))
        self.cfg, self.lcfg = cfg, lcfg
        self.data, self.paths, self.resume = data, RunPaths(out=out), resume
        self.data_info = data_info
        self._ports: list[int] = []  # drawn for the job's processes, handed out as they start
        self._killed_hung: list[tuple[int, int]] = []  # (replica, rank) killed after the end
        self._finished_seen = False  # the record holds this run's coordinator.finished
        self._record_read = 0  # how far _run_finished has read the record
        self.coordinators = CoordinatorFleet(self, lcfg, self.paths)
        self.standbys = StandbyPool(
            self,
            slots=lcfg.standby,
            command=[*_RECOVER, "worker", "--launched", "--standby", "--data", str(data),
                     "--out", str(out)],
            env=lambda host, port: self._replica_env(0, host, port),
            device_index=lcfg.replicas,
            pending_faults=self._pending_faults,
        )  # fmt: skip

    # What a warm start pre-imports: everything a replica process of `recover train` loads.
    # torch._dynamo: torch's optimizers import it lazily when constructed (1.6 s of CPU here), so
    # without it every replica process paid it again after its fork. recover.training.parallel:
    # the layouts of multi-rank replicas (FSDP2, tensor and pipeline parallel; cheap once
    # torch._dynamo is in). recover.cli:build_parser: the subcommands' parsers, which the CLI
    # imports only when it builds them (every replica's `recover worker` does); recover.launch:
    # a worker that stops early names the launcher's resume command.
    WARM_MODULES = (
        "torch",
        "torch.distributed",
        "torch._dynamo",
        "recover.cli:build_parser",
        "recover.launch",
        "recover.training.worker",
        "recover.training.parallel",
        "recover.coordinator.cli",
        "recover.coordinator.server",
    )

    def _start_zygote(self) -> None:
        """The zygote's import overlaps the coordinator's start; it runs with the run folder on
        its command line, as its children do (they share its command line)."""
        if self.lcfg.warm_start:
            self.start_zygote(str(self.paths.out), self.lcfg.preload)

    def _replica_command(self, r: int, host: str, port: int, *, fresh: bool) -> list[str]:
        """The command of every process of replica r: a `recover worker` of the built-in
        trainer here (a script's command under `recover run`: ScriptLauncher). The job itself
        travels in the environment (`_replica_env`), as objects, not as flags."""
        argv = [
            *_RECOVER, "worker", "--launched", "--data", str(self.data),
            "--out", str(self.paths.out),
        ]  # fmt: skip
        if self.resume and not fresh:
            argv.append("--resume")
        return argv

    def _replica_env(self, r: int, host: str, port: int) -> dict[str, str]:
        """Variables every process of replica r gets besides the rank ones: who it is, the
        replica spec and its faults not fired yet (ReplicaEnv), and the run's TrainConfig."""
        env = ReplicaEnv(
            coordinator=(host, port), replica_id=r, faults=tuple(self._pending_faults(r)),
            fired=self.fired_file, spec=self.lcfg.replica, standbys=self.coordinators.standbys,
        ).to_environ()  # fmt: skip
        return {**env, TRAIN_CONFIG_ENV: self.cfg.to_json()}

    def _start_replica(self, r: int, host: str, port: int, *, fresh: bool = False) -> None:
        """Start replica r. `fresh` (a respawn) joins the running job without --resume: its
        state comes from a live replica by transfer. Every incarnation gets the faults of its
        replica that have not fired yet (a schedule of several failures outlives a restart)."""
        if fresh:  # reaped already; the slots get the new processes
            for k in range(self.lcfg.ranks):
                self.children.pop(proc_name(r, k))
        command = self._replica_command(r, host, port, fresh=fresh)
        base = self._replica_env(r, host, port)
        ranks = self.lcfg.ranks
        if ranks == 1:  # (on GPUs: replica r takes GPU r, modulo the GPUs there are)
            env = {**base, "RECOVER_DEVICE_INDEX": str(r)}
            self.spawn(f"replica {r}", command, f"[replica {r}] ", env)
            return
        # A replica of several ranks: one process per rank, with the variables torchrun would
        # give them; rank 0 hosts the replica's own store on a fresh port.
        master_port = (self._ports or free_ports(1)).pop()  # rank 0 hosts the store there
        for k in range(ranks):
            env = {
                **base,
                "RANK": str(k), "LOCAL_RANK": str(k), "WORLD_SIZE": str(ranks),
                "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master_port), "RECOVER_DEVICE_INDEX": str(r * ranks + k),
            }  # fmt: skip
            self.spawn(proc_name(r, k), command, f"[{replica_name(r, k, ranks)}] ", env)

    @property
    def fired_file(self) -> Path:
        """RUN/faults.fired: where every replica process records its fault before it acts."""
        return self.paths.out / FIRED_FILE

    def _pending_faults(self, r: int) -> list[FaultSpec]:
        """Faults of replica r that have not fired yet: those not in `fired_file`. A `slow` one
        never fires once: every incarnation from its step on is slow."""
        fired = read_fired(self.fired_file)
        return [
            f
            for f in faults_for(list(self.lcfg.faults), r)
            if f.kind == "slow" or fault_flag(f) not in fired
        ]

    def _open_run_folder(self) -> None:
        lc = self.lcfg
        open_run_folder(
            self.paths,
            self.cfg,
            data_info=self.data_info,
            resume=self.resume,
            launch={"mode": lc.mode, "replicas": lc.replicas, "min_replicas": lc.min_replicas,
                    "faults": [fault_flag(f) for f in lc.faults],
                    "replica": json.loads(lc.replica.to_json())},  # (recover train --config)
        )  # fmt: skip

    def run(self) -> int:
        lc = self.lcfg
        # One live launcher per run folder, for the whole job (released when this process ends).
        out = self.paths.out
        fresh = not out.exists()
        new_lock = not (out / LOCK_FILE).exists()
        self._lock_fd = lock_run_folder(out)
        try:
            self._open_run_folder()
        except RunFolderError:  # refused: leave the folder as it was found
            os.close(self._lock_fd)
            if new_lock:
                (out / LOCK_FILE).unlink(missing_ok=True)
            if fresh and not any(out.iterdir()):
                out.rmdir()
            raise
        if not self.resume:  # a new job: none of its faults has fired (the file comes with one)
            self.fired_file.unlink(missing_ok=True)
        self._write_token()
        self.writer = MetricsWriter(self.paths.metrics)
        self._record_read = self.paths.metrics.stat().st_size  # (a resumed job's history)
        self.writer.event("launcher.started", mode=lc.mode, replicas=lc.replicas)

        def on_sigterm(signum, frame):  # `kill LAUNCHER` reaps the run just like Ctrl-C
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, on_sigterm)
        code = 1
        try:
            self._start_zygote()
            restarts = 0
            while True:
                code = self._run_job()
                if code != RESTART:
                    return code
                # checkpoint-restart: what TorchElastic does on a failure. Every process goes,
                # a fresh job starts from the last checkpoint with all R replicas.
                self.reap_all()
                restarts += 1
                if restarts > lc.max_restarts:
                    self.say(
                        f"training failed: more than {lc.max_restarts} restarts", logging.ERROR
                    )
                    code = 1
                    return code
                self.writer.event("launcher.restarted", restart=restarts)
                self.say(f"restarting the whole job from its last checkpoint (restart {restarts})")
                self.resume = True
                self.children.clear()
        except KeyboardInterrupt:
            code = 130
            try:
                self.say("interrupted: every replica stops at its next step boundary")
                self._stop_replicas()
            except KeyboardInterrupt:  # a second signal: no more waiting
                self.say("interrupted again: stopping every process now")
            # What to do next is said even with --quiet: it is the outcome the user acts on.
            self.say(f"stopped: {self._resume_hint()}", logging.WARNING)
            return code
        finally:
            signal.signal(signal.SIGTERM, previous)
            self.reap_all()
            self.coordinators.stop()
            self.close_host()
            # The address of a coordinator that is gone would mislead `recover status`.
            (self.paths.out / COORDINATOR_FILE).unlink(missing_ok=True)
            (self.paths.out / TOKEN_FILE).unlink(missing_ok=True)
            try:
                self.writer.event("launcher.finished", exit_status=code)
            except RecordUnwritable:  # (said already by whoever could not write first)
                pass
            self.writer.close()

    def _write_token(self) -> None:
        """The run's token in RUN/coordinator.token, mode 0600 from its creation (for `recover
        status RUN`); replaced atomically, so no reader sees a partial one."""
        path = self.paths.out / TOKEN_FILE
        tmp = path.with_name(f"{TOKEN_FILE}.tmp{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # (a leftover temporary keeps its mode through O_TRUNC)
            os.write(fd, self.token.encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def _run_job(self) -> int:
        # Every port the job's processes will bind, drawn at once, so that no two of them are
        # handed the same one (a port probed and released can be handed out again at once).
        self._ports = free_ports(
            self.lcfg.coordinators + (self.lcfg.replicas if self.lcfg.ranks > 1 else 0)
        )
        host, port = self.coordinators.start(self._ports)
        self.coordinator_address = (host, port)
        self.say(f"coordinator at {host}:{port}; starting {self.lcfg.replicas} replicas")
        for r in range(self.lcfg.replicas):
            self._start_replica(r, host, port)
        for _ in range(self.lcfg.standby):
            self.standbys.start(host, port)
        return self._supervise()

    def _supervise(self) -> int:
        """Watch the replicas until every one has ended; respawn the dead if asked to (the
        restart rule is recover.supervisor's, shared with the node agent)."""
        lc = self.lcfg
        sup = ReplicaSupervisor(
            lc.ranks,
            lc.respawn_delay_s,
            lc.max_restarts,
            lambda r, k: self.children[proc_name(r, k)],
        )
        for r in range(lc.replicas):
            sup.hosting(r)
        stopped_since: dict[tuple[int, int], float] = {}
        wake = {(f.replica, f.rank): f.wake_after for f in lc.faults if f.kind == "hang"}
        finishing = False  # a replica finished: the run is ending, nobody is respawned
        while sup.running():
            coordinator = self.children["coordinator"]
            if all(  # with standbys (--coordinators N), the run goes on while one is left
                p.poll() is not None for n, p in self.children.items() if n.startswith("coord")
            ):
                return self._coordinator_lost(coordinator.returncode)
            self.coordinators.restart_dead(finishing)
            now = time.monotonic()
            for d in sup.reap():
                # A finished replica, or a run stopped for good (quorum lost, divergence):
                # nobody is respawned any more. But under checkpoint-restart every death ends
                # the job as quorum lost (min_replicas = R): that is the job to restart, seen
                # before the death itself when the survivors' exits are read first.
                job_lost = lc.mode == "checkpoint-restart" and d.code == exits.QUORUM_LOST
                finishing = (
                    finishing or d.code == 0 or (d.code in exits.RUN_FAILURES and not job_lost)
                )
                if d.code == 0:
                    continue
                who = f"replica {d.replica}" + (f" rank {d.rank}" if lc.ranks > 1 else "")
                self.say(f"{who} exited with status {d.code}", logging.WARNING)
                if not d.first:
                    continue
                if lc.mode == "checkpoint-restart" and not finishing:
                    return RESTART
                sup.schedule(d.replica, now, finishing=finishing)
            for r, k in sup.running_ranks():
                key = (r, k)
                proc = self.children[proc_name(r, k)]
                if sup.incarnation[r] == 0 and wake.get(key) is not None and is_stopped(proc.pid):
                    since = stopped_since.setdefault(key, now)
                    if now - since >= wake[key]:
                        who = f"replica {r}" + (f" rank {k}" if lc.ranks > 1 else "")
                        self.say(f"waking {who} (SIGCONT) after {wake[key]:g} s stopped")
                        proc.send_signal(signal.SIGCONT)
                        wake[key] = None
            if finishing:
                sup.cancel_restarts()
            for r in sup.due(now):
                restart = sup.incarnation[r]
                if self.standbys.promote(r):
                    how = "standby"
                    self.say(f"replica {r} (restart {restart}) from a standby")
                else:
                    how = "spawn"
                    self.say(f"respawning replica {r} (restart {restart})")
                    self._start_replica(r, *self.coordinator_address, fresh=True)
                self.writer.event("launcher.respawned", replica=r, restart=restart, how=how)
                if how == "standby":  # a new standby behind the promoted one
                    self.standbys.start(*self.coordinator_address)
            if self.standbys.waiting:
                self.standbys.check(finishing, self.coordinator_address)
            if not sup.respawn_at:
                self._end_the_hung(sup.alive, sup.codes, wake)
            # A death wakes the loop at once; timers and hung replicas are looked at this often.
            # (At 50 looks a second the loop cost 7 ms of CPU a second, on a core the replicas
            # share.)
            due = [at - time.monotonic() for at in sup.respawn_at.values()]
            self.wait_for_change(min([SUPERVISE_PERIOD_S, *due]))
        self.standbys.retire()
        codes = sup.codes
        if not any(c == 0 for _, _, c in codes) and any(
            c == exits.COORDINATOR_LOST for _, _, c in codes
        ):
            return self._silent_coordinator(codes)
        return self._verdict(codes)

    def _silent_coordinator(self, codes: list[tuple[int, int, int]]) -> int:
        """The replicas stopped on a lost coordinator while its process lives on (frozen, or
        cut off from them, or its state store gone under --coordinators N): the run stopped as
        when the coordinator dies, status exits.COORDINATOR_LOST, with where the last committed
        state is and the command to continue."""
        ended = {f"replica {r}" + (f" (restart {i})" if i else ""): c for r, i, c in codes}
        self.writer.event("launcher.coordinator_lost", exit_status=None, replicas=ended)
        self.say(
            "stopped, the coordinator lost: the replicas heard nothing from it for "
            f"--coordinator-grace ({self.lcfg.replica.coordinator_grace_s:g} s) although its "
            f"process is alive; {self._lost_hint()}",
            logging.ERROR,
        )
        return exits.COORDINATOR_LOST

    def _verdict(self, codes: list[tuple[int, int, int]]) -> int:
        """The run's exit status, with one summary line when anything died or failed.

        0 when training succeeded: a replica finished (it exits 0 only once every step of the
        run committed), no replica reported a run failure (quorum lost, divergence), and the run
        record holds every step with all M microbatches (`_record_problems`). A replica that died
        on the way, from an injected fault or not (an external SIGKILL or SIGTERM, a fault in a
        respawned incarnation), does not fail a run whose every step committed: the summary line
        lists it. Otherwise 1, and the line says why. Also written as a `launcher.verdict` event."""
        deaths = list(dict.fromkeys(describe_exit(r, inc, c) for r, inc, c in codes if c != 0))
        problems = list(
            dict.fromkeys(
                f"replica {r}: {exits.RUN_FAILURES[c]}"
                for r, _, c in codes
                if c in exits.RUN_FAILURES
            )
        )
        if not any(c == 0 for _, _, c in codes):
            problems.append("no replica finished")
        problems += self._record_problems()
        unfired = self._unfired_faults()
        self.writer.event(
            "launcher.verdict", ok=not problems, problems=problems, deaths=deaths, unfired=unfired
        )
        if unfired:
            # Not a failed run (training went on as it should), but a drill that did not happen:
            # the replica was planned no such microbatch, or the run ended first.
            self.say(
                f"declared fault(s) that never fired: {', '.join(unfired)} (the replica computed "
                "no such microbatch at that step and phase, or the run ended before it): the run "
                "did not exercise them",
                logging.WARNING,
            )
        if problems:
            self.say("training failed: " + "; ".join(problems + deaths), logging.ERROR)
            return 1
        if deaths:
            self.say(
                "training succeeded: every step committed with all its microbatches; lost on the "
                "way: " + "; ".join(deaths)
            )
        return 0

    def _unfired_faults(self) -> list[str]:
        """The --fault texts of the declared faults no process recorded as fired (`slow` ones
        are never recorded: every step from theirs on is slow)."""
        fired = read_fired(self.fired_file)
        return [
            fault_flag(f)
            for f in self.lcfg.faults
            if f.kind != "slow" and fault_flag(f) not in fired
        ]

    def _record_problems(self) -> list[str]:
        """What the run record lacks: steps 0..steps-1 each with a step record summing all M
        microbatches (the shrink baseline sums fewer by design). Empty under `recover run`,
        whose script declares its own steps and M."""
        cfg = self.cfg
        if cfg is None:
            return []
        steps = committed_steps(self.paths.metrics) if self.paths.metrics.exists() else {}
        problems = []
        missing = [s for s in range(cfg.steps) if s not in steps]
        if missing:
            problems.append(f"no step record for step(s) {_steps_text(missing)}")
        if self.lcfg.mode != "shrink":
            short = [
                s
                for s, rec in sorted(steps.items())
                if s < cfg.steps and rec.get("microbatches") != cfg.microbatches
            ]
            if short:
                problems.append(
                    f"step(s) {_steps_text(short)} did not sum all {cfg.microbatches} microbatches"
                )
        return problems

    def _end_the_hung(self, alive: dict[int, set[int]], codes: list, wake: dict) -> None:
        """Once the run is over, no hang fault's wake-up is waited for: a process still stopped
        by one is SIGKILLed (it is fenced; its exit is then read like any other, so the verdict
        lists it). The run is over when the coordinator said so (`coordinator.finished`; the
        survivors may still be exiting: they wait for their groups with the stopped process to
        close), or when a replica finished and only stopped processes are left."""
        hung = [
            (r, k)
            for r, ranks in alive.items()
            for k in ranks
            if (r, k) in wake and is_stopped(self.children[proc_name(r, k)].pid)
        ]
        if not hung:
            return
        only_hung = sum(len(ranks) for ranks in alive.values()) == len(hung)
        if not (only_hung and any(c == 0 for _, _, c in codes)) and not self._run_finished():
            return
        for r, k in hung:
            if (r, k) in self._killed_hung:
                continue
            who = f"replica {r}" + (f" rank {k}" if self.lcfg.ranks > 1 else "")
            self.say(f"the run is over and {who} is still stopped by its hang fault: killed")
            self.children[proc_name(r, k)].kill()
            self._killed_hung.append((r, k))

    def _run_finished(self) -> bool:
        """Whether the run's record holds the coordinator's `coordinator.finished` (read on from
        where the last call stopped)."""
        if not self._finished_seen and self.writer.path.exists():
            with open(self.writer.path, "rb") as f:
                f.seek(self._record_read)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._record_read += end
            self._finished_seen = b"coordinator.finished" in data[:end]
        return self._finished_seen

    def _stop_replicas(self) -> None:
        """Ask every replica process to stop (SIGTERM: at its next step boundary the writer saves
        the committed state and it leaves; without a coordinator it saves and exits at once);
        wait for them up to the grace period. What is left is reaped by _reap_all."""
        replicas = [
            p for n, p in self.children.items() if not n.startswith("coord") and p.poll() is None
        ]
        for p in replicas:
            end_politely(p)
        deadline = time.monotonic() + self.lcfg.stop_grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in replicas):
            time.sleep(0.05)

    def _coordinator_lost(self, status: int) -> int:
        """The coordinator died: nothing commits any more. The replicas are not stopped: each
        waits for a coordinator for its grace (a standby may take over), then the lowest saves
        the last committed step and every one exits with exits.COORDINATOR_LOST. They get the
        grace and the stop grace (for the save); whoever is left after it is reaped."""
        grace = self.lcfg.replica.coordinator_grace_s
        storage = status == exits.STORAGE  # it stopped: it could not write the run's record
        self.say(
            (
                "the coordinator stopped: it cannot write the run's record (the run folder is "
                "full or read-only; its line says which)"
                if storage
                else f"the coordinator died (exit {status})"
            )
            + f": nothing commits; the replicas wait {grace:g} s for it (--coordinator-grace), "
            "then save the last committed step where they can and stop",
            logging.ERROR,
        )
        replicas = {n: p for n, p in self.children.items() if n.startswith("replica ")}
        deadline = time.monotonic() + grace + self.lcfg.stop_grace_s
        while time.monotonic() < deadline and any(p.poll() is None for p in replicas.values()):
            time.sleep(0.05)
        ended = {n: p.poll() for n, p in sorted(replicas.items())}  # None: still running (reaped)
        try:
            self.writer.event("launcher.coordinator_lost", exit_status=status, replicas=ended)
        except RecordUnwritable:
            storage = True
        if storage:
            self.say(
                f"stopped, the run folder cannot be written: {self._lost_hint()}", logging.ERROR
            )
            return exits.STORAGE
        self.say(f"stopped, the coordinator lost: {self._lost_hint()}", logging.ERROR)
        return exits.COORDINATOR_LOST

    def _lost_hint(self) -> str:
        """Where the last committed state is after a lost coordinator, and how to continue."""
        return self._resume_hint()

    def _resume_hint(self) -> str:
        saved = [
            rec for rec in read_metrics(self.paths.metrics) if rec.get("name") == "checkpoint_saved"
        ]
        if not saved:
            return "no checkpoint was saved; the run starts again from step 0"
        # A checkpoint is named by the steps it holds: "step" is the next to run.
        newest = max(saved, key=lambda rec: int(rec["step"]))
        return (
            f"the state after step {int(newest['step']) - 1} is checkpointed in "
            f"{newest['path']}; continue with: {train_resume_command(self.paths.out)}"
        )


def train_resume_command(out: Path) -> str:
    """The command that continues `recover train`'s run in `out` from its newest checkpoint:
    the job as its config.json describes it (recover.jobconfig), with --resume."""
    return shlex.join(
        ["recover", "train", "--config", str(out / "config.json"), "--out", str(out), "--resume"]
    )


class ScriptLauncher(LocalLauncher):
    """`recover run`: the same supervision over any training script that uses `recover.Replica`.

    A script run by this interpreter (`python SCRIPT ...`, `python -m MODULE ...`) is forked from
    the zygote like the built-in worker (warm start; `--cold-start`: exec'ed); any other command
    is exec'ed.

    Each process of replica r runs `command` with the job's variables (recover.runtime.env): the
    coordinator's address, its replica id, the token, its faults that have not fired yet, and
    the events file (the run folder's metrics.jsonl, where the coordinator writes too)."""

    WARM_MODULES = (
        "torch",
        "torch.distributed",
        "torch._dynamo",  # a script's optimizer imports it when built (see LocalLauncher's)
        "recover.cli:build_parser",
        "recover.launch",
        "recover.coordinator.cli",
        "recover.coordinator.server",
        "recover.runtime.api",
    )

    def __init__(
        self,
        command: list[str],
        lcfg: LaunchConfig,
        *,
        out: Path,
        console: TextIO | None = sys.stdout,
        token: str | None = None,
        job: dict | None = None,
    ) -> None:
        super().__init__(
            None, lcfg, data=Path(), out=out, resume=False, data_info={}, console=console,
            token=token,
        )  # fmt: skip
        if lcfg.standby:
            raise ValueError("--standby is for recover train (a script builds its own model)")
        self.command = list(command)
        self.job = job  # the resolved job file (recover.jobconfig.resolved_job), saved as job.json

    def _open_run_folder(self) -> None:
        self.paths.out.mkdir(parents=True, exist_ok=True)
        if self.job is not None:
            (self.paths.out / JOB_FILE).write_text(json.dumps(self.job, indent=2) + "\n")

    def _replica_command(self, r: int, host: str, port: int, *, fresh: bool) -> list[str]:
        return self.command

    def _resume_hint(self) -> str:
        return (
            "the replicas left at a step boundary (replica.stopped in the script); resume the "
            "script from what it saved"
        )

    def _lost_hint(self) -> str:
        return (
            "each replica's microbatches() raised recover.CoordinatorLost, holding the last "
            "committed state (its writer saves it if the script catches it, docs/api.md); resume "
            "the script from what it saved"
        )

    def _replica_env(self, r: int, host: str, port: int) -> dict[str, str]:
        spec = ReplicaEnv(
            coordinator=(host, port),
            standbys=self.coordinators.standbys,
            replica_id=r,
            faults=tuple(self._pending_faults(r)),
            fired=self.fired_file,
            events=self.paths.metrics,
            spec=self.lcfg.replica,
        )
        return spec.to_environ()  # (the token is added for every child by _spawn)
