"""The run floor: how the trainer starts on processes and hosts (the command line, the multi-host environment, local
processes, Ray Train, the compilation cache). Imports only the floors below it (docs/architecture.md)."""
