"""`python -m jaxtorch.coverage`: the command line of `jaxtorch.coverage` (see `main`).

A package `__main__` rather than an `if __name__ == "__main__"` block in the module itself: `import jaxtorch`
imports `jaxtorch.coverage`, so running that module as a script would execute it a second time (and
Python warns about it).
"""

import sys

from . import main

sys.exit(main())
