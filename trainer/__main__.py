"""`python -m trainer [train] ARGS` == `gke-tpu-rl train ARGS`; `python -m trainer eval ARGS` == `gke-tpu-rl eval
ARGS`; `python -m trainer export ARGS` == `gke-tpu-rl export ARGS`."""

import sys

if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["eval"]:
        from trainer.run.eval_cli import main as eval_main

        raise SystemExit(eval_main(args[1:]))
    if args[:1] == ["export"]:
        from trainer.run.export import main as export_main

        raise SystemExit(export_main(args[1:], prog="python -m trainer export"))
    from trainer.run.cli import main

    raise SystemExit(main(args[1:] if args[:1] == ["train"] else args))
