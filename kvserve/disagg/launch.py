"""`kvserve serve --disaggregation xPyD`: a whole one-host set for trying disaggregation.

x prefill servers (`--role prefill`) and y decode servers (`--role decode`) start as child
processes on free loopback ports, each with the engine flags this command was given
(`--threads`, if not given, is cores / (x + y), since they share the host's cores), and a
router (`kvserve router --prefill … --decode …`) serves in front of them on --host/--port.
The handoffs go through the shared-memory transport, since every server is on this host.
Ending this process (SIGINT, SIGTERM) stops the servers.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvserve.errors import ConfigError

_SPEC = re.compile(r"(\d+)P(\d+)D", re.IGNORECASE)
_SERVING = re.compile(r"serving \S+ at (http://\S+)/v1")
# this command's own flags: not passed to the servers (they get a loopback port each)
_OWN_FLAGS = {"--disaggregation": 1, "--port": 1, "--host": 1, "--role": 1}


def parse_spec(spec: str) -> tuple[int, int]:
    match = _SPEC.fullmatch(spec.strip())
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise ConfigError("disaggregation", f"expected xPyD with x, y >= 1 (e.g. 1P1D, 2P1D), got {spec!r}")
    return int(match.group(1)), int(match.group(2))


def server_argv(argv: list[str]) -> list[str]:
    """`kvserve serve`'s arguments minus this command's own (with their values)."""
    out, skip = [], 0
    for arg in argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in _OWN_FLAGS:
            skip = 0 if "=" in arg else _OWN_FLAGS[name]
            continue
        out.append(arg)
    return out


def start_and_wait(cmd: list[str], log: Path, pattern: re.Pattern, timeout_s: float = 300,
                   field: str = "disaggregation") -> tuple[subprocess.Popen, re.Match]:  # fmt: skip
    """Start a kvserve process with its output in `log`, and wait for the line saying where it
    serves (`pattern`); a process that exits or takes longer is a ConfigError (naming `field`) with its log."""
    out = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = pattern.search(log.read_text(errors="replace"))
        if match:
            return proc, match
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise ConfigError(field, f"{' '.join(cmd[2:5])} did not start; its log ({log}):\n{log.read_text()[-3000:]}")


def run_disaggregated(args) -> int:
    num_prefill, num_decode = parse_spec(args.disaggregation)
    argv = sys.argv[sys.argv.index("serve") + 1 :] if "serve" in sys.argv else []
    base = [sys.executable, "-m", "kvserve.cli", "serve", *server_argv(argv), "--host", "127.0.0.1", "--port", "0"]
    if not any(a.split("=", 1)[0] == "--threads" for a in argv):
        # the servers of one host share its cores, as tensor-parallel ranks do: cores / (x + y) each
        base += ["--threads", str(max(1, (os.cpu_count() or 1) // (num_prefill + num_decode)))]
    logs = Path(tempfile.mkdtemp(prefix="kvserve-disagg-"))
    procs: list[subprocess.Popen] = []
    try:
        urls = {"prefill": [], "decode": []}
        for role, count in (("prefill", num_prefill), ("decode", num_decode)):
            for i in range(count):
                proc, match = start_and_wait([*base, "--role", role], logs / f"{role}{i}.log", _SERVING)
                procs.append(proc)
                url = match.group(1)
                urls[role].append(url)
                print(f"kvserve: {role} server {i} at {url} (log {logs / f'{role}{i}.log'})", file=sys.stderr, flush=True)
        router = [sys.executable, "-m", "kvserve.cli", "router", "--host", args.host, "--port", str(args.port),
                  "--prefill", *urls["prefill"], "--decode", *urls["decode"]]  # fmt: skip
        if args.api_key:
            router += ["--api-key", args.api_key, "--replica-api-key", args.api_key]
        front = subprocess.Popen(router)
        procs.append(front)
        for sig in (signal.SIGINT, signal.SIGTERM):  # passed to the router, whose exit ends this command
            signal.signal(sig, lambda *_: front.send_signal(signal.SIGINT))
        return front.wait()
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
