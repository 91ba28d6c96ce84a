"""`python -m trainer [train] ARGS` == `gke-tpu-rl train ARGS`; `python -m trainer eval ARGS` == `gke-tpu-rl eval
ARGS`."""

import sys

if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["eval"]:
        from trainer.run.eval_cli import main as eval_main

        raise SystemExit(eval_main(args[1:]))
    from trainer.run.cli import main

    raise SystemExit(main(args[1:] if args[:1] == ["train"] else args))
