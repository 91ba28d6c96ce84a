"""`python -m trainer.service`: see trainer.service.cli."""

import sys

from trainer.service.cli import main

if __name__ == "__main__":  # importing it (pkgutil.walk_packages in the tests) runs nothing
    sys.exit(main())
