"""`python -m trainer [train] ARGS` == `gke-tpu-rl train ARGS`."""

import sys

from trainer.run.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    raise SystemExit(main(args[1:] if args[:1] == ["train"] else args))
