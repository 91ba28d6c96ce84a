"""Example user package: a task and a reward of one's own, named in the trainer config as MODULE:NAME."""
