"""`python -m trainer.service`: see trainer.service.cli."""

import sys

if __name__ == "__main__":
    # The service never uses torch and the image has none, but tinker's types import it wherever it is installed (a
    # dev install, the tests): 1.5 s and 230 MB more per process. Absent here, as in the image.
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]  # None marks a module as not importable

from trainer.service.cli import main  # noqa: E402

if __name__ == "__main__":  # importing it (pkgutil.walk_packages in the tests) runs nothing
    sys.exit(main())
