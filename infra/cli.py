"""`gke-tpu-rl`: `plan` (the stack under Pulumi mocks, offline), `synth` (the same environment as Terraform), `fit`
(the trainer compiled for a TPU slice on this machine), `status` (the deployed environment's jobs, read with kubectl),
`train` (the trainer's own CLI), `eval` (its held-out eval of a checkpoint) and `export` (a run's checkpoint as a
Hugging Face checkpoint)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from envspec.config import EnvironmentSpec
    from infra.base.pod_config import FitJob
    from trainer.fit.preflight import FitReport
    from trainer.fit.search import SearchResult

EXIT_OK = 0
EXIT_CONFIG = 2  # bad stack config, unknown environment, unreadable file: the message says which
EXIT_NO_FIT = 3  # fit / plan --fit: a trainer program does not fit in HBM; the message names it and what to change


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gke-tpu-rl",
        description="A GKE + Cloud TPU RL training environment (Pulumi) and its trainer.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan = sub.add_parser(
        "plan", help="show what an environment's stack declares, without credentials or the Pulumi CLI",
        description="Runs the real Pulumi program under mocks and prints every resource it would register, "
        "a summary, and the stack outputs (secrets masked).")
    plan.add_argument("env", nargs="?", metavar="ENV",
                      help="environment (stack) name: reads environments/Pulumi.ENV.yaml; omit for all")
    plan.add_argument("--all", action="store_true", help="plan every environments/Pulumi.*.yaml")
    plan.add_argument("--config-file", type=Path, metavar="FILE",
                      help="plan this stack config file instead; ENV then names the stack (default: from FILE)")
    plan.add_argument("--out", type=Path, metavar="DIR",
                      help="write each Kubernetes object as DIR/kind-name.yaml, plus DIR/resources.json and "
                      "DIR/plan.md (with several environments: DIR/ENV/...)")
    plan.add_argument("--format", choices=("text", "markdown"), default="text",
                      help="text (a tree for the terminal) or markdown (for a PR comment)")
    plan.add_argument("--diff", metavar="GIT_REF",
                      help="compare with the plan at GIT_REF (its program and stack file, e.g. origin/main): "
                      "resources and Kubernetes objects added, removed and changed, TPU chips and list price; "
                      "the delta comes first")
    plan.add_argument("--fit", action="store_true",
                      help="also compile the environment's trainer for its TPU slices (as `fit ENV`) and add the "
                      "summary; exits 3 when a program does not fit")
    fit = sub.add_parser(
        "fit", help="compile the trainer for a TPU slice on this machine: HBM per chip, FLOPs, MFU",
        description="Compiles the trainer's jitted programs (sample, reference log-probs, update) with libtpu for "
        "a TPU topology, on this CPU machine, and reports per-chip HBM against what libtpu lets a program use "
        "(e.g. 31.25 of a v6e chip's 32 GiB), FLOPs, estimated time and MFU of one RL step (none for a config "
        "that does not fit). Exit 0: fits (a warning above 90% of the usable HBM); 3: a program does not fit (the "
        "message names it and the settings that reduce it, each with its estimated saving) or --search found "
        "nothing within its budget; 2: bad input.",
        epilog="examples: gke-tpu-rl fit dev | gke-tpu-rl fit --config run.yaml --tpu v6e:4x4 --slices 2 "
        "--set rl.group_size=16 | gke-tpu-rl fit --config qwen3-8b-grpo-v6e-4x4.yaml --tpu v6e:4x4 --model "
        "qwen3-8b --format markdown | gke-tpu-rl fit prod --search --budget 8")
    fit.add_argument("env", nargs="?", metavar="ENV",
                     help="environment: its trainer's slice group, slice count, trainer.config and trainer.args")
    fit.add_argument("--config-file", type=Path, metavar="FILE", help="read ENV's stack config from FILE")
    fit.add_argument("--config", metavar="YAML",
                     help="trainer config file (or the name of one under trainer/configs/); with ENV it replaces "
                     "trainer.config, without ENV --tpu is required")
    fit.add_argument("--tpu", metavar="TYPE:TOPOLOGY", help="with --config: the slice, e.g. v6e:4x4 or v5p:4x4x4")
    fit.add_argument("--slices", type=int, default=1, metavar="N", help="with --config: how many slices (default 1)")
    fit.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a trainer config value after the environment's (repeatable)")
    fit.add_argument("--model", metavar="NAME",
                     help="size this bundled model instead (case-insensitive): see trainer/presets/")
    fit.add_argument("--format", choices=("text", "markdown", "json"), default="text",
                     help="text (tables for the terminal), markdown (a PR comment) or json")
    fit.add_argument("--search", action="store_true",
                     help="when a program does not fit, search for the fastest settings that fit and print them as "
                     "--set flags: compute.remat, compute.train_micro_batch_size, compute.logprob_chunk, "
                     "sampling.max_num_sequences, sampling.gather_weights (the maths unchanged but for rounding); "
                     "only if none of those fits, bf16 compute.grad_accum_dtype, compute.dtype, compute.param_dtype. "
                     "Never the rl batch, the optimizer or the model. Candidates go fastest first by estimated time, "
                     "skipping those estimated not to fit; exit 0 with the report of the fitting config, 3 with "
                     "what was tried")
    fit.add_argument("--budget", type=int, default=None, metavar="N",
                     help="with --search: at most N program compiles in all (default 12), the config as given "
                     "included (it takes up to 3: sample, ref_logprobs, update); a setting that leaves a program's "
                     "compiled code unchanged does not compile it again, so a candidate usually takes 1")
    sub.add_parser("train", add_help=False, help="run the trainer (gke-tpu-rl train --help for its flags)")
    sub.add_parser("eval", add_help=False, help="score a run's checkpoint on the task's held-out split (gke-tpu-rl "
                   "eval --help)")
    sub.add_parser("export", add_help=False, help="write a run's checkpoint as a Hugging Face checkpoint or PEFT "
                   "adapter (gke-tpu-rl export --help for its flags)")
    sub.add_parser("service", add_help=False, help="the Tinker-compatible post-training service: API keys, the API "
                   "and its engine (gke-tpu-rl service --help)")
    synth = sub.add_parser(
        "synth", help="write an environment as Terraform (cdktf JSON): three stacks, applied in order",
        description="Runs the same Pulumi program under mocks and writes each environment as Terraform JSON through "
        "CDK for Terraform's prebuilt google, helm and kubernetes bindings: OUT/ENV/stacks/gcp (the GCP resources), "
        "stacks/controllers (the Helm releases) and stacks/workloads (every Kubernetes object as a "
        "kubernetes_manifest), each with a gcs state backend, plus OUT/ENV/build-image.sh for the trainer image. "
        "Needs the cdktf venv `make install` builds; no credentials, no network.")
    synth.add_argument("env", nargs="?", metavar="ENV",
                       help="environment (stack) name: reads environments/Pulumi.ENV.yaml; omit for all")
    synth.add_argument("--all", action="store_true", help="every environments/Pulumi.*.yaml")
    synth.add_argument("--config-file", type=Path, metavar="FILE", help="this stack config file instead")
    synth.add_argument("--out", type=Path, default=Path("terraform-out"), metavar="DIR",
                       help="where to write OUT/ENV/stacks/<stack>/cdk.tf.json (default: terraform-out)")
    synth.add_argument("--state-bucket", metavar="BUCKET",
                       help="the gcs backend's bucket (default: <project>-tfstate); each stack's state is under "
                       "gke-tpu-rl/ENV/<stack>")
    status = sub.add_parser(
        "status", help="what runs in an environment's cluster, what is pending and why (reads it with kubectl)",
        description="Reads the environment's namespace with `kubectl get -o json` (JobSets, Kueue Workloads, pods, "
        "events) and prints one screen: each JobSet, Kueue's verdict (admitted to which flavor, or pending with the "
        "scheduler's message), its state and restarts against maxRestarts, its pods by phase, why pending pods wait, "
        "and the last exit codes with what they mean. Exit 0; 1 when the cluster cannot be read; 2 on a bad ENV.",
        epilog="docs/operations.md has the runbook around it")
    status.add_argument("env", metavar="ENV", help="environment: its namespace and job names come from its stack file")
    status.add_argument("--config-file", type=Path, metavar="FILE", help="read ENV's stack config from FILE")
    status.add_argument("--context", metavar="CTX", help="the kubeconfig context (default: the current one)")
    status.add_argument("--kubeconfig", metavar="FILE", help="the kubeconfig file (default: kubectl's)")
    ref = sub.add_parser(
        "reference", help="print the stack or trainer config reference, or rewrite both docs with --write",
        description="Renders docs/stack-config.md and docs/trainer-config.md from the typed specs "
        "(envspec/config.py, trainer/base/config.py): every key, its type, default, allowed values and description.")
    ref.add_argument("doc", nargs="?", choices=("stack", "trainer"),
                     help="which reference (default: both, or the stack's when printing)")
    ref.add_argument("--write", action="store_true", help="write it (or both) under docs/ instead of printing")
    return p


def _env_from_file(path: Path) -> str:
    # Pulumi.<env>.yaml names its stack; any other file name is used as-is.
    name = path.name
    if name.startswith("Pulumi.") and name.endswith((".yaml", ".yml")):
        return name.split(".", 1)[1].rsplit(".", 1)[0]
    return path.stem


def _selected_envs(args: argparse.Namespace, root: Path) -> list[str] | None:
    """The environments `plan` or `synth` covers: ENV, the --config-file's, or every environments/ file; None (the
    error printed) for --all with --config-file, or no environment at all."""
    from infra.base.stack_file import available_envs

    if args.config_file is not None:
        if args.all:
            print("error: --all and --config-file do not go together", file=sys.stderr)
            return None
        return [args.env or _env_from_file(args.config_file)]
    if args.env and not args.all:
        return [args.env]
    envs = available_envs(root)
    if not envs:
        print(f"error: no environments/Pulumi.*.yaml under {root}", file=sys.stderr)
        return None
    return envs


def _console() -> Console:
    from rich.console import Console

    # Piped output (make demo | tee, CI logs) gets a width that keeps the tables readable.
    return Console(width=None if sys.stdout.isatty() else 200)


def _run_fit(job: FitJob, model: str | None = None) -> FitReport:
    """Compile a job (JAX and libtpu are imported here, never for a plain plan); progress goes to stderr."""
    from trainer.fit.split import fit  # any placement (a split config's groups and push)

    return fit(job.cfg, job.target, title=job.title, model=model,
               progress=lambda msg: print(f"{msg} ...", file=sys.stderr, flush=True))


def _run_search(job: FitJob, model: str | None, budget: int) -> SearchResult:
    """`fit --search`: trainer.fit.search over the job's config; progress on stderr, as for _run_fit."""
    from trainer.fit.search import search

    return search(job.cfg, job.target, title=job.title, model=model, budget=budget,
                  progress=lambda msg: print(f"{msg} ...", file=sys.stderr, flush=True))


