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

import os
from collections.abc import MutableMapping

# Any of these set by the user is their choice of the wait behaviour, left as it is: GOMP_SPINCOUNT overrides the
# wait policy's spin count in libgomp, and KMP_BLOCKTIME is the same choice for an Intel OpenMP build of torch.
WAIT_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
# the environment paragraph of `polyrl train | sft | eval | serve | export-hf --help`
CPU_HELP = ("CPU threads: a CPU rank computes on the cores this process may use (its affinity mask) split over the "
            "ranks; POLYRL_CPU_THREADS=N sets the count (OMP_NUM_THREADS does not: torchrun sets it to 1). Their "
            "OpenMP runtime waits passively at barriers (OMP_WAIT_POLICY=PASSIVE, set unless OMP_WAIT_POLICY, "
            "GOMP_SPINCOUNT or KMP_BLOCKTIME is set): threads that spin there run a CPU step many times slower "
            "beside any other busy process (docs/operations.md, Precision and memory, has the figures).")


def apply_cpu_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Sets DEFAULTS in `environ` (os.environ) unless one of WAIT_KEYS is set there already; returns what it set.
    Takes effect in this process only when called before torch is imported; child processes inherit it either way."""
    env = os.environ if environ is None else environ
    if any(env.get(k) for k in WAIT_KEYS):
        return {}
    env.update(DEFAULTS)
    return dict(DEFAULTS)


def wait_env(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The wait settings this process runs with (WAIT_KEYS that are set): what a process started outside this
    process's environment (a Ray cluster's workers) is given."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in WAIT_KEYS if env.get(k)}
