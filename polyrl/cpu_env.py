"""The OpenMP wait policy of every polyrl process, put into the environment before torch loads its OpenMP runtime.

torch's CPU wheel runs its intra-op threads (and MKL's and oneDNN's) on GNU OpenMP (torch/lib/libgomp.so.1), which
reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when torch is imported. By default a thread that reaches a barrier
first spins 300,000 times (a few milliseconds) before it sleeps; beside another busy process those spinning threads
take the time slices that the thread they wait for needs, and a CPU step runs many times slower. Passive waiting
(the threads sleep at once) keeps the speed there (bench/cpu_contention.py; the figures are in docs/operations.md).
Child processes (torchrun ranks, launched servers, a local Ray instance's workers) inherit it from the environment.

This module imports only the standard library: it runs before torch is imported.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import MutableMapping

# Any of these set by the user is their choice of the wait behaviour, left as it is: GOMP_SPINCOUNT overrides the
# wait policy's spin count in libgomp, and KMP_BLOCKTIME is the same choice for an Intel OpenMP build of torch.
WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
# the environment paragraph of `polyrl train | sft | eval | serve | export-hf --help`
CPU_HELP = ("CPU threads: a CPU rank computes on the cores this process may use (its affinity mask) split over the "
            "ranks; POLYRL_CPU_THREADS=N sets the count (OMP_NUM_THREADS does not: torchrun sets it to 1). A "
            "single-process CPU run's threads spin at OpenMP barriers (the fastest on free cores) and their count "
            "follows the machine's load, read every 0.25 s: fewer threads while other processes compute, one when "
            "they take the cores (POLYRL_CPU_GOVERNOR=0 turns that off). Ranks, servers, --async and a fixed "
            "POLYRL_CPU_THREADS wait passively instead (OMP_WAIT_POLICY=PASSIVE, set unless OMP_WAIT_POLICY, "
            "GOMP_SPINCOUNT or KMP_BLOCKTIME is set): threads that spin beside another busy process run a CPU step "
            "many times slower (docs/operations.md, Precision and memory, has the figures).")


def apply_cpu_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Sets DEFAULTS in `environ` (os.environ) unless one of WAIT_KEYS is set there already; returns what it set.
    Takes effect in this process only when called before torch is imported; child processes inherit it either way."""
    env = os.environ if environ is None else environ
    if any(env.get(k) for k in WAIT_KEYS):
        return {}
    env.update(DEFAULTS)
    return dict(DEFAULTS)


GOVERNED_COMMANDS = ("train", "sft", "eval")
GOVERNED = False  # this process loaded OpenMP spinning, and polyrl.cpu_governor sets its thread count (a CPU run)


def governable(environ: MutableMapping[str, str], argv: list[str]) -> bool:
    """A command whose process may spin at barriers, its thread count following the load (polyrl.cpu_governor): one
    process computing alone (no torchrun ranks, no Ray, no --async's second thread of work), polyrl choosing the
    threads (no POLYRL_CPU_THREADS), no wait setting of the user's, and a Linux /proc to read the load from."""
    if len(argv) < 2 or argv[1] not in GOVERNED_COMMANDS or any(environ.get(k) for k in WAIT_KEYS):
        return False
    if environ.get("POLYRL_CPU_THREADS") or environ.get("POLYRL_CPU_GOVERNOR", "1") == "0":
        return False
    if environ.get("WORLD_SIZE", "1") not in ("", "1") or environ.get("RAY_ADDRESS"):
        return False
    if not (os.path.exists("/proc/self/stat") and hasattr(os, "sched_getaffinity")):  # nothing to read the load from
        return False
    return not any(a in ("--use-ray", "--async") for a in argv[2:])


def start_process(argv: list[str] | None = None) -> None:
    """At an entry point, before anything imports torch. A governable command loads torch's OpenMP runtime now with
    libgomp's own spinning wait (GOVERNED); then, and for every other command, the passive wait goes into the
    environment for the processes this one starts (servers, ranks, Ray's workers)."""
    global GOVERNED
    if governable(os.environ, list(sys.argv if argv is None else argv)):
        import torch  # noqa: F401  (libgomp reads the wait policy as torch loads it)
        GOVERNED = True
    apply_cpu_defaults()


@contextlib.contextmanager
def in_this_process(argv: list[str]):
    """start_process for a command run inside a Python program (polyrl.train): torch may be loaded already, with the
    environment as it is now (a wait setting there is the program's); the passive wait that the processes the run
    starts inherit is taken out of the environment again afterwards."""
    before = {k: os.environ.get(k) for k in WAIT_KEYS}
    start_process(argv)
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None  # the program's, if it runs torch already
    try:
        yield
    finally:
        if "polyrl.cpu_governor" in sys.modules:  # the run's governor ends with it
            sys.modules["polyrl.cpu_governor"].stop()
        if threads is not None:
            torch.set_num_threads(threads)
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def wait_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The wait settings this process runs with (WAIT_KEYS that are set): what a process started outside this
    process's environment (a Ray cluster's workers) is given."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in WAIT_KEYS if env.get(k)}