SEARCH_BUDGET = 12  # program compiles: the config as given and about ten candidates


def _fit(args: argparse.Namespace) -> int:
    from envspec.config import ConfigError
    from infra.base.pod_config import env_job
    from infra.base.stack_file import PlanError, env_spec
    from infra.offline import render
    from infra.offline.fit import file_job
    from trainer.base.config import ConfigError as TrainerConfigError

    try:
        if args.budget is not None and not args.search:
            raise ConfigError("--budget goes with --search")
        budget = SEARCH_BUDGET if args.budget is None else args.budget
        if budget < 1:
            raise ConfigError(f"--budget {budget}: must be 1 or more")
        if args.env is None and args.config_file is None:
            if not args.config or not args.tpu:
                raise ConfigError("fit needs ENV, or --config YAML with --tpu TYPE:TOPOLOGY (e.g. v6e:4x4)")
            job = file_job(args.config, args.tpu, args.slices, args.overrides)
        else:
            if args.tpu or args.slices != 1:
                raise ConfigError("--tpu and --slices go with --config alone; ENV fits its trainer's own slices")
            env = args.env or _env_from_file(args.config_file)
            job = env_job(env_spec(env, args.config_file), args.config, args.overrides)
        found = _run_search(job, args.model, budget) if args.search else None
        report = (found.report or found.base) if found is not None else _run_fit(job, args.model)
    except (ConfigError, PlanError, TrainerConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.format == "json":
        doc = report.to_json() | ({"search": found.to_json()} if found is not None else {})
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    elif args.format == "markdown":
        sys.stdout.write(report.markdown() + (found.markdown() if found is not None else ""))
    else:
        render.print_fit(report, _console())  # the errors and what to change are part of it
        if found is not None:
            render.print_fit_search(found, _console())
    if not report.fits:
        _no_fit(report, verbose=args.format != "text", searched=found is not None)
        if found is not None:
            print(f"error: {found.lines()[0]}", file=sys.stderr)
        return EXIT_NO_FIT
    return EXIT_OK


def _no_fit(report: FitReport, env: str | None = None, verbose: bool = True, searched: bool = False) -> None:
    """On stderr: each program that does not fit and what would reduce it, or (after a text report that shows
    them) one line naming the programs; unless a search ran, how to have the settings found."""
    where = f"{env}: " if env else ""
    if verbose:
        for e in report.errors():
            print(e if e.startswith("  ") else f"error: {where}{e}", file=sys.stderr)
    else:
        names = ", ".join(p.name for p in report.failures)
        print(f"error: {where}does not fit on {report.target.label}: {names} (see above for what to change)",
              file=sys.stderr)
    # A service config's capacity (slots, rank, tokens per pass) is the operator's choice: --search refuses it.
    if not searched and report.failures and report.service is None:
        print(f"hint: `gke-tpu-rl fit {env or '...'} --search` compiles candidate settings and prints the fastest "
              "that fit", file=sys.stderr)


def _plan(args: argparse.Namespace) -> int:
    from envspec.config import ConfigError
    from infra.base.stack_file import PlanError, repo_root
    from infra.offline import render
    from infra.offline.diff import diff_plan
    from infra.offline.diff import markdown as diff_markdown
    from infra.offline.diff import text as diff_text
    from infra.offline.plan import plan, write_out

    root = repo_root()
    envs = _selected_envs(args, root)
    if envs is None:
        return EXIT_CONFIG
    console = _console()
    status = EXIT_OK
    for i, env in enumerate(envs):
        try:
            result = plan(env, args.config_file, root)
            delta = diff_plan(result, args.diff, root) if args.diff else None
            if delta is not None and delta.new.plan is not None:
                result = delta.new.plan  # with the image's stand-in digest the diff shows: one digest per revision
            report = _plan_fit(result.spec) if args.fit else None
        except (ConfigError, PlanError) as e:
            print(f"error: {e}", file=sys.stderr)
            status = EXIT_CONFIG
            continue
        if report is not None and not report.fits:
            _no_fit(report, env, verbose=args.format != "text")
            status = max(status, EXIT_NO_FIT)
        md = render.markdown(result, report)
        if delta is not None:
            md = diff_markdown(delta) + "\n" + md  # the delta first: it is what the reviewer decides on
        if args.format == "markdown":
            sys.stdout.write(("\n" if i else "") + md)  # verbatim: no wrapping, markup or emoji codes
        else:
            if i:
                console.print()
            if delta is not None:
                console.print(diff_text(delta), highlight=False, markup=False)
            render.print_text(result, console, report)
        if args.out is not None:
            out_dir = args.out / env if len(envs) > 1 else args.out
            written = write_out(result, out_dir, markdown=md)
            print(f"wrote {len(written)} files to {out_dir}", file=sys.stderr)
    return status


def _synth(args: argparse.Namespace) -> int:
    from envspec.config import ConfigError
    from infra.base.stack_file import PlanError, load_stack_config, repo_root, stack_file
    from infra.terraform import synth
    from infra.terraform.document import TerraformError, synthesize

    root = repo_root()
    envs = _selected_envs(args, root)
    if envs is None:
        return EXIT_CONFIG
    documents, refused = [], 0
    for env in envs:  # every environment's problems at once, as cdktf reports every document it refuses
        path = args.config_file if args.config_file is not None else stack_file(env, root)
        try:
            documents.append(synthesize(env, load_stack_config(path), args.state_bucket).document)
        except (ConfigError, PlanError, TerraformError) as e:
            print(f"error: {e}", file=sys.stderr)
            refused += 1
    if refused:
        return EXIT_CONFIG
    try:
        synth.write(documents, args.out)
    except synth.SynthError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    for doc in documents:
        print(synth.next_steps(doc, args.out))
    return EXIT_OK


def _plan_fit(spec: EnvironmentSpec) -> FitReport | None:
    """`plan --fit`: the environment's trainer (or, without one, its service's engine), as `fit ENV` compiles it;
    None when it has neither."""
    from envspec.config import ConfigError
    from infra.base.pod_config import env_job
    from trainer.base.config import ConfigError as TrainerConfigError

    if not spec.trainer.enabled and spec.service is None:
        return None
    try:
        return _run_fit(env_job(spec))
    except TrainerConfigError as e:
        raise ConfigError(f"{spec.env}: fit: {e}") from None


EXIT_UNREACHABLE = 1  # status: kubectl could not read the cluster


def _status(args: argparse.Namespace) -> int:
    from envspec.config import ConfigError
    from infra.base.stack_file import PlanError, env_spec
    from infra.offline import status

    try:
        spec = env_spec(args.env, args.config_file)
    except (ConfigError, PlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        objects = status.read(spec.queues.namespace, args.context, args.kubeconfig)
    except status.StatusError as e:
        print(f"error: {e}", file=sys.stderr)
        print("hint: gcloud container clusters get-credentials CLUSTER --location LOCATION --dns-endpoint sets up "
              "kubectl (`pulumi stack output clusterName`)", file=sys.stderr)
        return EXIT_UNREACHABLE
    where = f"context {args.context}" if args.context else ""
    sys.stdout.write(status.report(spec, objects, where))
    return EXIT_OK


def _reference(args: argparse.Namespace) -> int:
    from infra.base.stack_file import repo_root
    from infra.offline import reference

    if args.write:
        for path in reference.write(repo_root(), [args.doc] if args.doc else None):
            print(f"wrote {path}", file=sys.stderr)
    else:
        sys.stdout.write(reference.DOCS[args.doc or "stack"][1]())
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:
        # Everything after `train` belongs to the trainer; import it only when asked (it pulls in JAX).
        from trainer.run.cli import main as train_main

        return int(train_main(argv[1:]) or 0)
    if argv[:1] == ["eval"]:
        from trainer.run.eval_cli import main as eval_main

        return int(eval_main(argv[1:]) or 0)
    if argv[:1] == ["export"]:
        from trainer.run.export import main as export_main

        return int(export_main(argv[1:]) or 0)
    if argv[:1] == ["service"]:
        from trainer.service.cli import main as service_main

        return int(service_main(argv[1:], prog="gke-tpu-rl service") or 0)
    args = build_parser().parse_args(argv)
    if args.command == "reference":
        return _reference(args)
    if args.command == "synth":
        return _synth(args)
    if args.command == "status":
        return _status(args)
    return _fit(args) if args.command == "fit" else _plan(args)


if __name__ == "__main__":
    sys.exit(main())
