"""Pure functions that build the Kubernetes objects of an environment, as plain dicts.

They are used by the Pulumi program (infra/) and therefore by the offline plan; nothing here talks to a cluster.
"""
