"""Test-only fault injection for the worker daemon.

Enabled by the test entry point's `--test-fault SPEC` (daemon_cli.py; repeatable); off by default,
and with no flag nothing here is even instantiated. It lets tests hit a phase
of a request deterministically: delay or cut a reply, close the connection,
or stop/kill/exit the whole daemon at a chosen point.

SPEC is comma-separated key=value pairs, e.g.

    cmd=GRAPH_COMPUTE|GRAPH_RECOMPUTE,after=3,point=half,action=kill

  cmd=NAME[|NAME...]  commands that count (protocol Command names; * = any;
                      default *). PING and HELLO never reach this module;
                      STEP_INPUT (answered as soon as it is read) counts only
                      where a spec names it, and takes only action=fail
                      (cancellations pass uncounted).
  after=N             let N matching requests pass, fire on the next (default 0)
  times=N             fire on this many matching requests in a row (default 1;
                      0 = every one from then on)
  point=P             where in the request the fault fires:
                        request  when the request is taken up, before its handler
                        compute  while the handler runs (during the graph compute)
                        reply    after the handler, instead of the reply (default)
                        half     after the first half of the reply's bytes
  action=A            delay:S   wait S seconds, then go on (the event loop keeps
                                answering pings, as in a long compute; at
                                point=half reading is paused so no pong slips
                                into the half-sent frame)
                      close     close the connection (the daemon lives on)
                      cut       shorthand for point=half,action=close
                      exit      the daemon process exits at once (status 70)
                      kill      SIGKILL the compute process and the daemon
                      stop      SIGSTOP the daemon (SIGCONT resumes it)
                      fail      answer FAILED instead of the real reply
                      crash-compute  SIGKILL the compute process (point=compute)
  armed=0             start disarmed; SIGUSR1 arms every disarmed spec, and
                      counting (`after`) starts then. Default 1.

Every firing is logged as "test fault fired" with `at=<unix time>`, arming
as "test fault armed", so a test can wait for either in the daemon's log.

With fault specs in its config the daemon's app serves the connections of
faulty_connection.py, which call Fault.before() and Fault.send() around a
queued request's handler and Faults.refuse_now() for a command answered on the
spot; the production connection carries nothing of this.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass

import structlog

from rpc_daemon.wire import framing as F
from rpc_daemon.wire import protocol as P
from rpc_daemon.wire.protocol import Command, Status

log = structlog.get_logger("rpc")

POINTS = ("request", "compute", "reply", "half")
ACTIONS = ("delay", "close", "exit", "kill", "stop", "fail", "crash-compute")
EXIT_STATUS = 70


class FaultSpecError(ValueError):
    pass


@dataclass
class FaultSpec:
    cmds: frozenset | None  # None: any command
    after: int = 0
    times: int = 1
    point: str = "reply"
    action: str = "close"
    delay: float = 0.0
    armed: bool = True
    seen: int = 0
    fired: int = 0
    text: str = ""

    @classmethod
    def parse(cls, text: str) -> "FaultSpec":
        fields = {}
        for part in text.split(","):
            if not part.strip():
                continue
            key, sep, value = part.partition("=")
            if not sep:
                raise FaultSpecError(f"test fault {text!r}: {part!r} is not key=value")
            fields[key.strip()] = value.strip()
        unknown = set(fields) - {"cmd", "after", "times", "point", "action", "armed"}
        if unknown:
            raise FaultSpecError(f"test fault {text!r}: unknown keys {sorted(unknown)}")
        cmds = None
        if fields.get("cmd", "*") != "*":
            try:
                cmds = frozenset(int(Command[name.strip().upper()]) for name in fields["cmd"].split("|"))
            except KeyError as exc:
                raise FaultSpecError(f"test fault {text!r}: unknown command {exc}") from None
        action, _, arg = fields.get("action", "close").partition(":")
        point = fields.get("point", "reply")
        if action == "cut":
            action, point = "close", "half"
        if action not in ACTIONS:
            raise FaultSpecError(f"test fault {text!r}: action must be one of {ACTIONS + ('cut',)}")
        if point not in POINTS:
            raise FaultSpecError(f"test fault {text!r}: point must be one of {POINTS}")
        try:
            delay = float(arg) if action == "delay" else 0.0
            after, times = int(fields.get("after", 0)), int(fields.get("times", 1))
            armed = fields.get("armed", "1") not in ("0", "no", "false")
        except ValueError as exc:
            raise FaultSpecError(f"test fault {text!r}: {exc}") from None
        if action == "fail" and point not in ("reply",):
            raise FaultSpecError(f"test fault {text!r}: action=fail needs point=reply")
        if cmds is not None and Command.STEP_INPUT in cmds and action != "fail":
            raise FaultSpecError(f"test fault {text!r}: STEP_INPUT (answered as soon as it is read) takes only "
                                 f"action=fail")
        return cls(cmds, after, times, point, action, delay, armed, text=text)

    def take(self, cmd) -> bool:
        """Count a request; True if the fault fires on it."""
        if not self.armed or (self.cmds is not None and cmd not in self.cmds):
            return False
        self.seen += 1
        if self.seen <= self.after or (self.times and self.fired >= self.times):
            return False
        self.fired += 1
        return True


class Faults:
    """The daemon's fault table, shared by its connections (one per daemon with --test-fault)."""

    def __init__(self, specs: list[str], daemon):
        self.specs = [FaultSpec.parse(s) for s in specs]
        self.daemon = daemon
        log.warning("TEST FAULT INJECTION ENABLED: this daemon misbehaves on purpose", faults=list(specs))
        if any(not s.armed for s in self.specs):
            try:
                asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, self.arm)
            except RuntimeError:
                signal.signal(signal.SIGUSR1, lambda *_: self.arm())

    def arm(self) -> None:
        for s in self.specs:
            if not s.armed:
                s.armed, s.seen, s.fired = True, 0, 0
        log.warning("test fault armed")

    def take(self, cmd) -> "Fault | None":
        for s in self.specs:
            if cmd != Command.STEP_INPUT and s.take(cmd):
                return Fault(s, cmd, self.daemon)
        return None

    def refuse_now(self, header: dict, conn) -> bool:
        """A STEP_INPUT with bytes (answered as soon as it is read; not a
        cancellation) that a spec naming it refuses (action=fail)."""
        cmd = header.get("cmd")
        if cmd != Command.STEP_INPUT or header.get("cancel"):
            return False
        for s in self.specs:
            if s.cmds is not None and s.action == "fail" and s.take(cmd):
                Fault(s, cmd, self.daemon)._log(conn)
                return True
        return False


