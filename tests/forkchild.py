"""A child for tests/test_forkserver.py: prints what a process sees of its start
(argv, working directory, `sys.path[0]`, one variable, whether turnlog is loaded)
as one JSON line, then exits with the code its last argument names."""

import json
import os
import sys

if __name__ == "__main__":
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
                      "var": os.environ.get("FORKCHILD_VAR"), "stdin": sys.stdin.read(),
                      "app_loaded": "app" in sys.modules, "name": __name__}))
    sys.exit(int(sys.argv[-1]))
