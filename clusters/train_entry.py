"""Entry script for a podray run on a Ray cluster; works with both launchers (docs/operations.md):

  ray submit clusters/tpu-v4-32.yaml clusters/train_entry.py -- --set run.runs_root=gs://BUCKET/podray-runs [ARGS]
  ray job submit --working-dir . -- python clusters/train_entry.py --set run.runs_root=/durable/runs [ARGS]

It is `podray train ARGS` connected to the cluster this script runs in: the address Ray job
submission sets ($RAY_ADDRESS), else the cluster of the node `ray submit` runs it on ("auto").

Outputs: a relative or default run directory goes under `run.runs_root` (else $PODRAY_RUNS_ROOT in the
job's environment, e.g. through `--runtime-env-json '{"env_vars": {"PODRAY_RUNS_ROOT": ...}}'`). A
job's working directory is Ray's copy of `--working-dir`, which Ray may delete once no job uses it, so
a run directory that would land there is refused before anything starts, naming run.runs_root. The
run directory and the dashboard's page of the job are printed first, and the run directory again in
the summary line.
"""

import os
import sys

from podray.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--address" not in args:
        args = ["--address", os.environ.get("RAY_ADDRESS") or "auto"] + args
    sys.exit(main(["train"] + args))