class Fault:
    """One firing: the connection (faulty_connection.py) calls before() and, through send(), reply()."""

    def __init__(self, spec: FaultSpec, cmd, daemon):
        self.spec, self.cmd, self.daemon = spec, cmd, daemon

    def _log(self, conn) -> None:
        name = Command(self.cmd).name if self.cmd in Command._value2member_map_ else self.cmd
        conn.log.warning("test fault fired", cmd=name, point=self.spec.point, action=self.spec.action,
                         delay=self.spec.delay or None, at=f"{time.time():.6f}")

    def _compute_pid(self, conn) -> int | None:
        """The pid of the connection's own compute process (each client computes in its own)."""
        cp = self.daemon.compute.get(conn.client_id)
        proc = cp.proc if cp is not None else None
        return getattr(proc, "pid", None) if proc is not None else None

    async def _act(self, conn) -> bool:
        """Carry out the action; True if the request is finished with (no reply)."""
        a = self.spec.action
        self._log(conn)
        if a == "delay":
            await asyncio.sleep(self.spec.delay)
            return False
        if a == "close":
            conn.abort("test fault")
            return True
        if a == "exit":
            os._exit(EXIT_STATUS)
        if a in ("kill", "crash-compute"):
            pid = self._compute_pid(conn)
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if a == "crash-compute":
                return False
            os.kill(os.getpid(), signal.SIGKILL)
        if a == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            return False
        return False

    async def before(self, conn) -> bool:
        """Called before the handler; True means: drop this request."""
        if self.spec.point == "request":
            return await self._act(conn)
        if self.spec.point == "compute":
            # run the action concurrently with the handler: it fires once the
            # handler awaits, i.e. while the compute process works
            asyncio.get_running_loop().create_task(self._act(conn))
        return False

    async def reply(self, conn, req_id, status, message, blob, fields) -> bool:
        """Called instead of writing the reply; True means: the reply is dealt with."""
        point, a = self.spec.point, self.spec.action
        if point == "reply":
            if a == "fail":
                self._log(conn)
                conn._reply(req_id, Status.FAILED, "test fault: injected compute failure")
                return True
            return await self._act(conn)
        if point != "half":
            return False
        transport = conn.transport
        if transport is None or transport.is_closing():
            return True
        frame = F.encode_frame(P.reply_header(req_id, status, message, **fields), len(blob)) + bytes(blob)
        half = len(frame) // 2
        transport.write(frame[:half])
        if a == "delay":
            transport.pause_reading()  # a pong now would land inside the half-written frame
            await self._act(conn)
            if not transport.is_closing():
                transport.write(frame[half:])
                transport.resume_reading()
            return True
        await self._act(conn)
        if a == "stop" and not transport.is_closing():  # resumed: finish the frame
            transport.write(frame[half:])
        return True

    async def send(self, conn, req_id, fields: dict, out) -> None:
        """Send a handler's result (Connection._send's arguments) as the fault says: reply() first."""
        status, error = fields.pop("status", Status.SUCCESS), fields.pop("error", "")
        if not await self.reply(conn, req_id, status, error, out, fields):
            conn._reply(req_id, status, error, out, **fields)
