"""The environment as a Pulumi stack, and the tools around it, in wings that import only the floors below them:

    base/        the bottom floor: reads the stack file (or the running stack's config) into the typed spec, and
                 what every wing shares (the pod's trainer config, trainer.code's folder and digest)
    checks/      pre-flight checks of the spec, run before any resource is registered (no Pulumi)
    components/  the Pulumi program and its ComponentResources, one per concern
    offline/     the tools that run the program under mocks on this machine: plan, diff, cost (with its price
                 tables), render, fit, reference
    terraform/   the same program written as Terraform (cdktf)
    cli.py       `gke-tpu-rl`, the verbs over all of them; __main__.py is what `pulumi up` runs

tests/test_layers.py holds the rule; docs/architecture.md says where a new file goes.
"""
