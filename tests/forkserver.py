"""Start ``python -m <module>`` and ``python -c <script>`` commands without paying the interpreter's start-up each time.

Most of a short command's time is importing torch, pandas and Hydra (about 2 s of a 2.7 s run on a 2-core CPU). A
fork server imports them once per test worker, then forks one child per command; the child takes the command's
argv, environment, working directory and standard streams and runs the module as ``__main__`` (``runpy``) or the
script, exactly as a fresh interpreter would run it after those imports. Exit status, stdout and stderr come back
as from ``subprocess.run``. The child ends as an interpreter ends (threads joined, atexit handlers run, streams
flushed) but skips the teardown of its modules (0.65 s of CPU a command): anything a ``__del__`` would print while
the modules are torn down is not seen here (a real subprocess, as on a CUDA machine, shows it).

Only where forking is safe and nothing the imports read would differ: on a machine without CUDA (no driver state to
inherit), and for environments that change no variable read at import time. Everywhere else ``run`` falls back to
a real subprocess, so a test never depends on which of the two ran it.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

ROOT = Path(__file__).parent.parent
# Variables a fresh interpreter reads while importing what the server pre-imports: a command whose environment
# changes one of them runs as a real subprocess. CUDA_VISIBLE_DEVICES is not one: the server forks only on a machine
# without CUDA (``usable``), where hiding the devices hides none.
READ_AT_IMPORT = ("TRITON_INTERPRET", "PYTHONHASHSEED", "PYTHONWARNINGS", "OMP_NUM_THREADS",
                  "MKL_NUM_THREADS", "LD_PRELOAD", "PYTHONSAFEPATH")  # fmt: skip
# What `python -m rlsweep` and its sibling commands import before they start.
PRELOAD = ("hydra", "omegaconf", "pandas", "pyarrow.parquet", "rlsweep.callbacks", "rlsweep.check", "rlsweep.report",
           "rlsweep.job", "rlsweep.run", "kernels")  # fmt: skip

SERVER = r"""
import json, os, signal, sys
for name in json.loads(sys.argv[1]):
    __import__(name)
try:  # what a whole model's run builds (the optional extra "model")
    import transformers.models.qwen3.modeling_qwen3
except ImportError:
    pass
if os.environ.get("TRITON_INTERPRET") == "1":
    import kernels.triton_kernels
requests, replies = sys.stdin.buffer, sys.stdout
request = None
while request is None:
    line = requests.readline()
    if not line:
        raise SystemExit(0)
    asked = json.loads(line)
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        request = asked
        break
    replies.write(json.dumps({"pid": pid}) + "\n"); replies.flush()
    _, status = os.waitpid(pid, 0)
    replies.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n"); replies.flush()
# The child: become the command.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
devnull = os.open(os.devnull, os.O_RDONLY)
os.dup2(devnull, 0)
os.dup2(os.open(request["stdout"], os.O_WRONLY | os.O_TRUNC), 1)
os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_TRUNC), 2)
os.chdir(request["cwd"])
os.environ.clear()
os.environ.update(request["env"])
sys.path[0] = request["cwd"] if request["mode"] == "-m" else ""
# PYTHONPATH's entries come right after the script's dir, as a fresh interpreter orders them.
added = [entry for entry in request["env"].get("PYTHONPATH", "").split(os.pathsep) if entry]
sys.path[1:1] = [os.path.abspath(entry) for entry in added if entry not in sys.path]
sys.argv = [request["mode"], *request["args"]]
mode, target = request["mode"], request["target"]
del added, request, asked, requests, replies, pid, line, name, devnull
# End as the interpreter ends up to tearing its modules down, then exit without that teardown, as rlsweep's own
# command lines end (0.65 s of CPU a command, for nothing the command does).
from rlsweep.exitcodes import exit_without_teardown as end


try:
    if mode == "-m":
        import runpy
        del mode
        runpy.run_module(target, run_name="__main__", alter_sys=True)  # sets sys.argv[0] to the module's file
    else:
        del mode
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit as stop:  # the interpreter's exit status for it; any other exception ends as in a fresh one
    if stop.code is None or isinstance(stop.code, int):
        end(stop.code or 0)
    print(stop.code, file=sys.stderr)
    end(1)
end(0)
"""


def usable() -> bool:
    """Forking is safe where no CUDA state can be inherited and the platform forks."""
    return (
        hasattr(os, "fork") and not torch.cuda.is_available() and os.environ.get("RLSWEEP_TESTS_NO_FORKSERVER") != "1"
    )


class ForkServer:
    """One server process per test process; ``run`` is serialised (one command at a time per server)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None

    def start(self) -> subprocess.Popen:
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [sys.executable, "-c", SERVER, json.dumps(PRELOAD)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                cwd=ROOT,
                text=True,
            )
            atexit.register(self.stop)
        return self.process

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=30)

    def run(self, mode: str, target: str, args: list[str], env: dict[str, str], cwd: Path,
            timeout: float) -> subprocess.CompletedProcess:  # fmt: skip
        with self.lock, tempfile.TemporaryDirectory(prefix="forkserver-") as scratch:
            out, err = Path(scratch) / "stdout", Path(scratch) / "stderr"
            out.touch()
            err.touch()
            server = self.start()
            request = {"mode": mode, "target": target, "args": args, "env": env, "cwd": str(cwd),
                       "stdout": str(out), "stderr": str(err)}  # fmt: skip
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
            pid = json.loads(server.stdout.readline())["pid"]
            killed = threading.Event()
            timer = threading.Timer(timeout, kill, (pid, killed))
            timer.start()
            try:
                status = json.loads(server.stdout.readline())["status"]
            finally:
                timer.cancel()
            if killed.is_set():
                raise subprocess.TimeoutExpired([sys.executable, mode, target, *args], timeout)
            command = [sys.executable, mode, target, *args]
            return subprocess.CompletedProcess(command, status, out.read_text(), err.read_text())


def kill(pid: int, killed: threading.Event) -> None:
    """The timeout of one command: kill its child as ``subprocess.run`` kills a command that ran too long."""
    killed.set()
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


SERVER_OF_THIS_PROCESS = ForkServer()


def run(mode: str, target: str, args: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess:  # fmt: skip
    """``python <mode> <target> <args>`` (``mode`` ``-m`` or ``-c``) with ``env`` added to this process's environment,
    captured as text like ``subprocess.run(..., capture_output=True, text=True)``."""
    environment = {**os.environ, **(env or {})}
    same_imports = all(environment.get(key) == os.environ.get(key) for key in READ_AT_IMPORT)
    if usable() and same_imports:
        return SERVER_OF_THIS_PROCESS.run(mode, target, args, environment, cwd or Path.cwd(), timeout)
    command = [sys.executable, mode, target, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment, cwd=cwd)
