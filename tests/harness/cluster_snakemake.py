"""Snakemake's own command line with one change, for the tests that submit to the CI's Slurm:
the jobs' states are checked every `POLL_S` seconds.

The Slurm executor plugin (2.x) waits 10 s longer after each status check that finds no job
finished (up to 180 s), to spare a shared controller. On the tests' one-machine Slurm that put
Snakemake a minute behind a job that had failed (22 % of the two-node test), and up to 30 s
behind one that had finished. The tests keep the plugin, its submissions and its checks (squeue,
as profiles/slurm-local sets); only the wait between the checks is fixed. Run as a script:
    python tests/harness/cluster_snakemake.py --workflow-profile profiles/slurm-local all
"""

import sys

from snakemake.cli import main
from snakemake_interface_executor_plugins.executors.remote import RemoteExecutor

POLL_S = 2

# The plugin sets the next wait on its executor after each check; the property lives on the
# interface's base class, so fixing it there fixes the wait Snakemake's scheduler sleeps.
RemoteExecutor.next_seconds_between_status_checks = property(
    lambda self: POLL_S, lambda self, value: None
)

if __name__ == "__main__":
    sys.exit(main())
