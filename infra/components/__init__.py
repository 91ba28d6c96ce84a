"""The Pulumi program (program.py, what `pulumi up` runs) and its ComponentResources, one per concern. Imports the
checks and the bottom floor, never the offline tools, the Terraform renderer or the CLI."""
