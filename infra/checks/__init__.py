"""Pre-flight checks: what the program refuses before it registers any resource (the system pool holds its pods, the
grace period covers a SIGTERM checkpoint, trainer.code has the code the trainer config names). Plain functions of the
spec, no Pulumi; they read the bottom floor only."""
