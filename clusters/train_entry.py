"""Entry script for a podray run on a Ray cluster; works with both launchers:

  ray submit clusters/tpu-v4-32.yaml clusters/train_entry.py -- [PRESET] --set run.tpu_topology=2x2x4 ...
  ray job submit --address http://HEAD:8265 --working-dir . -- python clusters/train_entry.py [ARGS]

It is `podray train ARGS` connected to the cluster this script runs in: the address Ray job
submission sets ($RAY_ADDRESS), else the cluster of the node `ray submit` runs it on ("auto").
"""

import os
import sys

from podray.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--address" not in args:
        args = ["--address", os.environ.get("RAY_ADDRESS") or "auto"] + args
    sys.exit(main(["train"] + args))
